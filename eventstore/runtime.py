"""The consumer loop every service runs.

One loop, two guarantees:

* at-least-once: a message's offset is stored only after its handler returned and everything the
  handler sent was delivered; librdkafka commits stored offsets in the background, and the runtime
  commits synchronously on revoke and on shutdown.
* exactly-once: each batch runs inside one Kafka transaction that also carries the consumed offsets;
  a failed transaction is aborted, the consumer rewinds to the committed offsets, and the service is
  told (``on_abort``) to drop the state it derived from the aborted batch.

Partitions are processed in order, one message at a time. Poison messages (undecodable, schema-invalid,
contradictory) go to the DLQ and the partition moves on; infrastructure faults are retried with
back-off, never dead-lettered, with the partitions paused so the group membership stays alive.
"""

from __future__ import annotations

import contextlib
import queue
import random
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, NamedTuple

import structlog
from confluent_kafka import Consumer, KafkaException, TopicPartition
from confluent_kafka import Message as KafkaMessage
from prometheus_client import Counter, Histogram

from eventstore.dlq import dlq_headers
from eventstore.errors import InfrastructureError, PoisonMessageError, RestartRequired
from eventstore.health import HEALTH
from eventstore.kafka_config import consume_available, consumer_config, kafka_reason
from eventstore.metrics import (
    CONSUMER_LAG,
    DEAD_LETTERS,
    HANDLER_RETRIES,
    HANDLER_SECONDS,
    MESSAGES_PROCESSED,
    TRANSACTIONS_ABORTED,
)
from eventstore.producer import EventProducer, is_fatal, is_retriable, requires_abort
from eventstore.settings import ConsumerSettings
from eventstore.shutdown import GracefulShutdown
from eventstore.stall import EXIT_STALLED, stall_guard
from schemas.codec import Codec, default_codec
from schemas.errors import DecodeError
from schemas.messages import Message

log = structlog.get_logger("stepstream.runtime")

class Record(NamedTuple):
    """A decoded message and where it came from (a tuple: built once per message, it must be cheap)."""

    topic: str
    partition: int
    offset: int
    key: str | None
    message: Message
    headers: list[tuple[str, bytes]]
    value: bytes | None = None  # the bytes ``message`` was decoded from: what a record moved as it is carries


# Called once per decoded record; sends its output through the producer it is given.
Handler = Callable[[Record, EventProducer], None]


PartitionCallback = Callable[[list[TopicPartition]], None]
# Prepares newly assigned partitions off the loop; the second argument says whether a partition is still assigned
# in the assignment being prepared (not revoked since, nor assigned again with a preparation of its own).
PrepareCallback = Callable[[list[TopicPartition], Callable[[TopicPartition], bool]], None]
# May return the partitions with the offsets to start from (a store that keeps its own offsets).
AssignCallback = Callable[[list[TopicPartition]], list[TopicPartition] | None]


def is_retryable(exc: BaseException) -> bool:
    """Infrastructure faults are retryable. An error says so itself (``retryable = True``, as
    ``InfrastructureError`` does: a handler wraps its database's outage in one, as the state store does);
    the broker unreachable, a dropped connection or a timeout pass as they are."""
    if isinstance(exc, PoisonMessageError):
        return False
    if getattr(exc, "retryable", False):
        return True
    return isinstance(exc, (KafkaException, ConnectionError, TimeoutError))


def backoff_delay(attempt: int, initial_s: float, max_s: float, rng: random.Random) -> float:
    """Exponential back-off with full jitter: retrying consumers do not hammer a dependency in step."""
    ceiling: float = min(max_s, initial_s * (2 ** min(attempt, 30)))
    return rng.uniform(initial_s / 2, ceiling)


class _Revoked(Exception):
    """The partition of the record being retried was taken away: abandon it, its new owner redoes it."""


class ConsumerRuntime:
    """Runs ``handler`` over ``topics`` until stopped (SIGTERM/SIGINT or ``stop()``)."""

    def __init__(
        self,
        *,
        bootstrap: str,
        group_id: str,
        topics: list[str],
        handler: Handler,
        dlq_topic: str,
        settings: ConsumerSettings | None = None,
        codec: Codec | None = None,
        transactional_id: str | None = None,
        on_assign: AssignCallback | None = None,
        on_assign_paused: PrepareCallback | None = None,
        on_revoke: PartitionCallback | None = None,
        on_abort: Callable[[], None] | None = None,
        on_commit: Callable[[], None] | None = None,
        on_batch_end: Callable[[], None] | None = None,
        consumer_overrides: dict[str, Any] | None = None,
        stop_event: threading.Event | None = None,
        output: EventProducer | None = None,
    ) -> None:
        self.settings = settings or ConsumerSettings()
        self.group_id = group_id
        self.topics = topics
        self.handler = handler
        self.dlq_topic = dlq_topic
        self.codec = codec or default_codec()
        self.exactly_once = transactional_id is not None
        # At-least-once consumers of one process may send through one producer (``EventProducer.share``).
        if output is not None and self.exactly_once:
            raise ValueError("an exactly-once runtime sends through its own transactional producer")
        self._on_assign = on_assign
        self._on_revoke = on_revoke
        # Work a newly assigned partition needs before its first record (the scheduler's restore). It runs on
        # a thread of its own while the partition is paused, and the loop resumes the partition once it is
        # done: a long one neither holds up the other partitions nor keeps the loop from polling, so it cannot
        # outlast max.poll.interval.ms and cost the group a rebalance. Each assignment gets a generation, so
        # the work of an assignment revoked meanwhile never resumes a later one, and the work itself can ask
        # whether its partition is still its own before it installs anything (a slow preparation can outlive
        # its assignment and overlap the next one's).
        self._on_assign_paused = on_assign_paused
        self._preparing: dict[tuple[str, int], int] = {}
        self._prepared: queue.SimpleQueue[tuple[list[TopicPartition], int, BaseException | None]] = \
            queue.SimpleQueue()
        self._generation = 0
        self._on_abort = on_abort
        # Exactly-once: told when a batch's transaction committed, as ``on_abort`` is when one was aborted, so
        # a service that keeps state derived from the batch knows which of it is now durable.
        self._on_commit = on_commit
        # Called when a batch's work is about to be committed (end of batch, rebalance, shutdown), after
        # the handler ran for each of its records and before their offsets are stored or committed: a
        # handler that buffers (the projector writes a batch in one database transaction) makes its
        # work durable here. If it raises, no offset of the batch is committed.
        self._on_batch_end = on_batch_end
        # Shared with handlers that wait (back-off sleeps), so a drain interrupts them.
        self._stop = stop_event or threading.Event()
        self._rng = random.Random()
        self._assigned: set[tuple[str, int]] = set()
        # Next offset to commit per partition, for work already done in the current batch.
        self._done: dict[tuple[str, int], int] = {}
        # Next offset to process per partition, across batches: what the lag is measured from.
        self._processed: dict[tuple[str, int], int] = {}
        self._in_transaction = False
        self._retrying = False
        self._last_lag_update = 0.0
        self._metrics: dict[str, tuple[Counter, Histogram]] = {}
        overrides = dict(consumer_overrides or {})
        if self.exactly_once:
            overrides["enable.auto.commit"] = False
        self._consumer = Consumer(consumer_config(bootstrap, group_id, self.settings, **overrides))
        transaction = ({"transaction.timeout.ms": round(self.settings.transaction_timeout_s * 1000)}
                       if self.exactly_once else {})
        self.output = output or EventProducer(bootstrap, self.codec, transactional_id=transactional_id, **transaction)
        if self.exactly_once:
            self._init_transactions()

    # -- lifecycle ----------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop fetching; the message in flight is finished, its offset committed, then ``run`` returns."""
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def install_signal_handlers(self) -> None:
        """For a runtime that owns its process: SIGTERM/SIGINT drain it (see ``GracefulShutdown``)."""
        shutdown = GracefulShutdown(self.settings.drain_timeout_s)
        shutdown.event = self._stop
        shutdown.install()

    def run(self) -> None:
        """Consume, handle, commit, until stopped.

        A batch keeps growing while messages keep arriving, for up to ``batch_interval_ms`` or
        ``batch_size`` messages, and is committed as soon as nothing more is waiting: a quiet consumer
        commits each message at once, a busy one commits (under exactly-once: one transaction, with its
        markers on every partition it wrote) a few times per ``batch_interval_ms`` instead of once per
        poll -- Kafka Streams' ``commit.interval.ms`` idea, without its latency when idle.
        """
        self._consumer.subscribe(self.topics, on_assign=self._assigned_cb, on_revoke=self._revoked_cb,
                                 on_lost=self._revoked_cb)
        interval_s = self.settings.batch_interval_ms / 1000
        try:
            opened, handled = 0.0, 0
            while not self._stop.is_set():
                HEALTH.beat()
                self._resume_prepared()
                growing = bool(self._done)
                room = self.settings.batch_size - handled if growing else self.settings.batch_size
                batch = consume_available(self._consumer, room, 0 if growing else self.settings.poll_timeout_s)
                if batch:
                    if not self._done:
                        opened, handled = time.monotonic(), 0
                    handled += len(batch)
                    self._process_batch(batch)
                if self._done and (not batch or handled >= self.settings.batch_size
                                   or time.monotonic() - opened >= interval_s):
                    self._finish_batch()
                self._maybe_update_lag()
            self._finish_batch()
            if not self.exactly_once:
                self._commit_sync()
        finally:
            self._consumer.close()
            if not self.exactly_once:  # a transaction's commit delivers its output; an unfinished one is void
                self.output.flush()
            log.info("consumer closed", group=self.group_id)

    # -- batches ------------------------------------------------------------------------------

    def _process_batch(self, batch: list[KafkaMessage]) -> None:
        """Handle ``batch`` into the open batch (and transaction); ``run`` decides when it is committed."""
        try:
            for raw in batch:
                if self._stop.is_set():
                    break  # drain: later messages of the batch were not started and are not committed
                if raw.error() is not None:
                    log.warning("consumer error", error=str(raw.error()))
                    continue
                where = (raw.topic(), raw.partition())
                if where not in self._assigned:
                    continue
                if self.exactly_once and not self._in_transaction:
                    self.output.begin()
                    self._in_transaction = True
                self._process_one(raw)
                self._done[where] = self._processed[where] = raw.offset() + 1
                self._maybe_update_lag()
        except _Revoked:
            self._done.clear()
            if self._in_transaction:
                self._abort()

    def _process_one(self, raw: KafkaMessage) -> None:
        started = time.perf_counter()
        record = self._decode(raw)
        if record is None:
            return
        self._handle(raw, record, self._wait_paused)
        processed, seconds = self._topic_metrics(record.topic)
        processed.inc()
        seconds.observe(time.perf_counter() - started)

    def _decode(self, raw: KafkaMessage) -> Record | None:
        """The decoded record, or None when it could not be decoded (then it is already dead-lettered)."""
        try:
            return Record(raw.topic(), raw.partition(), raw.offset(), _text(raw.key()), self.codec.decode(raw.value()),
                          list(raw.headers() or []), raw.value())
        except DecodeError as exc:
            self._dead_letter(raw, exc.reason, type(exc).__name__, exc.kind)
            return None

    def _handle(self, raw: KafkaMessage, record: Record, wait: Callable[[float, tuple[str, int]], None]) -> None:
        """Run the handler to an outcome: done, dead-lettered (poison), or retried after ``wait`` (infrastructure).

        ``wait`` sleeps out a back-off; it raises ``_Revoked`` to abandon the record (partition lost, drain).
        """
        topic = record.topic
        attempt = 0
        while True:
            try:
                self.handler(record, self.output)
                return
            except Exception as exc:
                if isinstance(exc, KafkaException):
                    # A fenced producer says so on its next produce as well as on a transactional call: retrying
                    # the record would meet the same fatal error for good.
                    self._check_recoverable(exc)
                if not is_retryable(exc):
                    reason = exc.reason if isinstance(exc, PoisonMessageError) else f"handler failed: {exc!r}"
                    kind = "contradictory" if isinstance(exc, PoisonMessageError) else "handler_error"
                    self._dead_letter(raw, reason, type(exc).__name__, kind)
                    return
                if self._stop.is_set():
                    raise _Revoked() from exc  # draining: leave it uncommitted for the next owner
                attempt += 1
                delay = backoff_delay(attempt, self.settings.retry_initial_backoff_s,
                                      self.settings.retry_max_backoff_s, self._rng)
                HANDLER_RETRIES.labels(self.group_id, topic).inc()
                log.warning("infrastructure fault; retrying", topic=topic, partition=raw.partition(),
                            offset=raw.offset(), attempt=attempt, delay_s=round(delay, 3), error=repr(exc))
                wait(delay, (topic, raw.partition()))

    def _topic_metrics(self, topic: str) -> tuple[Counter, Histogram]:
        """Label lookups cost more than the increments: resolve them once per topic."""
        metrics = self._metrics.get(topic)
        if metrics is None:
            metrics = self._metrics[topic] = (MESSAGES_PROCESSED.labels(self.group_id, topic),
                                              HANDLER_SECONDS.labels(self.group_id, topic))
        return metrics

    def _dead_letter(self, raw: KafkaMessage, reason: str, error_class: str, kind: str) -> None:
        headers = dlq_headers(reason=reason, error_class=error_class, kind=kind, topic=raw.topic(),
                              partition=raw.partition(), offset=raw.offset(), group=self.group_id,
                              original=list(raw.headers() or []))
        self.output.send_raw(self.dlq_topic, raw.key(), raw.value(), headers)
        DEAD_LETTERS.labels(self.group_id, raw.topic(), kind).inc()
        log.warning("dead-lettered", topic=raw.topic(), partition=raw.partition(), offset=raw.offset(),
                    kind=kind, reason=reason[:300])

    def _wait_paused(self, delay_s: float, where: tuple[str, int]) -> None:
        """Sleep while staying in the group: pause fetching and keep polling, so rebalances are served."""
        self._retrying = True
        assignment = self._consumer.assignment()
        self._consumer.pause(assignment)
        # Anything consume() still hands out while paused was fetched before the pause: rewind to it
        # afterwards, or it would be skipped.
        rewind: dict[tuple[str, int], int] = {}
        try:
            deadline = time.monotonic() + delay_s
            while time.monotonic() < deadline and not self._stop.is_set():
                for msg in self._consumer.consume(1, min(0.2, max(0.0, deadline - time.monotonic()))):
                    if msg.error() is None:
                        key = (msg.topic(), msg.partition())
                        rewind[key] = min(rewind.get(key, msg.offset()), msg.offset())
                if where not in self._assigned:
                    raise _Revoked()
        finally:
            self._retrying = False
            self._consumer.resume([tp for tp in self._consumer.assignment()
                                   if (tp.topic, tp.partition) not in self._preparing])
            for (topic, partition), offset in rewind.items():
                if (topic, partition) in self._assigned:
                    self._consumer.seek(TopicPartition(topic, partition, offset))

    def _finish_batch(self) -> None:
        """Make the batch's work durable: deliver its output, then commit (or store) its offsets."""
        if not self._done:
            return
        if self._on_batch_end is not None:
            self._on_batch_end()
        offsets = [TopicPartition(t, p, o) for (t, p), o in self._done.items()]
        if self.exactly_once:
            self._commit_transaction(offsets)
        else:
            self._flush_output()
            self._consumer.store_offsets(offsets=offsets)
        self._done.clear()

    def _flush_output(self) -> None:
        attempt = 0
        while True:
            try:
                self.output.flush()
                return
            except InfrastructureError as exc:
                attempt += 1
                log.warning("output not delivered; retrying", attempt=attempt, error=str(exc))
                time.sleep(backoff_delay(attempt, self.settings.retry_initial_backoff_s,
                                         self.settings.retry_max_backoff_s, self._rng))

    def _init_transactions(self) -> None:
        """Fence any transaction an earlier instance with this transactional id left open, waiting out a
        coordinator that is not reachable yet (a restart during a broker's failover): a pause, not an end."""
        attempt = 0
        while True:
            try:
                with self._call_guard("init_transactions"):
                    self.output.init_transactions(self.settings.transaction_timeout_s)
                return
            except KafkaException as exc:
                if is_fatal(exc) or not is_retriable(exc):
                    raise
                attempt += 1
                log.warning("transactions not initialised yet; retrying", attempt=attempt, error=kafka_reason(exc))
                time.sleep(backoff_delay(attempt, self.settings.retry_initial_backoff_s,
                                         self.settings.retry_max_backoff_s, self._rng))

    def _call_guard(self, what: str) -> AbstractContextManager[None]:
        """One call into librdkafka's transactions or group coordinator, given ``transaction_timeout_s``: still
        blocked past ``commit_stall_s`` it is hung, not slow (eventstore.stall), and the process ends for a
        restart. Each call is guarded on its own, so a hang is caught that long after it began, however many
        calls (retries included) came before it."""
        return stall_guard(self.settings.commit_stall_s, what)

    def _commit_transaction(self, offsets: list[TopicPartition]) -> None:
        """Commit the batch's transaction with its offsets; if it fails, abort it and read the batch again.

        Each call is bounded by ``transaction_timeout_s``, past which the coordinator would abort the transaction
        anyway; a commit librdkafka says may go on (retriable, not requiring an abort) is tried again.
        """
        failure = self._try_commit(offsets)
        if failure is None:
            self._in_transaction = False
            if self._on_commit is not None:
                self._on_commit()
            return
        log.warning("transaction failed; aborting and re-reading the batch", error=kafka_reason(failure),
                    requires_abort=requires_abort(failure))
        self._abort()

    def _try_commit(self, offsets: list[TopicPartition]) -> KafkaException | None:
        """None once committed; the error that calls for an abort otherwise (a fatal one raises RestartRequired)."""
        timeout_s = self.settings.transaction_timeout_s
        try:
            with self._call_guard("send_offsets_to_transaction"):
                self.output.send_offsets(offsets, self._consumer.consumer_group_metadata(), timeout_s)
        except KafkaException as exc:
            self._check_recoverable(exc)
            return exc
        attempt = 0
        while True:
            try:
                with self._call_guard("commit_transaction"):
                    self.output.commit(timeout_s)
                return None
            except KafkaException as exc:
                self._check_recoverable(exc)
                if requires_abort(exc) or not is_retriable(exc):
                    return exc
                attempt += 1
                log.warning("transaction commit not finished; trying again", attempt=attempt,
                            error=kafka_reason(exc))

    def _abort(self) -> None:
        """Abort the open transaction (trying again while librdkafka says it may still work), rewind to the
        committed offsets and tell the service to drop what it derived from the batch."""
        attempt = 0
        while True:
            try:
                with self._call_guard("abort_transaction"):  # the same coordinator, the same hang
                    self.output.abort(self.settings.transaction_timeout_s)
                break
            except KafkaException as exc:
                self._check_recoverable(exc)
                if not is_retriable(exc):
                    raise self._restart_required(exc, "the transaction can be neither committed nor aborted") from exc
                attempt += 1
                log.warning("transaction abort not finished; trying again", attempt=attempt, error=kafka_reason(exc))
        self._in_transaction = False
        self._done.clear()
        self._processed.clear()
        TRANSACTIONS_ABORTED.labels(self.group_id).inc()
        self._rewind_to_committed()
        if self._on_abort is not None:
            self._on_abort()

    def _check_recoverable(self, exc: KafkaException) -> None:
        """Raise RestartRequired for a fatal error: the producer is fenced (a newer instance with this
        transactional id, or the coordinator aborted the transaction past its timeout) or broken for good."""
        if is_fatal(exc):
            raise self._restart_required(exc, "the transactional producer is fenced or broken") from exc

    def _restart_required(self, exc: KafkaException, why: str) -> RestartRequired:
        """The exception that ends this process for a restart. The open batch is dropped first, so closing the
        consumer (its revoke callback commits what is done) does not try the transaction again."""
        self._done.clear()
        self._in_transaction = False
        log.error("ending the process for a restart", why=why, error=kafka_reason(exc), exit_code=EXIT_STALLED)
        return RestartRequired(f"{why}: {kafka_reason(exc)}")

    def _rewind_to_committed(self) -> None:
        """Seek every assigned partition back to its committed offset, asking the group coordinator again while
        it is moving (a broker's failover)."""
        assignment = self._consumer.assignment()
        if not assignment:
            return
        attempt = 0
        while True:
            try:
                with self._call_guard("committed offsets"):
                    committed = self._consumer.committed(assignment, timeout=self.settings.transaction_timeout_s)
                break
            except KafkaException as exc:
                attempt += 1
                log.warning("committed offsets not read; retrying", attempt=attempt, error=kafka_reason(exc))
        for tp in committed:
            offset = tp.offset if tp.offset >= 0 else -2  # OFFSET_BEGINNING when nothing committed
            self._consumer.seek(TopicPartition(tp.topic, tp.partition, offset))

    def _commit_sync(self) -> None:
        try:
            self._consumer.commit(asynchronous=False)
        except KafkaException as exc:
            # _NO_OFFSET: nothing was stored since the last commit.
            if "NO_OFFSET" not in str(exc):
                log.warning("commit failed", error=str(exc))

    # -- rebalance ----------------------------------------------------------------------------

    def _assigned_cb(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._assigned.update((tp.topic, tp.partition) for tp in partitions)
        log.info("partitions assigned", group=self.group_id, partitions=_names(partitions))
        if self._on_assign is not None:
            positioned = self._on_assign(partitions)
            if positioned is not None:
                consumer.assign(positioned)
        # librdkafka keeps a partition paused across its revocation and a new assignment to the same consumer:
        # one the loop had paused (back-pressure, a retry's wait) when it was revoked came back never fetched,
        # the loop having resumed the assignment it saw in between, which was empty.
        consumer.resume(partitions)
        if self._on_assign_paused is not None:
            consumer.assign(partitions)
            consumer.pause(partitions)
            self._generation += 1
            self._preparing.update({(tp.topic, tp.partition): self._generation for tp in partitions})
            threading.Thread(target=self._prepare, args=(partitions, self._generation), daemon=True,
                             name="prepare-partitions").start()

    def _prepare(self, partitions: list[TopicPartition], generation: int) -> None:
        assert self._on_assign_paused is not None
        failure: BaseException | None = None

        def current(tp: TopicPartition) -> bool:
            """Still assigned in this generation: a revocation pops the entry, a new assignment replaces it."""
            return self._preparing.get((tp.topic, tp.partition)) == generation

        try:
            self._on_assign_paused(partitions, current)
        except BaseException as exc:  # handed to the loop, which stops the service with it
            failure = exc
        self._prepared.put((partitions, generation, failure))

    def _resume_prepared(self) -> None:
        """Resume the partitions whose preparation finished (and is still theirs); re-raise one that failed."""
        while not self._prepared.empty():
            partitions, generation, failure = self._prepared.get()
            if failure is not None:
                raise failure
            ready = [tp for tp in partitions if self._preparing.get((tp.topic, tp.partition)) == generation]
            for tp in ready:
                del self._preparing[(tp.topic, tp.partition)]
            if ready:
                self._consumer.resume(ready)
                log.info("partitions ready", group=self.group_id, partitions=_names(ready))

    def _revoked_cb(self, _consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """Commit what is done before the partitions move (callbacks run inside ``consume``: between batches,
        while a batch grows, or during a retry's back-off)."""
        log.info("partitions revoked", group=self.group_id, partitions=_names(partitions))
        self._commit_before_revoke(partitions)
        for tp in partitions:
            self._assigned.discard((tp.topic, tp.partition))
            self._preparing.pop((tp.topic, tp.partition), None)
            self._processed.pop((tp.topic, tp.partition), None)
            with contextlib.suppress(KeyError):
                CONSUMER_LAG.remove(self.group_id, tp.topic, str(tp.partition))
        if self._on_revoke is not None:
            self._on_revoke(partitions)

    def _commit_before_revoke(self, _partitions: list[TopicPartition]) -> None:
        """The work done so far is committed while the partitions are still ours.

        Except in a transaction in the middle of a record's retry (``_wait_paused``): it may hold part of that
        record's output, so it is aborted instead (the retry raises ``_Revoked``).
        """
        if self.exactly_once and self._retrying:
            return
        self._finish_batch()
        if not self.exactly_once:
            self._commit_sync()

    # -- lag ----------------------------------------------------------------------------------

    def _maybe_update_lag(self) -> None:
        now = time.monotonic()
        if now - self._last_lag_update < self.settings.lag_interval_s:
            return
        self._last_lag_update = now
        for tp in self._consumer.position(self._consumer.assignment()):
            _low, high = self._consumer.get_watermark_offsets(tp, cached=True)
            position = self._processed.get((tp.topic, tp.partition), tp.offset)
            if high < 0 or position < 0:
                continue
            CONSUMER_LAG.labels(self.group_id, tp.topic, str(tp.partition)).set(max(0, high - position))


def _names(partitions: list[TopicPartition]) -> list[str]:
    return [f"{tp.topic}[{tp.partition}]" for tp in partitions]


def _text(key: bytes | str | None) -> str | None:
    return key.decode() if isinstance(key, bytes) else key
