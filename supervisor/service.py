"""``stepstream run supervisor``: finds attempts whose deadline passed and asks the scheduler to recover them.

Attempts are forward ones and compensating ones, each either queued (no agent took it yet: its deadline is
its start-by) or running (its deadline is its complete-by, counted from the agent's acknowledgement): the
state store lists them all in one index-backed scan over the deadline in force, and the recovery is the
same request either way. The
scheduler retries below the workflow's failure threshold and escalates past it: a stuck compensation
ends ``compensation_failed`` with an operator alert naming its step.

Leadership is ownership of partition 0 of ``supervisor-lease`` in the supervisors' consumer group: Kafka's
group protocol gives it to exactly one live member, and hands it over when that member dies or leaves.
Only the leader scans. It only requests (a ``RecoverStep`` naming the expired attempt); the scheduler
decides, and a request naming an attempt that is no longer current changes nothing, so a duplicate
request from a leader hand-over is harmless. It asks again for an attempt the projection still shows
expired only after a back-off that doubles each time (:mod:`supervisor.asks`).

The same scan applies retention: tasks whose workflow keeps sensitive data for a while after they
completed or were compensated, and whose time is up (``erase_due_at`` in the store), get an ``erase``
command from ``retention``. Its command id is the task's (``retention:<task id>``), so however often it is
sent -- a lagging projection, a new leader -- the scheduler erases once. And every ``keys_roll_s`` the
leader appends a marker to each partition of ``keys`` (``eventstore.keys.roll``): Kafka rolls a segment only
on an append, so without it an erased key would stay on the disk of an idle partition until its next write.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import structlog
from confluent_kafka import Consumer, TopicPartition
from prometheus_client import Counter, Gauge

from eventstore.health import HEALTH
from eventstore.kafka_config import connection_config
from eventstore.keys import roll
from eventstore.producer import EventProducer
from eventstore.settings import KafkaSettings
from eventstore.topics import KEYS_SEGMENT_MS, TopicLayout
from projections.store import Store
from schemas.messages import OperatorCommand, RecoverStep
from supervisor.asks import RecoveryAsks
from supervisor.settings import SupervisorSettings

log = structlog.get_logger("stepstream.supervisor")

IS_LEADER = Gauge("stepstream_supervisor_leader", "1 while this supervisor holds the lease")
RECOVERIES = Counter("stepstream_supervisor_recoveries_total", "Recovery commands sent")
ERASURES = Counter("stepstream_supervisor_retention_erasures_total", "Erase commands sent for retention")


class Supervisor:
    def __init__(self, *, bootstrap: str, layout: TopicLayout, store: Store, cadence_s: float = 5.0,
                 window_s: float = 24 * 3600, page_size: int = 200, resend_after_s: float = 30.0,
                 resend_max_s: float = 600.0, session_timeout_ms: int = 10000,
                 stop_event: threading.Event | None = None, clock: Callable[[], float] = time.monotonic,
                 keys_roll_s: float = KEYS_SEGMENT_MS / 2000) -> None:
        self.layout = layout
        self.store = store
        self.cadence_s = cadence_s
        self.window = timedelta(seconds=window_s)
        self.page_size = page_size
        self.leader = False
        self.instance = uuid.uuid4().hex[:12]
        self._stop = stop_event or threading.Event()
        self._asks = RecoveryAsks(resend_after_s, resend_max_s)
        self._erasures = RecoveryAsks(resend_after_s, resend_max_s)
        self._clock = clock
        self.keys_roll_s = keys_roll_s
        self._next_roll = 0.0
        self._producer = EventProducer(bootstrap)
        self._lease = Consumer({
            **connection_config(bootstrap),
            "group.id": layout.supervisor_group,
            "enable.auto.commit": False,
            "session.timeout.ms": session_timeout_ms,
            "heartbeat.interval.ms": max(100, session_timeout_ms // 5),
        })

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        self._lease.subscribe([self.layout.supervisor_lease], on_assign=self._on_assign,
                              on_revoke=self._on_revoke, on_lost=self._on_revoke)
        next_scan = 0.0
        try:
            while not self._stop.is_set():
                HEALTH.beat()
                self._lease.consume(1, 0.1)  # keeps the membership (and so the lease) alive
                if self.leader and time.monotonic() >= next_scan:
                    self.scan()
                    next_scan = time.monotonic() + self.cadence_s
        finally:
            self._lease.close()  # leaving the group hands the lease over at once
            self._producer.flush()
            IS_LEADER.set(0)
            log.info("supervisor stopped")

    def scan(self, now: datetime | None = None) -> int:
        """One bounded pass: expired attempts (forward or compensating) inside the window, a page at a time.

        Returns the number of recovery requests sent.
        """
        now = now or datetime.now(UTC)
        after: tuple[int, str, str] | None = None
        sent = 0
        clock = self._clock()
        seen: set[str] = set()
        while not self._stop.is_set():
            page = self.store.expired_steps(now, not_before=now - self.window, after=after, limit=self.page_size)
            for step in page:
                seen.add(step.attempt_id)
                if not self._asks.due(step.attempt_id, clock):
                    continue  # asked already; the projection has not caught up with the answer yet
                command = RecoverStep(task_id=step.task_id, attempt_id=step.attempt_id, reason="deadline expired")
                self._producer.send(self.layout.inbox, command,
                                    headers=[("stepstream.supervisor", self.instance.encode())])
                self._asks.asked(step.attempt_id, clock)
                sent += 1
            if len(page) < self.page_size:
                self._asks.keep_only(seen)  # a whole scan: what it did not find needs no memory
                break
            last_step = page[-1]
            after = (last_step.complete_by_ms, last_step.task_id, last_step.step)
        self._producer.flush()
        if sent:
            RECOVERIES.inc(sent)
            log.info("recovery requested", count=sent)
        self.erase_due(now, clock)
        if clock >= self._next_roll:
            roll(self._producer, self.layout.keys, self.layout.partitions)
            self._producer.flush()
            self._next_roll = clock + self.keys_roll_s
        return sent

    def erase_due(self, now: datetime, clock: float) -> int:
        """Ask the scheduler to erase each task whose retention ran out (a page per scan); the count sent."""
        due = self.store.erase_due(now, limit=self.page_size)
        sent = 0
        for task_id in due:
            if not self._erasures.due(task_id, clock):
                continue
            self._producer.send(self.layout.inbox, OperatorCommand(
                task_id=task_id, command_id=f"retention:{task_id}", action="erase", operator="retention"))
            self._erasures.asked(task_id, clock)
            sent += 1
        self._erasures.keep_only(set(due))
        self._producer.flush()
        if sent:
            ERASURES.inc(sent)
            log.info("retention erasure requested", count=sent)
        return sent

    def _on_assign(self, _consumer: Consumer, partitions: list[TopicPartition]) -> None:
        if any(tp.partition == 0 for tp in partitions):
            self.leader = True
            IS_LEADER.set(1)
            log.info("leadership acquired", instance=self.instance)

    def _on_revoke(self, _consumer: Consumer, partitions: list[TopicPartition]) -> None:
        if any(tp.partition == 0 for tp in partitions):
            self.leader = False
            IS_LEADER.set(0)
            log.info("leadership lost")


def build_supervisor(kafka: KafkaSettings, settings: SupervisorSettings, store: Store,
                     stop_event: threading.Event | None = None) -> Supervisor:
    return Supervisor(bootstrap=kafka.resolved_bootstrap(), layout=TopicLayout.from_settings(kafka), store=store,
                      cadence_s=settings.cadence_s, window_s=settings.window_s, page_size=settings.page_size,
                      resend_after_s=settings.resend_after_s, resend_max_s=settings.resend_max_s,
                      session_timeout_ms=settings.session_timeout_ms,
                      stop_event=stop_event)
