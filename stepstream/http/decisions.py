"""Watching ``events`` for the scheduler's answer to a command this process produced.

A write's answer is the system's own decision, so the front waits for the event the command caused (by
its causation id) instead of guessing; one consumer serves every waiting request.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import structlog
from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from eventstore.errors import InfrastructureError
from eventstore.health import HEALTH
from eventstore.kafka_config import connection_config, consume_available
from schemas.codec import default_codec
from schemas.errors import DecodeError
from schemas.messages import Event

log = structlog.get_logger("stepstream.api")


@dataclass
class _Waiter:
    accepts: Callable[[Event], bool]
    done: threading.Event = field(default_factory=threading.Event)
    event: Event | None = None


class DecisionWatcher:
    """Tails ``events`` and hands each event to the request waiting for a decision on its cause.

    It starts at the end offsets read when it starts, explicitly (not "latest", which librdkafka resolves
    only at the first fetch): every event of a command produced after ``start()`` returns is seen.
    """

    def __init__(self, bootstrap: str, topic: str, group: str) -> None:
        """``group``: ``TopicLayout.watcher_group()``, a fresh one under the deployment's prefix."""
        self.topic = topic
        self._consumer = Consumer({**connection_config(bootstrap), "group.id": group,
                                   "enable.auto.commit": False, "isolation.level": "read_committed"})
        self._waiters: dict[str, list[_Waiter]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="decision-watcher", daemon=True)
        self._codec = default_codec()

    def start(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self._consumer.assign(self._end_offsets(timeout_s))
                break
            except KafkaException as exc:
                # A topic just created has no leader for a moment (NOT_LEADER_FOR_PARTITION, which librdkafka
                # does not flag retriable here); past the deadline the error stands.
                if time.monotonic() > deadline:
                    raise InfrastructureError(f"cannot follow {self.topic} for the scheduler's answers: {exc} "
                                              "(are the topics created? `stepstream topics create`)") from exc
                time.sleep(0.2)
        self._thread.start()

    def _end_offsets(self, timeout_s: float) -> list[TopicPartition]:
        metadata = self._consumer.list_topics(self.topic, timeout=timeout_s).topics[self.topic]
        if metadata.error is not None:
            raise KafkaException(metadata.error)
        partitions = metadata.partitions
        if not partitions:
            raise KafkaException(KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART, f"{self.topic} has no partitions"))
        return [TopicPartition(self.topic, p, self._consumer.get_watermark_offsets(
            TopicPartition(self.topic, p), timeout=timeout_s)[1]) for p in sorted(partitions)]

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)
        self._consumer.close()

    @contextmanager
    def expect(self, causation_id: str, accepts: Callable[[Event], bool] = lambda _e: True) -> Iterator[_Waiter]:
        """Register before producing the command whose decision is awaited; unregistered on exit."""
        waiter = _Waiter(accepts)
        with self._lock:
            self._waiters.setdefault(causation_id, []).append(waiter)
        try:
            yield waiter
        finally:
            with self._lock:
                waiting = self._waiters.get(causation_id, [])
                if waiter in waiting:
                    waiting.remove(waiter)
                if not waiting:
                    self._waiters.pop(causation_id, None)

    def _run(self) -> None:
        while not self._stop.is_set():
            HEALTH.beat()  # the API's /livez: a watcher that stopped turning leaves every --wait hanging
            for record in consume_available(self._consumer, 500, 0.2):  # each answer as soon as it is there
                if record.error() is not None:
                    if record.error().code() != KafkaError._PARTITION_EOF:
                        log.warning("events not read", error=str(record.error()))
                    continue
                try:
                    event = self._codec.decode(record.value())
                except DecodeError:
                    continue  # not ours to judge: the projector dead-letters what it cannot read
                if isinstance(event, Event) and event.causation_id is not None:
                    self._deliver(event)

    def _deliver(self, event: Event) -> None:
        with self._lock:
            for waiter in self._waiters.get(event.causation_id or "", []):
                if waiter.event is None and waiter.accepts(event):
                    waiter.event = event
                    waiter.done.set()
