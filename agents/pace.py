"""The pace of one dependency: how many calls to it may be in flight at once, learned from its throttles.

A throttle (a 429, or any answer carrying ``Retry-After``) is the service asking us to slow down, not a
sign that it is down: it stays out of the breaker (:mod:`agents.policy` decides what the breaker records)
and the agent lowers its pace instead. The pace is a concurrency limit on calls in flight to the dependency
from this process, adapted AIMD-style as in Netflix's concurrency-limits (``AIMDLimit``) and TCP: cut
multiplicatively (``decrease``, 0.7 like the AWS SDKs' adaptive retry mode's beta) on a throttle, raised
additively (``increase`` per success, only while the limit is in use: at least half of it in flight)
while calls pass, between ``min_limit`` and ``max_limit``.

A limit on calls in flight also limits the rate (rate = limit / call time), and needs no token bucket or
timer: a caller that finds the limit reached waits for a call to end. One cut per round trip: a throttle
answering a call sent *before* the last cut is feedback on the old pace, already acted on, so it does not
cut again (TCP's one reduction per window) -- otherwise a burst of throttles already in flight would
collapse the limit to its floor in one go.

``Retry-After`` itself speaks for the request it answered: that request's next call waits at least that
long (:mod:`agents.retry` stretches it a little, upward only, so throttled calls do not all return
together). The pace keeps the latest such instant (:meth:`Pace.snapshot`) for operators.

Thread-safe; the clock is injected, so the maths is testable without sleeping.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, model_validator


class PacePolicy(BaseModel):
    """How the pace of one dependency adapts to its throttles, and how long an attempt waits one out."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = True
    initial_limit: float = Field(default=32.0, ge=1.0, description="calls in flight at once before any throttle")
    min_limit: float = Field(default=1.0, ge=1.0, description="the limit is never cut below this")
    max_limit: float = Field(default=256.0, ge=1.0, description="nor raised above this")
    decrease: float = Field(default=0.7, gt=0.0, lt=1.0, description="the limit is multiplied by this on a throttle")
    increase: float = Field(default=1.0, gt=0.0, description="and raised by this on every call that passes")
    wait_in_attempt_s: float = Field(
        default=1.0, ge=0.0, description="a throttle's wait up to this long is waited within the attempt; a longer "
        "one ends the attempt and the scheduler's timer waits it out (durable, and the agent's slot is free)")

    @model_validator(mode="after")
    def _ordered(self) -> PacePolicy:
        if not self.min_limit <= self.initial_limit <= self.max_limit:
            raise ValueError(f"need min_limit ({self.min_limit}) <= initial_limit ({self.initial_limit}) "
                             f"<= max_limit ({self.max_limit})")
        return self


@dataclass(frozen=True)
class PaceState:
    """The pace of one dependency at one moment (what an operator sees)."""

    limit: float
    in_flight: int
    retry_after_left_s: float


class Pace:
    """Admit a call with :meth:`try_start`; every True must be followed by exactly one :meth:`finished`."""

    def __init__(self, config: PacePolicy | None = None, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._config = config or PacePolicy()
        self._clock = clock
        self._lock = threading.Lock()
        self._limit = self._config.initial_limit
        self._in_flight = 0
        self._last_cut = float("-inf")
        self._retry_after_until = float("-inf")

    def configure(self, config: PacePolicy) -> None:
        """Apply a new policy at run time, keeping what was learned (clamped to the new bounds)."""
        with self._lock:
            self._config = config
            self._limit = min(config.max_limit, max(config.min_limit, self._limit))

    def try_start(self) -> float | None:
        """Admit a call if fewer than the limit are in flight: its start time (pass it to :meth:`finished`),
        or None when the caller must wait for a call to end."""
        with self._lock:
            if self._config.enabled and self._in_flight >= int(self._limit):
                return None
            self._in_flight += 1
            return self._clock()

    def finished(self, started: float, *, throttled: bool = False, passed: bool = False,
                 retry_after_s: float | None = None) -> None:
        """The call admitted at ``started`` ended: throttled (cut the limit, once per round trip), passed (the
        service did the work: raise it), or neither (a failure or a refusal: the breaker's business)."""
        with self._lock:
            in_use = self._in_flight * 2 >= self._limit  # an idle limit proves nothing: do not raise it
            self._in_flight = max(0, self._in_flight - 1)
            cfg = self._config
            now = self._clock()
            if throttled:
                if retry_after_s is not None:
                    self._retry_after_until = max(self._retry_after_until, now + retry_after_s)
                if started >= self._last_cut:
                    self._limit = max(cfg.min_limit, self._limit * cfg.decrease)
                    self._last_cut = now
            elif passed and in_use:
                self._limit = min(cfg.max_limit, self._limit + cfg.increase)

    def snapshot(self) -> PaceState:
        with self._lock:
            return PaceState(limit=self._limit, in_flight=self._in_flight,
                             retry_after_left_s=max(0.0, self._retry_after_until - self._clock()))
