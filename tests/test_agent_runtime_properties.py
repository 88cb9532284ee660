"""Properties of one attempt's retry loop on a fake clock: whatever the policy, the service's answers
and the scheduler's limits, no call is made past the allowance, the retry limit or the deadline."""

from __future__ import annotations

import random
from datetime import timedelta
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from agents.breaker import BreakerPolicy
from agents.budget import BudgetPolicy
from agents.policy import DependencyPolicy
from agents.retry import RetryPolicy
from agents.runtime import Agent, Call, TransientError
from schemas.messages import AgentRequest
from tests.fakes import EPOCH, FakeTime

answers = st.tuples(st.floats(0.0, 3.0), st.none() | st.floats(0.0, 5.0))  # (call duration, Retry-After)


@settings(max_examples=300, deadline=None)
@given(
    retry=st.builds(RetryPolicy, strategy=st.sampled_from(["exponential", "incremental", "regular"]),
                    max_retries=st.integers(0, 30), initial_backoff_s=st.floats(0.01, 1.0),
                    max_backoff_s=st.floats(1.0, 4.0), jitter=st.floats(0, 1), immediate_first_retry=st.booleans(),
                    call_timeout_s=st.floats(0.05, 5.0)),
    calls_allowed=st.integers(0, 20),
    deadline_s=st.floats(0.1, 20.0),
    script=st.lists(answers, min_size=1, max_size=40),
    budget=st.integers(0, 30),
    seed=st.integers(0, 2**16),
)
def test_an_attempt_stays_within_its_allowance_its_retry_limit_its_budget_and_its_deadline(
    retry: RetryPolicy, calls_allowed: int, deadline_s: float, script: list[tuple[float, float | None]],
    budget: int, seed: int,
) -> None:
    clock = FakeTime()
    starts: list[float] = []
    timeouts: list[float] = []

    def handler(call: Call) -> dict[str, Any]:
        starts.append(clock.now)
        timeouts.append(call.timeout_s)
        duration, retry_after = script[(len(starts) - 1) % len(script)]
        clock.now += min(duration, call.timeout_s)
        if duration > call.timeout_s:
            raise TimeoutError("read timed out")
        raise TransientError("503", retry_after_s=retry_after)

    policy = DependencyPolicy(retry=retry, breaker=BreakerPolicy(enabled=False),
                              budget=BudgetPolicy(retries_per_window=budget, ratio=0, window_s=3600))
    agent = Agent("prop", handler, policy, sleep=clock.sleep, monotonic=clock.monotonic, now=clock.wall,
                  rng=random.Random(seed))
    request = AgentRequest(task_id="t", step="s", attempt=1, attempt_id="t:s:1", idempotency_key="t:s",
                           complete_by=EPOCH + timedelta(seconds=deadline_s), calls_allowed=calls_allowed, input={})
    deadline = (request.complete_by - EPOCH).total_seconds()  # millisecond-truncated, as on the wire

    result = agent.execute(request)

    assert not result.ok and not result.permanent
    assert result.calls == len(starts)
    assert len(starts) <= calls_allowed
    assert len(starts) <= retry.max_retries + 1
    assert len(starts) <= budget + 1, "retries beyond the first call come out of the budget"
    assert all(start < deadline for start in starts), "no call starts at or after the deadline"
    assert all(start + timeout <= deadline + 1e-6 for start, timeout in zip(starts, timeouts, strict=True)), \
        "no call may run past the deadline"
    assert all(timeout <= retry.call_timeout_s for timeout in timeouts)


@settings(max_examples=200, deadline=None)
@given(min_call_s=st.floats(0.0, 2.0), deadline_s=st.floats(0.1, 10.0),
       script=st.lists(answers, min_size=1, max_size=20), seed=st.integers(0, 2**16))
def test_no_call_starts_with_less_time_left_than_a_call_needs(
    min_call_s: float, deadline_s: float, script: list[tuple[float, float | None]], seed: int,
) -> None:
    """A call cut off by the deadline may still land at the service: it is not started at all."""
    clock = FakeTime()
    starts: list[float] = []

    def handler(call: Call) -> dict[str, Any]:
        starts.append(clock.now)
        duration, retry_after = script[(len(starts) - 1) % len(script)]
        clock.now += min(duration, call.timeout_s)
        raise TransientError("503", retry_after_s=retry_after)

    retry = RetryPolicy(max_retries=50, initial_backoff_s=0.01, max_backoff_s=1.0, min_call_time_s=min_call_s)
    policy = DependencyPolicy(retry=retry, breaker=BreakerPolicy(enabled=False),
                              budget=BudgetPolicy(retries_per_window=100, ratio=0, window_s=3600))
    agent = Agent("prop", handler, policy, sleep=clock.sleep, monotonic=clock.monotonic, now=clock.wall,
                  rng=random.Random(seed))
    request = AgentRequest(task_id="t", step="s", attempt=1, attempt_id="t:s:1", idempotency_key="t:s",
                           complete_by=EPOCH + timedelta(seconds=deadline_s), calls_allowed=50, input={})
    deadline = (request.complete_by - EPOCH).total_seconds()

    result = agent.execute(request)

    assert result.calls == len(starts)
    assert all(deadline - start >= min_call_s for start in starts)


def test_an_attempt_with_less_time_left_than_the_usual_call_answers_at_once_without_calling() -> None:
    """Unconfigured, the time a call needs is what answered calls to the dependency took."""
    clock = FakeTime()
    calls: list[float] = []

    def handler(call: Call) -> dict[str, Any]:
        calls.append(clock.now)
        clock.now += 0.5  # the service answers in half a second
        return {"ok": True}

    agent = Agent("usual", handler, DependencyPolicy(breaker=BreakerPolicy(enabled=False)), sleep=clock.sleep,
                  monotonic=clock.monotonic, now=clock.wall)

    def request(n: int, left_s: float) -> AgentRequest:
        return AgentRequest(task_id=f"t{n}", step="s", attempt=1, attempt_id=f"t{n}:s:1", idempotency_key=f"t{n}:s",
                            complete_by=EPOCH + timedelta(seconds=clock.now + left_s), calls_allowed=3, input={})

    assert agent.execute(request(1, 5.0)).ok
    late = agent.execute(request(2, 0.3))

    assert len(calls) == 1
    assert not late.ok and not late.permanent and late.calls == 0
    assert "not started" in (late.error or "")
