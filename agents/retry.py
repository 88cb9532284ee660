"""How long an agent waits before calling a dependency again, and how many times it tries.

The delay maths is pure (a policy, a retry number, a random source) so it can be proven with a fake
random source and property tests; the agent runtime owns the clock, the deadline and the sleeping.

Three schedules, as in Polly / resilience4j:

- ``exponential`` (default): ``initial * multiplier ** (n - 1)``, the usual answer to an overloaded
  service -- every client backs off faster than load can pile up.
- ``incremental``: ``initial + increment * (n - 1)``, a gentler growth for services that recover quickly.
- ``regular``: ``initial`` every time, for polling-like dependencies with a known recovery time.

Every schedule is capped at ``max_backoff_s`` and then jittered: the delay is drawn uniformly from
``[(1 - jitter) * d, d]``. Jitter is what stops many clients that failed together from retrying together
(the thundering herd); ``jitter = 0.5`` ("equal jitter") keeps exponential delays growing from one retry
to the next, ``1.0`` is AWS's "full jitter".

``immediate_first_retry`` allows one retry without any delay (a dropped connection is often fixed by
simply reconnecting); only the first retry may be immediate, so a failing service is never hammered.
A ``Retry-After`` (or a handler's suggested delay) replaces the computed delay: the service knows its own
recovery time better than our formula does. It is a floor, so it is jittered upward only (by up to
``retry_after_jitter`` of itself): many calls throttled at once with the same ``Retry-After`` would
otherwise all come back in the same instant.
"""

from __future__ import annotations

import random
from typing import Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

Strategy = Literal["exponential", "incremental", "regular"]


class RetryPolicy(BaseModel):
    """Bounded retry within one attempt of a step (the scheduler's allowance and deadline bound it too)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    strategy: Strategy = "exponential"
    max_retries: int = Field(default=3, ge=0, le=1000, description="retries after the first call, per attempt")
    initial_backoff_s: float = Field(default=0.1, gt=0, description="the first (non-immediate) delay")
    multiplier: float = Field(default=2.0, ge=1.0, le=100.0, description="growth factor of 'exponential'")
    increment_s: float = Field(default=0.1, ge=0, description="growth per retry of 'incremental'")
    max_backoff_s: float = Field(default=5.0, gt=0, description="cap on any computed delay (not on Retry-After)")
    jitter: float = Field(default=0.5, ge=0.0, le=1.0, description="share of the delay that is randomised")
    retry_after_jitter: float = Field(default=0.2, ge=0.0, le=1.0,
                                      description="a Retry-After is stretched by up to this share (upward only)")
    immediate_first_retry: bool = Field(default=False, description="the first retry, and only it, has no delay")
    call_timeout_s: float = Field(default=10.0, gt=0, description="timeout of every single call")
    min_call_time_s: float | None = Field(
        default=None, ge=0, description="time a call needs: none is started with less left before the deadline "
        "(a call cut off by the deadline may still land at the service); unset: the dependency's usual call time")

    @model_validator(mode="after")
    def _cap_not_below_start(self) -> Self:
        if self.max_backoff_s < self.initial_backoff_s:
            raise ValueError(f"max_backoff_s ({self.max_backoff_s}) must be at least initial_backoff_s "
                             f"({self.initial_backoff_s})")
        return self

    def base_delay(self, retry: int) -> float:
        """The un-jittered delay before retry number ``retry`` (1 is the first retry)."""
        if retry < 1:
            raise ValueError("retries are numbered from 1")
        step = retry
        if self.immediate_first_retry:
            if retry == 1:
                return 0.0
            step = retry - 1
        if self.strategy == "regular":
            delay = self.initial_backoff_s
        elif self.strategy == "incremental":
            delay = self.initial_backoff_s + self.increment_s * (step - 1)
        else:
            # Bounded exponent: past the cap the value no longer matters and a huge power would overflow.
            exponent = min(step - 1, 1024)
            try:
                delay = self.initial_backoff_s * self.multiplier**exponent
            except OverflowError:
                delay = self.max_backoff_s
        return min(delay, self.max_backoff_s)

    def delay(self, retry: int, rng: random.Random, retry_after_s: float | None = None) -> float:
        """Seconds to wait before retry number ``retry``: ``retry_after_s`` stretched upward if given, else
        jittered back-off."""
        if retry_after_s is not None:
            # Stretched, never shortened: calls throttled together do not all come back together.
            return max(0.0, retry_after_s) * (1.0 + rng.uniform(0.0, self.retry_after_jitter))
        ceiling = self.base_delay(retry)
        if ceiling == 0.0 or self.jitter == 0.0:
            return ceiling
        return min(ceiling, rng.uniform(ceiling * (1.0 - self.jitter), ceiling))  # uniform may round past b
