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

#: Sends one firing to ``inbox`` on the task's partition; raises if it could not be sent.
Send = Callable[[int, RetryDue], None]
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

    def __init__(self, send: Send, is_current: IsCurrent, stop: threading.Event, *, resend_s: float = 5.0,
                 clock: Callable[[], float] = time.time) -> None:
        self._send = send
        self._is_current = is_current
        self._stop = stop
        self._resend_s = resend_s
        self._clock = clock
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
        """Fire timers as they come due until stopped; a send that fails is retried at the next resend."""
        while not self._stop.is_set():
            entry = self._next_due()
            if entry is None:
                continue
            if self._armed.get(entry.due.task_id) is not entry.due or not self._is_current(entry.partition, entry.due):
                continue
            try:
                self._send(entry.partition, entry.due)
                FIRED.labels(str(entry.sent).lower()).inc()
                if not entry.sent:
                    LATENESS.observe(max(0.0, self._clock() - entry.at))
            except Exception as exc:  # a broker fault: the resend below tries again
                log.warning("timer firing not sent", task_id=entry.due.task_id, step=entry.due.step,
                            error=str(exc))
            with self._wake:
                if self._armed.get(entry.due.task_id) is entry.due:
                    self._push(self._clock() + self._resend_s, entry.partition, entry.due, sent=True)

    def wake(self) -> None:
        """Let ``run`` see that it is stopping."""
        with self._wake:
            self._wake.notify_all()

    def _next_due(self) -> _Entry | None:
        """The earliest entry once it is due, sleeping until then; None when woken or stopping first."""
        with self._wake:
            if not self._heap:
                self._wake.wait(timeout=1.0)
                return None
            wait_s = self._heap[0].at - self._clock()
            if wait_s > 0:
                self._wake.wait(timeout=min(wait_s, 1.0))
                return None
            return heapq.heappop(self._heap)

    def _push(self, at: float, partition: int, due: RetryDue, *, sent: bool = False) -> None:
        self._seq += 1
        heapq.heappush(self._heap, _Entry(at, self._seq, partition, due, sent))
