"""The front's global bound on tasks in flight, so a burst is refused at the door (429) before any
scheduler partition has to refuse it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import structlog

from eventstore.topics import TopicLayout
from projections.lag import LagReader
from projections.store import Store
from schemas.states import TERMINAL

log = structlog.get_logger("stepstream.api")


class GlobalAdmission:
    """The API's bound on tasks in flight across every scheduler partition.

    The estimate is the non-terminal tasks the state store holds, plus the records the scheduler has not
    consumed from ``inbox`` yet, plus every submission this API let through that the store does not show
    yet (a task the scheduler decided but the projector has not written is in neither of the first two).
    Store and backlog are read at most every ``refresh_s``; the let-through ones are counted until the
    store shows them, or the scheduler refused them, or ``forget_after_s`` passed. Counting a task twice
    (let through and in the backlog) only errs on the side of refusing. The scheduler's per-partition
    bound still applies behind it.
    """

    def __init__(self, store: Store, lag: LagReader | None, layout: TopicLayout, bound: int,
                 refresh_s: float = 1.0, forget_after_s: float = 300.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self._clock = clock
        self.lag = lag
        self.layout = layout
        self.bound = bound
        self.refresh_s = refresh_s
        self.forget_after_s = forget_after_s
        self._lock = threading.Lock()
        self._read_at = float("-inf")
        self._measured = 0
        self._let_through: dict[str, float] = {}

    def refuse(self, task_id: str) -> str | None:
        """Why a submission must wait (None: it is let through, and counted until the store shows it)."""
        with self._lock:
            now = self._clock()
            if now - self._read_at >= self.refresh_s:
                self._measured = self._measure(now)
                self._read_at = now
            estimate = self._measured + len(self._let_through)
            if estimate >= self.bound:
                return f"admission control: about {estimate} tasks in flight or waiting, the limit is {self.bound}"
            self._let_through[task_id] = now
            return None

    def release(self, task_id: str) -> None:
        """A let-through submission that will not become a task in flight (refused, or never delivered)."""
        with self._lock:
            self._let_through.pop(task_id, None)

    def _measure(self, now: float) -> int:
        for task_id, since in list(self._let_through.items()):
            if now - since > self.forget_after_s or self.store.task(task_id) is not None:
                del self._let_through[task_id]
        live = sum(n for state, n in self.store.counts_by_status().items() if state not in TERMINAL)
        backlog = 0
        if self.lag is not None:
            try:
                backlog = sum(row.lag for row in self.lag.groups()
                              if row.group == self.layout.scheduler_group and row.topic == self.layout.inbox)
            except Exception as exc:  # the broker is not answering: producing will tell, the store still counts
                log.warning("inbox backlog not measured", error=repr(exc))
        return live + backlog
