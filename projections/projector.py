"""``stepstream run projector``: keeps the state store in step with ``events`` and ``dlq``.

It resumes from the offsets stored in the database (not the consumer group's), because those are
committed in the same transaction as the rows: the store is a deterministic function of the log.

Events are applied a batch at a time: the handler only buffers, and the consumer runtime's
``on_batch_end`` hook writes the batch and its offsets in one transaction before the runtime stores its
own offsets. A SIGKILL mid-batch loses only an uncommitted transaction, redone from the stored offsets.

The ``dlq`` topic holds raw bytes that may not decode (that is why they are there), so the consumer
runtime, which dead-letters what it cannot decode, cannot read it. A small follower thread tails it
instead, assigned to every partition at the stored offsets, with the same one-transaction batches.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Sequence
from typing import TypeVar

import structlog
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from eventstore.dlq import DeadLetter
from eventstore.errors import PoisonMessageError
from eventstore.kafka_config import connection_config, consume_available
from eventstore.producer import EventProducer
from eventstore.runtime import ConsumerRuntime, Record, backoff_delay, is_retryable
from eventstore.settings import ConsumerSettings, KafkaSettings
from eventstore.topics import TopicLayout, reader_group
from projections.dlq_rows import project_dead_letter
from projections.rows import project
from projections.store import BatchResult, Positioned, Projection, Store
from schemas.messages import Event

log = structlog.get_logger("stepstream.projector")
T = TypeVar("T")


def apply_with_retry(store: Store, topic: str, records: Sequence[Positioned[T]], projection: Projection[T],
                     settings: ConsumerSettings, stop: threading.Event) -> BatchResult:
    """Apply a batch, retrying while the database is unavailable (never dropping the batch).

    Once a drain has begun, a failure is final: the batch was not committed, and the next start redoes
    it from the stored offsets.
    """
    rng = random.Random()
    attempt = 0
    while True:
        try:
            return store.apply_batch(topic, records, projection)
        except Exception as exc:
            if not is_retryable(exc) or stop.is_set():
                raise
            attempt += 1
            delay = backoff_delay(attempt, settings.retry_initial_backoff_s, settings.retry_max_backoff_s, rng)
            log.warning("state store unavailable; retrying the batch", topic=topic, records=len(records),
                        attempt=attempt, delay_s=round(delay, 3), error=str(exc))
            stop.wait(delay)


class Projector:
    """The events side: buffers each batch in the handler, writes it in ``flush`` (the batch-end hook)."""

    def __init__(self, store: Store, events_topic: str, settings: ConsumerSettings,
                 stop: threading.Event) -> None:
        self.store = store
        self.events_topic = events_topic
        self.settings = settings
        self.stop = stop
        self._pending: list[Positioned[Event]] = []

    def handle(self, record: Record, _output: EventProducer) -> None:
        if not isinstance(record.message, Event):
            raise PoisonMessageError(f"{type(record.message).__name__} does not belong on {record.topic}")
        self._pending.append(Positioned(record.partition, record.offset, record.message))

    def flush(self) -> None:
        if self._pending:
            apply_with_retry(self.store, self.events_topic, self._pending, project, self.settings, self.stop)
            self._pending = []

    def seek_to_stored_offsets(self, partitions: list[TopicPartition]) -> list[TopicPartition]:
        """Called on assignment: start each partition where the database says, whatever the group says."""
        stored = self.store.offsets(self.events_topic)
        return [TopicPartition(tp.topic, tp.partition, stored.get(tp.partition, OFFSET_BEGINNING))
                for tp in partitions]


class DlqFollower:
    """The DLQ side: every partition of ``dlq`` from the stored offsets, into ``dlq_entries``."""

    def __init__(self, bootstrap: str, topic: str, store: Store, settings: ConsumerSettings,
                 stop: threading.Event) -> None:
        self.bootstrap = bootstrap
        self.topic = topic
        self.store = store
        self.settings = settings
        self.stop = stop

    def run(self) -> None:
        consumer = Consumer({
            **connection_config(self.bootstrap),
            "group.id": reader_group("dlq-follower"),
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
        })
        try:
            partitions = self._wait_for_partitions(consumer)
            stored = self.store.offsets(self.topic)
            consumer.assign([TopicPartition(self.topic, p, stored.get(p, OFFSET_BEGINNING)) for p in partitions])
            while not self.stop.is_set():
                batch = [m for m in consume_available(consumer, self.settings.batch_size, self.settings.poll_timeout_s)
                         if m.error() is None]
                if batch:
                    records = [Positioned(m.partition(), m.offset(), DeadLetter.from_message(m)) for m in batch]
                    apply_with_retry(self.store, self.topic, records, project_dead_letter, self.settings, self.stop)
        finally:
            consumer.close()

    def _wait_for_partitions(self, consumer: Consumer) -> list[int]:
        while True:
            topic = consumer.list_topics(self.topic, timeout=30).topics[self.topic]
            if topic.error is None and topic.partitions:
                return sorted(topic.partitions)
            if self.stop.wait(1.0):
                return []


class ProjectorService:
    """Both sides in one process, sharing one store (its lock serializes their transactions)."""

    def __init__(self, runtime: ConsumerRuntime, follower: DlqFollower) -> None:
        self.runtime = runtime
        self.follower = follower
        self._failure: BaseException | None = None

    def run(self) -> None:
        thread = threading.Thread(target=self._follow, name="dlq-follower", daemon=True)
        thread.start()
        try:
            self.runtime.run()
        finally:
            self.runtime.stop()
            thread.join()
        if self._failure is not None:
            raise self._failure

    def _follow(self) -> None:
        try:
            self.follower.run()
        except BaseException as exc:
            log.error("dlq follower failed; stopping the projector", error=repr(exc))
            self._failure = exc
            self.runtime.stop()


def build_projector(kafka: KafkaSettings, consumer: ConsumerSettings, store: Store,
                    stop_event: threading.Event | None = None, group_id: str | None = None) -> ProjectorService:
    layout = TopicLayout.from_settings(kafka)
    stop = stop_event or threading.Event()
    bootstrap = kafka.resolved_bootstrap()
    projector = Projector(store, layout.events, consumer, stop)
    runtime = ConsumerRuntime(
        bootstrap=bootstrap,
        group_id=group_id or layout.projector_group,
        topics=[layout.events],
        handler=projector.handle,
        dlq_topic=layout.dlq,
        settings=consumer,
        on_assign=projector.seek_to_stored_offsets,
        on_batch_end=projector.flush,
        stop_event=stop,
    )
    return ProjectorService(runtime, DlqFollower(bootstrap, layout.dlq, store, consumer, stop))
