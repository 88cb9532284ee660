"""The shared, per-dependency state of fault handling: one breaker and one retry budget per service.

Both must be shared by every request to the same service in this process -- that is what makes them
work ("this service is failing", "retries to it are spent"), where per-request state could not. The
registry creates them on first use and applies the current policy to them before every call, which is
how a policy change reaches a breaker or budget that already exists without losing its state.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog
from prometheus_client import Counter, Gauge

from agents.breaker import BreakerState, CircuitBreaker
from agents.budget import RetryBudget
from agents.policy import DependencyPolicy

log = structlog.get_logger("stepstream.agent")

_STATE_VALUE = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}
BREAKER_STATE = Gauge("stepstream_agent_breaker_state",
                      "Circuit breaker state per dependency: 0 closed, 1 half-open, 2 open", ["dependency"])
BREAKER_TRANSITIONS = Counter("stepstream_agent_breaker_transitions_total",
                              "Circuit breaker state changes per dependency", ["dependency", "state"])
BUDGET_REMAINING = Gauge("stepstream_agent_retry_budget_remaining",
                         "Retries still allowed to a dependency in the current budget window", ["dependency"])


@dataclass
class Dependency:
    """A remote service as seen by this process: its breaker, its retry budget, the policy applied."""

    name: str
    breaker: CircuitBreaker
    budget: RetryBudget
    policy: DependencyPolicy
    #: Moving average of the time a call that got an answer took: what a new call should expect to need.
    usual_call_s: float = 0.0

    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def apply(self, policy: DependencyPolicy) -> None:
        """Use ``policy`` from the next call on, keeping breaker state and spent retries.

        Locked: concurrent attempts apply a reloaded policy at once, and breaker and budget must both get it.
        """
        if policy is self.policy:
            return
        with self._lock:
            if policy == self.policy:
                return
            self.breaker.configure(policy.breaker)
            self.budget.configure(policy.budget)
            self.policy = policy

    def first_call(self) -> None:
        """A call that is not a retry is about to be made (it earns the retry budget its ratio)."""
        self.budget.record_call()

    def answered_in(self, seconds: float) -> None:
        """A call got an answer after ``seconds``: fold it into the usual call time (EWMA, weight 1/8).

        A float assignment is atomic, so concurrent calls may lose an update but never corrupt the figure.
        """
        usual = self.usual_call_s
        self.usual_call_s = seconds if usual == 0.0 else usual + (seconds - usual) / 8

    def time_needed(self) -> float:
        """The least time left before a deadline at which a call is still started."""
        configured = self.policy.retry.min_call_time_s
        return self.usual_call_s if configured is None else configured

    def try_retry(self) -> bool:
        """Spend one retry from the budget; False when it is spent (fail fast)."""
        allowed = self.budget.try_acquire()
        BUDGET_REMAINING.labels(self.name).set(self.budget.remaining())
        return allowed


class DependencyRegistry:
    """Dependencies by name. One per process is the norm; tests make their own for isolation."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._by_name: dict[str, Dependency] = {}

    def get(self, name: str, policy: DependencyPolicy) -> Dependency:
        """The dependency ``name`` with ``policy`` applied (created on first use)."""
        with self._lock:
            dependency = self._by_name.get(name)
            if dependency is None:
                dependency = Dependency(
                    name=name,
                    breaker=CircuitBreaker(policy.breaker, clock=self._clock,
                                           on_transition=lambda old, new: _breaker_moved(name, old, new)),
                    budget=RetryBudget(policy.budget, clock=self._clock),
                    policy=policy,
                )
                self._by_name[name] = dependency
                BREAKER_STATE.labels(name).set(0)
                BUDGET_REMAINING.labels(name).set(dependency.budget.remaining())
                return dependency
        dependency.apply(policy)
        return dependency


def _breaker_moved(dependency: str, old: BreakerState, new: BreakerState) -> None:
    BREAKER_STATE.labels(dependency).set(_STATE_VALUE[new])
    BREAKER_TRANSITIONS.labels(dependency, new.value).inc()
    if new is BreakerState.OPEN:
        log.warning("circuit breaker opened: calls fail fast", dependency=dependency, previous=old.value)
    else:
        log.info(f"circuit breaker {new.value.replace('_', '-')}", dependency=dependency, previous=old.value)
