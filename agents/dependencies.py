"""The shared, per-dependency state of fault handling: one breaker, retry budget and pace per service.

They must be shared by every request to the same service in this process -- that is what makes them
work ("this service is failing", "retries to it are spent", "it asks us to slow down"), where
per-request state could not. The registry creates them on first use and applies the current policy to
them before every call, which is how a policy change reaches them without losing their state.

Every agent of a process built from a project (:func:`process_registry`) shares one registry, so agents
calling the same service share its breaker, budget and pace; agents in separate processes each learn on
their own. :meth:`DependencyRegistry.snapshots` reads them all at once, for operators.

Calls are counted per dependency and logged in aggregate (:class:`Tally`): one line per dependency per
interval saying how many calls were throttled, failed or timed out, not a line per call -- under a
throttling storm a line per call buries everything else.
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
from agents.faults import Fault, PermanentError, TransientError
from agents.pace import Pace
from agents.policy import DependencyPolicy

log = structlog.get_logger("stepstream.agent")

_STATE_VALUE = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}
BREAKER_STATE = Gauge("stepstream_agent_breaker_state",
                      "Circuit breaker state per dependency: 0 closed, 1 half-open, 2 open", ["dependency"])
BREAKER_TRANSITIONS = Counter("stepstream_agent_breaker_transitions_total",
                              "Circuit breaker state changes per dependency", ["dependency", "state"])
BUDGET_REMAINING = Gauge("stepstream_agent_retry_budget_remaining",
                         "Retries still allowed to a dependency in the current budget window", ["dependency"])
PACE_LIMIT = Gauge("stepstream_agent_pace_limit",
                   "Calls in flight at once a dependency is allowed, lowered by its throttles", ["dependency"])
OUTCOMES = ("ok", "throttled", "failed", "timed_out", "rejected")
"""How a call ended, for counts and logs: throttles, failures and timeouts are told apart."""
LOG_EVERY_S = 10.0


def outcome_of(fault: Fault | None) -> str:
    """The one word a call's end is counted under (see :data:`OUTCOMES`)."""
    if fault is None:
        return "ok"
    if isinstance(fault, PermanentError):
        return "rejected"
    return transient_outcome(fault.kind)


def transient_outcome(kind: str | None) -> str:
    """The word of :data:`OUTCOMES` for an end worth trying again, by its kind: a throttle, a timeout, or any
    other failure. The agent's fault kinds and the scheduler's (``schemas.messages.ErrorKind``) spell these
    two alike, so calls and attempts are counted in the same words."""
    return {"throttled": "throttled", "timeout": "timed_out"}.get(kind or "", "failed")


class Tally:
    """Call outcomes of one dependency: totals, and what went wrong logged in aggregate -- the first trouble
    at once, then at most one line every ``every_s`` saying what happened since the last one, and what is
    left at :meth:`flush` (the agent stopping). Lazy: the call that finds the interval passed logs it, so
    there is no thread. Thread-safe; the clock is injected."""

    def __init__(self, name: str, clock: Callable[[], float], every_s: float = LOG_EVERY_S) -> None:
        self._name = name
        self._clock = clock
        self._every_s = every_s
        self._lock = threading.Lock()
        self.totals = dict.fromkeys(OUTCOMES, 0)
        self._recent = dict.fromkeys(OUTCOMES, 0)
        self._since = clock()
        self._last_line = float("-inf")

    def count(self, outcome: str) -> None:
        with self._lock:
            self.totals[outcome] += 1
            self._recent[outcome] += 1
            line = self._take(self._clock()) if self._clock() - self._last_line >= self._every_s else None
        self._log(line)

    def flush(self) -> None:
        """Log what went wrong since the last line, if anything did."""
        with self._lock:
            line = self._take(self._clock())
        self._log(line)

    def _take(self, now: float) -> tuple[dict[str, int], float] | None:
        """The counts since the last line and the interval they cover, when there was trouble (lock held);
        a quiet interval is dropped, so the next line speaks of recent calls only."""
        recent, interval = self._recent, now - self._since
        self._recent, self._since = dict.fromkeys(OUTCOMES, 0), now
        if not (recent["throttled"] or recent["failed"] or recent["timed_out"]):
            return None
        self._last_line = now
        return recent, interval

    def _log(self, line: tuple[dict[str, int], float] | None) -> None:
        if line is None:
            return
        recent, interval = line
        log.warning(f"{self._name}: {recent['throttled']} throttled, {recent['failed']} failed, "
                    f"{recent['timed_out']} timed out of {sum(recent.values())} calls in the last {interval:.0f} s",
                    dependency=self._name, interval_s=round(interval, 3), **recent)


@dataclass(frozen=True)
class DependencyState:
    """One dependency at one moment, as an operator sees it."""

    name: str
    calls: dict[str, int]
    """Calls made since the process started, by outcome (:data:`OUTCOMES`)."""
    breaker: BreakerState
    breaker_retry_in_s: float
    budget_left: int
    pace_limit: float
    in_flight: int
    retry_after_left_s: float


@dataclass
class Dependency:
    """A remote service as seen by this process: its breaker, retry budget and pace, the policy applied."""

    name: str
    breaker: CircuitBreaker
    budget: RetryBudget
    pace: Pace
    tally: Tally
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
            self.pace.configure(policy.pace)
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

    def record(self, started: float, fault: Fault | None) -> None:
        """A call admitted by the breaker and the pace at ``started`` ended with ``fault`` (None: success).

        The policy says what the breaker makes of it (a throttle: nothing); the pace learns from throttles
        and from calls that passed; the tally counts it under its outcome.
        """
        verdict = self.policy.verdict(fault)
        if verdict == "success":
            self.breaker.record_success()
        elif verdict == "failure":
            self.breaker.record_failure()
        else:
            self.breaker.release()
        outcome = outcome_of(fault)
        self.pace.finished(started, throttled=outcome == "throttled", passed=fault is None,
                           retry_after_s=fault.retry_after_s if isinstance(fault, TransientError) else None)
        PACE_LIMIT.labels(self.name).set(self.pace.snapshot().limit)
        self.tally.count(outcome)

    def snapshot(self) -> DependencyState:
        breaker = self.breaker.state
        pace = self.pace.snapshot()
        return DependencyState(name=self.name, calls=dict(self.tally.totals), breaker=breaker,
                               breaker_retry_in_s=self.breaker.retry_in_s(), budget_left=self.budget.remaining(),
                               pace_limit=pace.limit, in_flight=pace.in_flight,
                               retry_after_left_s=pace.retry_after_left_s)


class DependencyRegistry:
    """Dependencies by name. One per process is the norm (:func:`process_registry`); tests make their own
    for isolation."""

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
                    pace=Pace(policy.pace, clock=self._clock),
                    tally=Tally(name, self._clock),
                    policy=policy,
                )
                self._by_name[name] = dependency
                BREAKER_STATE.labels(name).set(0)
                BUDGET_REMAINING.labels(name).set(dependency.budget.remaining())
                PACE_LIMIT.labels(name).set(policy.pace.initial_limit)
                return dependency
        dependency.apply(policy)
        return dependency

    def flush(self) -> None:
        """Log every dependency's trouble not yet logged (the agent is stopping)."""
        with self._lock:
            dependencies = list(self._by_name.values())
        for dependency in dependencies:
            dependency.tally.flush()

    def snapshots(self) -> list[DependencyState]:
        """Every dependency's state now, by name."""
        with self._lock:
            dependencies = sorted(self._by_name.values(), key=lambda d: d.name)
        return [d.snapshot() for d in dependencies]


_PROCESS = DependencyRegistry()


def process_registry() -> DependencyRegistry:
    """The registry every agent built from a project in this process shares (one breaker, budget and pace
    per service however many agents call it)."""
    return _PROCESS


def _breaker_moved(dependency: str, old: BreakerState, new: BreakerState) -> None:
    BREAKER_STATE.labels(dependency).set(_STATE_VALUE[new])
    BREAKER_TRANSITIONS.labels(dependency, new.value).inc()
    if new is BreakerState.OPEN:
        log.warning("circuit breaker opened: calls fail fast", dependency=dependency, previous=old.value)
    else:
        log.info(f"circuit breaker {new.value.replace('_', '-')}", dependency=dependency, previous=old.value)
