"""The consumer runtime with many messages in flight, order kept per key (the Parallel Consumer's KEY mode).

Why: a service whose handler waits on a remote call (an agent) does at most 1/latency messages per
second when it handles one at a time. Here up to ``concurrency`` handlers run at once on a thread pool,
while messages with the same key (a task id) still run one after another in offset order; messages of
different keys, of one partition or several, overlap. That is the ordering the pattern needs -- a task's
requests in order -- and no more.

- **Commit**: a partition is committed up to its first unfinished message (:class:`Watermark`), after the
  output of everything before it was delivered; the finished offsets above it ride in the commit's
  metadata and the next owner skips them. A crash redoes what was unfinished (and what finished after the
  last commit), never skips one.
- **Back-pressure**: at most ``2 * concurrency`` messages are held (running or waiting behind their key);
  at that bound no more are taken until one finishes (and the partitions are paused when that takes
  longer than a poll timeout, so the group membership stays alive); librdkafka's prefetch is bounded too
  (``queued.min.messages``).
- **Poison** goes to the DLQ from the worker that found it; other keys never wait for it.
- **Drain** (SIGTERM or ``stop()``): fetching stops, messages not started are left uncommitted, every call
  in flight is finished (up to the drain timeout), the watermarks are committed.
- **Rebalance**: before partitions are revoked, their waiting messages are dropped and their calls in
  flight are given up to the drain timeout to finish; their watermarks are committed. A call still running
  after that is abandoned: its offset is not committed, so the partition's next owner redoes it.
- Infrastructure faults are retried in the worker with back-off, never dead-lettered.

At-least-once only: exactly-once consumers (the scheduler) stay on the ordered runtime.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import structlog
from confluent_kafka import Consumer, KafkaException, TopicPartition
from confluent_kafka import Message as KafkaMessage

from eventstore.health import HEALTH
from eventstore.kafka_config import consume_available
from eventstore.runtime import ConsumerRuntime, Record, _Revoked
from eventstore.watermark import Watermark, decode_finished, encode_finished

log = structlog.get_logger("stepstream.runtime")

Partition = tuple[str, int]


@dataclass(eq=False)
class _Work:
    raw: KafkaMessage
    record: Record
    future: Future[bool] | None = field(default=None)

    @property
    def partition(self) -> Partition:
        return self.record.topic, self.record.partition

    @property
    def key(self) -> tuple[str, int, str | None]:
        return self.record.topic, self.record.partition, self.record.key


class KeyedConsumerRuntime(ConsumerRuntime):
    """A :class:`ConsumerRuntime` that runs up to ``concurrency`` handlers at once, in order per key."""

    def __init__(self, *, concurrency: int, **kwargs: Any) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if kwargs.get("transactional_id") is not None:
            raise ValueError("the keyed runtime is at-least-once; exactly-once consumers use ConsumerRuntime")
        prefetch = {"queued.min.messages": max(1000, 8 * concurrency)}
        overrides = {**prefetch, **(kwargs.pop("consumer_overrides", None) or {})}
        super().__init__(consumer_overrides=overrides, **kwargs)
        self.concurrency = concurrency
        self.max_held = 2 * concurrency
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="handler")
        # Guards everything below; reentrant because a future that is already done runs its callback at once.
        self._lock = threading.RLock()
        self._marks: dict[Partition, Watermark] = {}
        # Per key, the messages held: the head is submitted, the rest wait their turn.
        self._keys: dict[tuple[str, int, str | None], deque[_Work]] = {}
        self._held = 0
        self._stored: dict[Partition, tuple[int, str]] = {}
        # Per partition, offsets above the committed one that an earlier owner finished (commit metadata).
        self._skip: dict[Partition, set[int]] = {}
        self._freed = threading.Event()
        self._paused = False
        self._last_store = 0.0
        self._crash: BaseException | None = None

    # -- the loop -----------------------------------------------------------------------------

    def run(self) -> None:
        self._consumer.subscribe(self.topics, on_assign=self._assigned_cb, on_revoke=self._revoked_cb,
                                 on_lost=self._revoked_cb)
        try:
            while not self._stop.is_set():
                HEALTH.beat(self.group_id)  # one loop of several in an agent host: each beats on its own
                for raw in self._fetch():
                    self._accept(raw)
                self._maybe_store()
                self._maybe_update_lag()
            self._drain()
            if self._crash is not None:
                raise self._crash
        finally:
            HEALTH.retire(self.group_id)
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._consumer.close()
            self.output.flush()
            log.info("consumer closed", group=self.group_id)

    def _fetch(self) -> list[KafkaMessage]:
        """Up to the room left under ``max_held``; at the bound, nothing until a message finishes.

        At the bound the loop first just waits (up to the poll timeout) for a message to finish: calls end
        within milliseconds under load, and pausing the partitions would make librdkafka drop what it had
        prefetched and fetch it again on resume, a round trip per refill that cut a burst's throughput by
        an order of magnitude. Only when nothing finished for a whole poll timeout (slow or hung calls)
        are the partitions paused, and the consumer polled, so that it serves rebalances meanwhile.
        """
        with self._lock:
            room = self.max_held - self._held
        if room > 0:
            if self._paused:
                self._consumer.resume(self._consumer.assignment())
                self._paused = False
            return consume_available(self._consumer, room, self.settings.poll_timeout_s)
        if self._freed.wait(self.settings.poll_timeout_s):
            self._freed.clear()
            return []
        # Paused again every time: partitions assigned since the last pause arrive unpaused (``_assigned_cb``).
        self._consumer.pause(self._consumer.assignment())
        self._paused = True
        # Whatever was fetched before the pause is taken, not lost.
        fetched: list[KafkaMessage] = self._consumer.consume(self.max_held, 0)
        return fetched

    def _accept(self, raw: KafkaMessage) -> None:
        if raw.error() is not None:
            log.warning("consumer error", error=str(raw.error()))
            return
        where = (raw.topic(), raw.partition())
        if where not in self._assigned:
            return
        with self._lock:
            self._marks.setdefault(where, Watermark()).take(raw.offset())
        skip = self._skip.get(where)
        if skip and raw.offset() in skip:
            skip.discard(raw.offset())  # finished before the last commit, by this process or an earlier owner
            with self._lock:
                self._marks[where].finish(raw.offset())
            return
        record = self._decode(raw)
        if record is None:
            with self._lock:
                self._marks[where].finish(raw.offset())
            return
        work = _Work(raw, record)
        with self._lock:
            queue = self._keys.setdefault(work.key, deque())
            queue.append(work)
            self._held += 1
            if len(queue) == 1:
                self._submit(work)

    # -- workers ------------------------------------------------------------------------------

    def _submit(self, work: _Work) -> None:
        """Lock held."""
        work.future = self._pool.submit(self._work, work)
        work.future.add_done_callback(lambda future: self._finished(work, future))

    def _work(self, work: _Work) -> bool:
        """In a worker: True when the message is done (handled or dead-lettered), False when abandoned."""
        started = time.perf_counter()
        try:
            self._handle(work.raw, work.record, self._sleep_retry)
        except _Revoked:
            return False
        processed, seconds = self._topic_metrics(work.record.topic)
        processed.inc()
        seconds.observe(time.perf_counter() - started)
        return True

    def _sleep_retry(self, delay_s: float, where: Partition) -> None:
        if where not in self._assigned or self._stop.wait(delay_s) or where not in self._assigned:
            raise _Revoked()

    def _finished(self, work: _Work, future: Future[bool]) -> None:
        """Done callback: record the outcome and start the next message of the same key, if it may run."""
        done = False
        if not future.cancelled():
            error = future.exception()
            if error is not None:
                # Not a handler fault (those are retried or dead-lettered): the runtime itself is broken.
                # Its partition could never commit past this message, so the loop stops and raises it.
                self._crash = self._crash or error
                self._stop.set()
            else:
                done = future.result()
        with self._lock:
            queue = self._keys.get(work.key)
            if queue is None or not queue or queue[0] is not work:
                return  # its partition was revoked meanwhile
            queue.popleft()
            self._held -= 1
            mark = self._marks.get(work.partition)
            if done and mark is not None:
                mark.finish(work.record.offset)
            runnable = done and work.partition in self._assigned and not self._stop.is_set()
            if queue and runnable:
                self._submit(queue[0])
            else:
                # Abandoned: what waits behind it must not overtake it; all of it is redone from the watermark.
                self._held -= len(queue)
                del self._keys[work.key]
        self._freed.set()

    # -- offsets ------------------------------------------------------------------------------

    def _maybe_store(self) -> None:
        now = time.monotonic()
        if now - self._last_store >= self.settings.commit_interval_ms / 1000:
            self._last_store = now
            self._store()

    def _store(self, only: set[Partition] | None = None) -> None:
        """Store each partition's watermark, after delivering the output of the work below it."""
        with self._lock:
            marks = {where: (mark.committable(), mark.finished_above()) for where, mark in self._marks.items()
                     if only is None or where in only}
        offsets = {where: (offset, encode_finished(offset, finished)) for where, (offset, finished) in marks.items()
                   if offset is not None}
        offsets = {where: stored for where, stored in offsets.items() if self._stored.get(where) != stored}
        if not offsets:
            return
        self._flush_output()
        try:
            self._consumer.store_offsets(offsets=[TopicPartition(t, p, o, metadata=m)
                                                  for (t, p), (o, m) in offsets.items()])
        except KafkaException as exc:
            log.warning("offsets not stored", error=str(exc))  # a partition lost meanwhile: its owner redoes it
            return
        self._stored.update(offsets)
        self._processed.update({where: offset for where, (offset, _m) in offsets.items()})

    def _settle(self, partitions: set[Partition] | None) -> None:
        """Drop what waits in ``partitions`` (None: all), let the calls in flight finish, store the watermarks."""
        with self._lock:
            running: list[Future[bool]] = []
            for key, queue in list(self._keys.items()):
                if partitions is None or key[:2] in partitions:
                    head = queue[0]
                    while len(queue) > 1:
                        queue.pop()
                        self._held -= 1
                    if head.future is not None:
                        running.append(head.future)
        for future in running:
            future.cancel()  # not started yet: left for the next owner
        _done, unfinished = wait(running, timeout=self.settings.drain_timeout_s)
        if unfinished:
            log.warning("calls still in flight after the drain timeout are abandoned (redone by the next owner)",
                        count=len(unfinished), timeout_s=self.settings.drain_timeout_s)
        self._store(partitions)

    def _drain(self) -> None:
        with self._lock:
            held = self._held
        log.info("draining", group=self.group_id, held=held)
        self._settle(None)
        self._commit_sync()

    def _assigned_cb(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        super()._assigned_cb(consumer, partitions)
        try:
            committed = consumer.committed(partitions, timeout=30)
        except KafkaException as exc:
            log.warning("committed offsets unreadable; finished messages may be redone", error=str(exc))
            return
        for tp in committed:
            skip = decode_finished(tp.offset, tp.metadata)
            if skip:
                self._skip[(tp.topic, tp.partition)] = skip

    def _commit_before_revoke(self, partitions: list[TopicPartition]) -> None:
        gone = {(tp.topic, tp.partition) for tp in partitions}
        self._assigned.difference_update(gone)  # their workers stop retrying; their keys start nothing new
        self._settle(gone)
        self._commit_sync()
        with self._lock:
            for where in gone:
                self._marks.pop(where, None)
                self._stored.pop(where, None)
                self._skip.pop(where, None)
            for key in [key for key in self._keys if key[:2] in gone]:
                self._held -= len(self._keys.pop(key))
