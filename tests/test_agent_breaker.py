"""The circuit breaker's state machine and the retry budget's window, on a fake clock (no sleeping)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from agents.breaker import BreakerPolicy, BreakerState, CircuitBreaker
from agents.budget import BudgetPolicy, RetryBudget
from tests.fakes import FakeClock


def breaker(clock: FakeClock, **config: float | int | bool) -> tuple[CircuitBreaker, list[tuple[str, str]]]:
    moves: list[tuple[str, str]] = []
    cb = CircuitBreaker(BreakerPolicy.model_validate(config), clock=clock,
                        on_transition=lambda old, new: moves.append((old.value, new.value)))
    return cb, moves


def state(cb: CircuitBreaker) -> BreakerState:
    """The breaker's state, read afresh (a helper, so type checkers do not narrow it between reads)."""
    return cb.state


def fail(cb: CircuitBreaker, times: int = 1) -> None:
    for _ in range(times):
        assert cb.try_acquire()
        cb.record_failure()


# ---- breaker ----------------------------------------------------------------------------------------


def test_breaker_opens_after_the_threshold_of_failures_within_the_window_and_then_fails_fast() -> None:
    clock = FakeClock(1000.0)
    cb, moves = breaker(clock, failure_threshold=3, window_s=10, open_for_s=5)
    fail(cb, 2)
    assert state(cb) is BreakerState.CLOSED
    fail(cb)
    assert state(cb) is BreakerState.OPEN and moves == [("closed", "open")]
    assert not cb.try_acquire()
    assert cb.retry_in_s() == 5.0


def test_failures_older_than_the_window_do_not_count() -> None:
    clock = FakeClock(1000.0)
    cb, _ = breaker(clock, failure_threshold=3, window_s=10)
    fail(cb, 2)
    clock.advance(10.5)
    fail(cb, 2)
    assert state(cb) is BreakerState.CLOSED


def test_a_low_failure_rate_does_not_open_the_breaker_even_past_the_count() -> None:
    clock = FakeClock(1000.0)
    cb, _ = breaker(clock, failure_threshold=3, failure_rate=0.5, window_s=60)
    for _ in range(10):
        assert cb.try_acquire()
        cb.record_success()
    fail(cb, 5)  # 5 of 15 failed: a third, under half
    assert state(cb) is BreakerState.CLOSED
    fail(cb, 5)  # 10 of 20: half
    assert state(cb) is BreakerState.OPEN


def test_after_the_cool_down_one_probe_passes_and_its_success_closes_the_breaker() -> None:
    clock = FakeClock(1000.0)
    cb, moves = breaker(clock, failure_threshold=2, open_for_s=5)
    fail(cb, 2)
    clock.advance(4.9)
    assert not cb.try_acquire()
    clock.advance(0.2)
    assert cb.try_acquire(), "the probe"
    assert not cb.try_acquire(), "only one probe at a time"
    cb.record_success()
    assert state(cb) is BreakerState.CLOSED
    assert moves == [("closed", "open"), ("open", "half_open"), ("half_open", "closed")]
    assert cb.try_acquire()


def test_a_failed_probe_opens_the_breaker_for_another_full_cool_down() -> None:
    clock = FakeClock(1000.0)
    cb, moves = breaker(clock, failure_threshold=2, open_for_s=5)
    fail(cb, 2)
    clock.advance(5)
    fail(cb)
    assert state(cb) is BreakerState.OPEN and cb.retry_in_s() == 5.0
    assert moves[-2:] == [("open", "half_open"), ("half_open", "open")]


def test_several_probes_must_all_succeed_to_close() -> None:
    clock = FakeClock(1000.0)
    cb, _ = breaker(clock, failure_threshold=1, open_for_s=1, probes=2)
    fail(cb)
    clock.advance(1)
    assert cb.try_acquire() and cb.try_acquire() and not cb.try_acquire()
    cb.record_success()
    assert state(cb) is BreakerState.HALF_OPEN
    cb.record_success()
    assert state(cb) is BreakerState.CLOSED


def test_a_probe_released_without_an_outcome_gives_its_slot_back() -> None:
    clock = FakeClock(1000.0)
    cb, _ = breaker(clock, failure_threshold=1, open_for_s=1)
    fail(cb)
    clock.advance(1)
    assert cb.try_acquire()
    cb.release()
    assert cb.try_acquire()


def test_a_closed_breaker_starts_its_window_afresh() -> None:
    clock = FakeClock(1000.0)
    cb, _ = breaker(clock, failure_threshold=2, window_s=60, open_for_s=1)
    fail(cb, 2)
    clock.advance(1)
    assert cb.try_acquire()
    cb.record_success()
    fail(cb)
    assert state(cb) is BreakerState.CLOSED, "failures from before the breaker opened are forgotten"


def test_disabling_the_breaker_at_run_time_closes_it_and_lets_every_call_through() -> None:
    clock = FakeClock(1000.0)
    cb, _ = breaker(clock, failure_threshold=1)
    fail(cb)
    assert not cb.try_acquire()
    cb.configure(BreakerPolicy(enabled=False))
    assert state(cb) is BreakerState.CLOSED
    fail(cb, 10)
    assert cb.try_acquire()


class BreakerMachine(RuleBasedStateMachine):
    """Random sequences of calls, outcomes and time: the breaker's guarantees hold after every step."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock(1000.0)
        self.config = BreakerPolicy(failure_threshold=3, failure_rate=0.5, window_s=5, open_for_s=2, probes=2)
        self.cb = CircuitBreaker(self.config, clock=self.clock)
        self.in_flight = 0
        self.opened_at: float | None = None
        self.admitted_while_half_open = 0

    @rule(seconds=st.floats(0.0, 3.0))
    def time_passes(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @rule()
    def call(self) -> None:
        state = self.cb.state
        allowed = self.cb.try_acquire()
        if state is BreakerState.CLOSED:
            assert allowed, "a closed breaker never refuses"
        if state is BreakerState.OPEN:
            assert not allowed, "an open breaker refuses until its cool-down has passed"
        if state is BreakerState.HALF_OPEN and allowed:
            self.admitted_while_half_open += 1
        if allowed:
            self.in_flight += 1

    @precondition(lambda self: self.in_flight > 0)
    @rule(ok=st.booleans())
    def outcome(self, ok: bool) -> None:
        self.in_flight -= 1
        before = self.cb.state
        if ok:
            self.cb.record_success()
        else:
            self.cb.record_failure()
            if before is BreakerState.HALF_OPEN:
                assert self.cb.state is BreakerState.OPEN, "a failed probe reopens at once"
        if self.cb.state is BreakerState.OPEN and before is not BreakerState.OPEN:
            self.opened_at = self.clock.now

    @invariant()
    def open_means_within_the_cool_down(self) -> None:
        state = self.cb.state
        if state is BreakerState.OPEN:
            assert self.opened_at is not None
            assert self.clock.now < self.opened_at + self.config.open_for_s
            assert 0 < self.cb.retry_in_s() <= self.config.open_for_s
        if state is not BreakerState.HALF_OPEN:
            self.admitted_while_half_open = 0
        assert self.admitted_while_half_open <= self.config.probes, "never more probes than configured"


TestBreakerStateMachine = BreakerMachine.TestCase
TestBreakerStateMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


# ---- retry budget -----------------------------------------------------------------------------------


def test_the_budget_allows_n_retries_per_window_then_refuses_until_they_age_out() -> None:
    clock = FakeClock(1000.0)
    budget = RetryBudget(BudgetPolicy(retries_per_window=3, window_s=60), clock=clock)
    assert [budget.try_acquire() for _ in range(5)] == [True, True, True, False, False]
    assert budget.remaining() == 0
    clock.advance(59.9)
    assert not budget.try_acquire()
    clock.advance(0.2)
    assert budget.remaining() == 3
    assert budget.try_acquire()


def test_the_window_slides_rather_than_resetting_all_at_once() -> None:
    clock = FakeClock(1000.0)
    budget = RetryBudget(BudgetPolicy(retries_per_window=2, window_s=10), clock=clock)
    assert budget.try_acquire()
    clock.advance(6)
    assert budget.try_acquire()
    clock.advance(5)  # the first retry is 11 s old, the second 5 s
    assert budget.try_acquire()
    assert not budget.try_acquire()


def test_with_a_ratio_the_budget_grows_with_first_calls_in_the_window_and_shrinks_as_they_age_out() -> None:
    clock = FakeClock(1000.0)
    budget = RetryBudget(BudgetPolicy(retries_per_window=1, ratio=0.5, window_s=10), clock=clock)
    for _ in range(4):
        budget.record_call()
    assert budget.remaining() == 1 + 2
    assert [budget.try_acquire() for _ in range(4)] == [True, True, True, False]
    clock.advance(10)
    assert budget.remaining() == 1, "calls and retries both aged out: back to the fixed allowance"


def test_a_new_budget_policy_applies_at_once_and_spent_retries_still_count() -> None:
    clock = FakeClock(1000.0)
    budget = RetryBudget(BudgetPolicy(retries_per_window=2, window_s=60), clock=clock)
    assert budget.try_acquire() and budget.try_acquire() and not budget.try_acquire()
    budget.configure(BudgetPolicy(retries_per_window=3, window_s=60))
    assert budget.try_acquire() and not budget.try_acquire()
    budget.configure(BudgetPolicy(enabled=False))
    assert all(budget.try_acquire() for _ in range(100))


@given(st.integers(0, 10), st.lists(st.floats(0.0, 30.0), max_size=60))
def test_the_budget_never_grants_more_than_n_in_any_window(limit: int, gaps: list[float]) -> None:
    clock = FakeClock(1000.0)
    budget = RetryBudget(BudgetPolicy(retries_per_window=limit, ratio=0, window_s=20), clock=clock)
    granted: list[float] = []
    for gap in gaps:
        clock.advance(gap)
        if budget.try_acquire():
            granted.append(clock.now)
    for t in granted:
        assert sum(1 for g in granted if t - 20 < g <= t) <= limit
