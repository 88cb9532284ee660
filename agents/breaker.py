"""A circuit breaker per dependency: stop calling a service that is failing, probe it, resume.

Retries help with blips; against a service that is down they only add load and make every step wait
out its back-off. The breaker notices sustained failure and makes calls fail fast instead, which frees
the agent for other work and gives the service room to recover.

States (resilience4j's, with a time window instead of a count window so that a quiet agent does not
trip on failures from an hour ago):

- ``closed``: calls pass. Each outcome is recorded with its time; when the last ``window_s`` seconds hold
  at least ``failure_threshold`` failures *and* failures are at least ``failure_rate`` of the calls in
  that window, the breaker opens. Requiring both avoids opening on three unlucky calls out of thousands.
- ``open``: calls are refused (fail fast) for ``open_for_s`` seconds.
- ``half_open``: after the cool-down, up to ``probes`` trial calls pass; if they all succeed the breaker
  closes (with an empty window), if any fails it opens again for another cool-down.

What counts as a failure is the caller's choice: the policy's ``breaker_records`` (:mod:`agents.policy`)
names the faults of a service that is down (timeouts, refused connections, 5xx); a throttle is the
service pacing us and a 4xx is an answer, so neither opens it. The open -> half-open move happens
lazily, when the next caller asks; there is no timer thread. Thread-safe; the clock is injected so the
state machine is testable without sleeping.

The defaults (20 failures and half the calls within a minute) are deliberately conservative, like
Polly's and resilience4j's minimum-throughput defaults: an open breaker refuses every call to the
dependency, for every task, so a breaker that trips on a short blip stalls them all for its cool-down.
Tighten it per dependency in the policy.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field


class BreakerPolicy(BaseModel):
    """When a dependency's breaker opens, how long it stays open, how it probes."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = True
    failure_threshold: int = Field(default=20, ge=1, description="failures within the window needed to open")
    failure_rate: float = Field(default=0.5, gt=0.0, le=1.0,
                                description="and the share of calls within the window that failed")
    window_s: float = Field(default=60.0, gt=0, description="how far back failures count")
    open_for_s: float = Field(default=5.0, gt=0, description="cool-down before a probe is let through")
    probes: int = Field(default=1, ge=1, description="trial calls in half-open; all must succeed to close")


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


Transition = Callable[[BreakerState, BreakerState], None]


class CircuitBreaker:
    """The breaker of one dependency. Call :meth:`try_acquire` before a call and record its outcome after.

    Every ``True`` from :meth:`try_acquire` must be followed by exactly one of :meth:`record_success`,
    :meth:`record_failure` or :meth:`release` (the call ended without an outcome, e.g. interrupted), so a
    half-open probe slot is never leaked.
    """

    def __init__(self, config: BreakerPolicy | None = None, *, clock: Callable[[], float] = time.monotonic,
                 on_transition: Transition | None = None) -> None:
        self._config = config or BreakerPolicy()
        self._clock = clock
        self._on_transition = on_transition
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self._window: deque[tuple[float, bool]] = deque()  # (when, failed)
        self._failures = 0
        self._opened_at = 0.0
        self._probes_admitted = 0
        self._probe_successes = 0

    @property
    def config(self) -> BreakerPolicy:
        return self._config

    def configure(self, config: BreakerPolicy) -> None:
        """Apply a new policy at run time, keeping the state (a disabled breaker is closed)."""
        fired: list[tuple[BreakerState, BreakerState]] = []
        with self._lock:
            if config == self._config:
                return
            self._config = config
            if not config.enabled:
                self._move(BreakerState.CLOSED, fired)
        self._fire(fired)

    @property
    def state(self) -> BreakerState:
        """The current state, moving open -> half-open if the cool-down has passed."""
        fired: list[tuple[BreakerState, BreakerState]] = []
        with self._lock:
            self._cool_down(self._clock(), fired)
            state = self._state
        self._fire(fired)
        return state

    def retry_in_s(self) -> float:
        """Seconds until an open breaker lets a probe through (0 when not open)."""
        with self._lock:
            if self._state is not BreakerState.OPEN:
                return 0.0
            left = self._opened_at + self._config.open_for_s - self._clock()
            return min(self._config.open_for_s, max(0.0, left))  # clamped: float sums round

    def try_acquire(self) -> bool:
        """May a call be made now? False means fail fast; True obliges the caller to record the outcome."""
        fired: list[tuple[BreakerState, BreakerState]] = []
        with self._lock:
            if not self._config.enabled:
                return True
            self._cool_down(self._clock(), fired)
            if self._state is BreakerState.CLOSED:
                allowed = True
            elif self._state is BreakerState.OPEN:
                allowed = False
            else:
                allowed = self._probes_admitted < self._config.probes
                if allowed:
                    self._probes_admitted += 1
        self._fire(fired)
        return allowed

    def record_success(self) -> None:
        """The call got an answer (success, or a permanent refusal: the service is up)."""
        fired: list[tuple[BreakerState, BreakerState]] = []
        with self._lock:
            now = self._clock()
            if self._state is BreakerState.HALF_OPEN:
                self._probe_successes += 1
                if self._probe_successes >= self._config.probes:
                    self._move(BreakerState.CLOSED, fired)
            elif self._state is BreakerState.CLOSED:
                self._window.append((now, False))
                self._prune(now)
            # OPEN: a call admitted before the breaker opened; its success alone does not close it.
        self._fire(fired)

    def record_failure(self) -> None:
        """The call failed in a way the policy records (the service looks down)."""
        fired: list[tuple[BreakerState, BreakerState]] = []
        with self._lock:
            now = self._clock()
            if self._state is BreakerState.HALF_OPEN:
                self._open(now, fired)
            elif self._state is BreakerState.CLOSED:
                self._window.append((now, True))
                self._failures += 1
                self._prune(now)
                cfg = self._config
                if (cfg.enabled and self._failures >= cfg.failure_threshold
                        and self._failures >= cfg.failure_rate * len(self._window)):
                    self._open(now, fired)
        self._fire(fired)

    def release(self) -> None:
        """A call admitted by :meth:`try_acquire` ended without an outcome: give its probe slot back."""
        with self._lock:
            if self._state is BreakerState.HALF_OPEN and self._probes_admitted > self._probe_successes:
                self._probes_admitted -= 1

    # ---- internals (lock held) ---------------------------------------------------------------------

    def _prune(self, now: float) -> None:
        horizon = now - self._config.window_s
        while self._window and self._window[0][0] <= horizon:
            _, failed = self._window.popleft()
            if failed:
                self._failures -= 1

    def _cool_down(self, now: float, fired: list[tuple[BreakerState, BreakerState]]) -> None:
        if self._state is BreakerState.OPEN and now >= self._opened_at + self._config.open_for_s:
            self._move(BreakerState.HALF_OPEN, fired)

    def _open(self, now: float, fired: list[tuple[BreakerState, BreakerState]]) -> None:
        self._opened_at = now
        self._move(BreakerState.OPEN, fired)

    def _move(self, to: BreakerState, fired: list[tuple[BreakerState, BreakerState]]) -> None:
        if to is BreakerState.CLOSED or to is BreakerState.OPEN:
            self._window.clear()
            self._failures = 0
        self._probes_admitted = 0
        self._probe_successes = 0
        if to is not self._state:
            fired.append((self._state, to))
            self._state = to

    def _fire(self, fired: list[tuple[BreakerState, BreakerState]]) -> None:
        # Outside the lock: a callback that logs or reads the breaker must not deadlock it.
        if self._on_transition is not None:
            for old, new in fired:
                self._on_transition(old, new)
