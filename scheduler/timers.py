"""The scheduler's alarm clock: it fires the timers of the tasks it owns by sending ``RetryDue`` to ``inbox``.

The timers themselves are events (``StepRetryScheduled``) and live in the tasks' state, so nothing here
needs to be durable: the queue is rebuilt from the state whenever a partition is restored (after a
restart, a rebalance or an aborted transaction), and a timer whose time passed meanwhile fires at once,
late by at most the restart. Firing is only a request: the decider starts the attempt if the firing names
the step's current timer and it is due, so a firing sent twice (a resend, a restart between sending it
and handling it, another owner after a rebalance) starts nothing the second time.

A firing is sent again after ``resend_s`` while its timer is still current: it may have been lost (the
broker down), or reached a scheduler whose clock was behind, which leaves it unstarted. Waiting costs no
CPU: one thread sleeps until the earliest timer.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog
from prometheus_client import Counter, Gauge, Histogram

from scheduler.decider import same_timer
from schemas.messages import RetryDue

log = structlog.get_logger("stepstream.scheduler.timers")

PENDING = Gauge("stepstream_timers_pending", "Timers of waiting steps this scheduler will fire")
FIRED = Counter("stepstream_timers_fired_total", "Timer firings sent to inbox", ["resend"])
LATENESS = Histogram("stepstream_timer_lateness_seconds", "How long after its not_before a timer's first firing "
                     "was sent", buckets=(0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 30))

#: Sends one firing to ``inbox`` on the task's partition (``Flush`` then waits until all are delivered).
Send = Callable[[int, RetryDue], None]
#: Waits until every firing sent is delivered; raises if any could not be.
Flush = Callable[[], None]
#: Whether a firing is still its task's current timer on this scheduler (False once the partition is gone).
IsCurrent = Callable[[int, RetryDue], bool]


@dataclass(order=True)
class _Entry:
    at: float
    seq: int
    partition: int = field(compare=False)
    due: RetryDue = field(compare=False)
    sent: bool = field(default=False, compare=False)


class TimerQueue:
    """Timers by due time; ``run`` fires them in a thread until ``stop`` is set.

    ``arm`` is called by the scheduler with each task's current timer after every decision and restore;
    a task has at most one, so arming replaces the one before (which then lapses when it comes up).
    ``clock`` (epoch seconds) is injectable for tests.
    """

    def __init__(self, send: Send, flush: Flush, is_current: IsCurrent, stop: threading.Event, *,
                 resend_s: float = 5.0, clock: Callable[[], float] = time.time, max_batch: int = 500) -> None:
        self._send = send
        self._flush = flush
        self._is_current = is_current
        self._stop = stop
        self._resend_s = resend_s
        self._clock = clock
        # Timers due together go out in batches of at most this many: the first ones reach the scheduler
        # while the rest are still being sent.
        self._max_batch = max_batch
        self._heap: list[_Entry] = []
        self._armed: dict[str, RetryDue] = {}
        self._seq = 0
        self._wake = threading.Condition()

    def arm(self, partition: int, due: RetryDue | None, task_id: str) -> None:
        """Make ``due`` the task's timer (None: it has none now)."""
        with self._wake:
            if due is None:
                if self._armed.pop(task_id, None) is not None:
                    PENDING.set(len(self._armed))
                return
            armed = self._armed.get(task_id)
            if armed is not None and same_timer(armed, due):
                return
            self._armed[task_id] = due
            PENDING.set(len(self._armed))
            self._push(due.not_before.timestamp(), partition, due)
            self._wake.notify()

    def forget(self, task_ids: set[str]) -> None:
        """Tasks this scheduler no longer owns: their timers are the new owner's to fire."""
        with self._wake:
            for task_id in task_ids:
                self._armed.pop(task_id, None)
            PENDING.set(len(self._armed))

    def __len__(self) -> int:
        return len(self._armed)

    def run(self) -> None:
        """Fire timers as they come due until stopped: every timer due is sent, then one flush for them all
        (a burst of timers due together costs one round trip, not one each); a failed batch is resent."""
        while not self._stop.is_set():
            batch = [entry for entry in self._due() if self._armed.get(entry.due.task_id) is entry.due
                     and self._is_current(entry.partition, entry.due)]
            if not batch:
                continue
            try:
                for entry in batch:
                    self._send(entry.partition, entry.due)
                self._flush()
                for entry in batch:
                    FIRED.labels(str(entry.sent).lower()).inc()
                    if not entry.sent:
                        LATENESS.observe(max(0.0, self._clock() - entry.at))
            except Exception as exc:  # a broker fault: the resend below tries again
                log.warning("timer firings not sent", timers=len(batch), error=str(exc))
            with self._wake:
                for entry in batch:
                    if self._armed.get(entry.due.task_id) is entry.due:
                        self._push(self._clock() + self._resend_s, entry.partition, entry.due, sent=True)

    def wake(self) -> None:
        """Let ``run`` see that it is stopping."""
        with self._wake:
            self._wake.notify_all()

    def _due(self) -> list[_Entry]:
        """Every entry due now, sleeping until the earliest first; empty when woken or stopping before."""
        with self._wake:
            wait_s = self._heap[0].at - self._clock() if self._heap else 1.0
            if wait_s > 0:
                self._wake.wait(timeout=min(wait_s, 1.0))
                return []
            now = self._clock()
            due: list[_Entry] = []
            while self._heap and self._heap[0].at <= now and len(due) < self._max_batch:
                due.append(heapq.heappop(self._heap))
            return due

    def _push(self, at: float, partition: int, due: RetryDue, *, sent: bool = False) -> None:
        self._seq += 1
        heapq.heappush(self._heap, _Entry(at, self._seq, partition, due, sent))
