"""A retry budget per dependency: at most N retries in any window of W seconds, across all requests.

Per-request retry limits bound one request; they do not bound a process that handles hundreds of
failing requests at once, each retrying three times -- the classic retry storm that keeps an overloaded
service down. The budget caps the *extra* load retries add: once it is spent, a failed call is answered
as a transient failure at once (fail fast) instead of being retried, and the scheduler/supervisor decide
later. First calls are never budgeted; only retries are.

The allowance in any window of ``window_s`` is ``retries_per_window + ratio * first calls in the window``
(Finagle's design): the fixed part lets a quiet agent retry at all, the ratio lets retries grow with
traffic while capping their extra load on the service at ``ratio`` (20% by default) however much of it
fails. With ``ratio = 0`` it is exactly "at most N retries in any W seconds".

Both are sliding-window logs (exact, no bucket edges) kept as deques of timestamps. Thread-safe; the
clock is injected.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from pydantic import BaseModel, ConfigDict, Field


class BudgetPolicy(BaseModel):
    """How many retries one dependency may receive from this process per window."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = True
    retries_per_window: int = Field(default=60, ge=0, description="retries allowed in any window, however quiet")
    ratio: float = Field(default=0.2, ge=0.0, le=10.0, description="plus this many per first call in the window")
    window_s: float = Field(default=60.0, gt=0)


class RetryBudget:
    """Spend one token per retry with :meth:`try_acquire`; False means the budget is spent."""

    def __init__(self, config: BudgetPolicy | None = None, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._config = config or BudgetPolicy()
        self._clock = clock
        self._lock = threading.Lock()
        self._spent: deque[float] = deque()
        self._calls: deque[float] = deque()

    @property
    def config(self) -> BudgetPolicy:
        return self._config

    def configure(self, config: BudgetPolicy) -> None:
        """Apply a new policy at run time; retries already spent still count against the new limit."""
        with self._lock:
            self._config = config

    def record_call(self) -> None:
        """A first call (not a retry) was made: with a ratio, it earns the budget ``ratio`` retries."""
        with self._lock:
            if self._config.enabled and self._config.ratio > 0:
                now = self._clock()
                self._calls.append(now)
                self._prune(now)

    def try_acquire(self) -> bool:
        """Take one retry from the budget if any is left in the current window."""
        with self._lock:
            if not self._config.enabled:
                return True
            now = self._clock()
            self._prune(now)
            if len(self._spent) >= self._allowance():
                return False
            self._spent.append(now)
            return True

    def remaining(self) -> int:
        """Retries still allowed in the current window."""
        with self._lock:
            self._prune(self._clock())
            return max(0, self._allowance() - len(self._spent))

    def _allowance(self) -> int:
        return self._config.retries_per_window + int(self._config.ratio * len(self._calls))

    def _prune(self, now: float) -> None:
        horizon = now - self._config.window_s
        for log in (self._spent, self._calls):
            while log and log[0] <= horizon:
                log.popleft()
