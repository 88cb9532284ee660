"""Agent fault handling against the real order service (a process, real HTTP) with its faults switched on.

Each test runs ``Agent.execute`` in process -- no broker needed -- and counts what reached the service at
``GET /admin/calls``, so "no more calls than allowed" is measured where it matters, not inferred.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY
from structlog.testing import capture_logs

from agents.breaker import BreakerPolicy
from agents.budget import BudgetPolicy
from agents.http import http_handler
from agents.policy import DependencyPolicy, FilePolicy
from agents.retry import RetryPolicy
from agents.runtime import Agent, AgentHandler, AttemptAbandoned, Call, TransientError
from demo.orders_client import Operation, OrdersAdmin, ServiceProcess
from schemas.messages import AgentRequest, StepResult

OP: Operation = "inventory/reserve"


def unguarded(retry: RetryPolicy | None = None) -> DependencyPolicy:
    """A policy with neither breaker nor retry budget, for tests about the retry loop alone."""
    return DependencyPolicy(retry=retry or RetryPolicy(), breaker=BreakerPolicy(enabled=False),
                            budget=BudgetPolicy(enabled=False))


@pytest.fixture(scope="module")
def service() -> Iterator[ServiceProcess]:
    with ServiceProcess(seed=11) as proc:
        yield proc


@pytest.fixture
def admin(service: ServiceProcess) -> Iterator[OrdersAdmin]:
    with service.admin() as client:
        client.reset()
        yield client


class Sleeps:
    """A sleeper that really sleeps and records every back-off, per thread (one request per thread)."""

    def __init__(self) -> None:
        self.by_thread: dict[int, list[float]] = defaultdict(list)
        self._never = threading.Event()

    def __call__(self, seconds: float) -> bool:
        self.by_thread[threading.get_ident()].append(seconds)
        return self._never.wait(seconds)

    @property
    def all(self) -> list[list[float]]:
        return list(self.by_thread.values())


class CallTimes:
    """Wraps a handler to record when each call started (monotonic), and optionally act after call n."""

    def __init__(self, inner: AgentHandler, after_call: dict[int, Any] | None = None) -> None:
        self.inner = inner
        self.started: list[float] = []
        self.after_call = after_call or {}

    def __call__(self, call: Call) -> dict[str, Any]:
        self.started.append(time.monotonic())
        try:
            return self.inner(call)
        finally:
            action = self.after_call.get(len(self.started))
            if action is not None:
                action()


def dependency() -> str:
    """A fresh dependency name per test: breaker, budget and metric series start clean."""
    return f"orders-{uuid.uuid4().hex[:8]}"


def request(*, calls_allowed: int = 10, deadline_s: float = 10.0) -> AgentRequest:
    task_id = f"t-{uuid.uuid4().hex[:12]}"
    return AgentRequest(task_id=task_id, step="reserve", attempt=1, attempt_id=f"{task_id}:reserve:1",
                        idempotency_key=f"{task_id}:reserve",
                        complete_by=datetime.now(UTC) + timedelta(seconds=deadline_s), calls_allowed=calls_allowed,
                        input={"task": {"order_id": task_id, "sku": "A-1", "qty": 1}})


def agent(service: ServiceProcess, policy: DependencyPolicy | FilePolicy, *, handler: AgentHandler | None = None,
          sleep: Sleeps | None = None, dep: str | None = None) -> Agent:
    return Agent("inventory", handler or http_handler(service.base_url, OP), policy,
                 dependency=dep or dependency(), sleep=sleep)


def requests_at_service(admin: OrdersAdmin, key: str | None = None) -> int:
    per_key = admin.calls()["requests"].get(OP, {})
    return per_key.get(key, 0) if key is not None else sum(per_key.values())


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


# ---- retry with back-off -------------------------------------------------------------------------------


def test_a_service_failing_twice_then_answering_succeeds_on_the_third_call_after_growing_delays(
    service: ServiceProcess, admin: OrdersAdmin,
) -> None:
    admin.set_faults(OP, fail_next=2)
    sleeps = Sleeps()
    timed = CallTimes(http_handler(service.base_url, OP))
    policy = unguarded(RetryPolicy(initial_backoff_s=0.1, max_backoff_s=2.0, jitter=0.5))
    worker = agent(service, policy, handler=timed, sleep=sleeps)
    req = request()
    retries_before = metric("stepstream_agent_retries_total", agent="inventory", dependency=worker.dependency,
                            cause="server_error")

    result = worker.execute(req)

    assert result.ok and result.calls == 3 and result.output and result.output["status"] == "reserved"
    assert requests_at_service(admin, req.idempotency_key) == 3
    assert admin.applied_for(OP, req.idempotency_key) == 1
    (delays,) = sleeps.all
    assert len(delays) == 2 and 0.05 <= delays[0] <= 0.1 <= delays[1] <= 0.2 and delays[1] > delays[0]
    gaps = [b - a for a, b in zip(timed.started, timed.started[1:], strict=False)]
    assert all(gap >= delay for gap, delay in zip(gaps, delays, strict=True)), "each call waited out its delay"
    assert metric("stepstream_agent_retries_total", agent="inventory", dependency=worker.dependency,
                  cause="server_error") == retries_before + 2


def test_concurrent_failing_requests_back_off_by_different_jittered_delays(
    service: ServiceProcess, admin: OrdersAdmin,
) -> None:
    admin.set_faults(OP, error_rate=1.0)
    sleeps = Sleeps()
    policy = unguarded(RetryPolicy(max_retries=2, initial_backoff_s=0.05, max_backoff_s=1.0))
    worker = agent(service, policy, sleep=sleeps)
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: worker.execute(request()), range(8)))

    assert all(not r.ok and not r.permanent and r.calls == 3 for r in results)
    assert requests_at_service(admin) == 24
    delays = sleeps.all
    assert len(delays) == 8 and all(len(d) == 2 and d[1] > d[0] for d in delays), "each request's delays grow"
    assert len({d[0] for d in delays}) == 8 and len({d[1] for d in delays}) == 8, "no two requests retry in step"


def test_a_429_with_retry_after_makes_the_next_call_wait_at_least_that_long(
    service: ServiceProcess, admin: OrdersAdmin,
) -> None:
    admin.set_faults(OP, throttle_rate=1.0, retry_after_s=1)
    timed = CallTimes(http_handler(service.base_url, OP), after_call={1: lambda: admin.clear_faults(OP)})
    sleeps = Sleeps()
    # The computed back-off would be at most 20 ms: only Retry-After explains a wait of a second.
    policy = unguarded(RetryPolicy(initial_backoff_s=0.01, max_backoff_s=0.02))
    worker = agent(service, policy, handler=timed, sleep=sleeps)

    with capture_logs() as logs:
        result = worker.execute(request())

    assert result.ok and result.calls == 2
    ((slept,),) = sleeps.all
    assert 1.0 <= slept <= 1.2, "Retry-After, stretched upward by at most the policy's 20 %"
    assert timed.started[1] - timed.started[0] >= 1.0
    (line,) = [e for e in logs if e["log_level"] == "warning"]
    assert line["event"].endswith(": 1 throttled, 0 failed, 0 timed out of 1 calls in the last 0 s"), \
        "the dependency's aggregated line, not one per call"
    assert metric("stepstream_agent_calls_total", agent="inventory", dependency=worker.dependency,
                  outcome="throttled") == 1
    (state,) = worker.dependencies.snapshots()
    assert state.calls["throttled"] == 1 and state.calls["ok"] == 1 and state.calls["failed"] == 0


def test_a_retry_after_longer_than_an_attempt_waits_ends_the_attempt_at_once_and_hands_the_wait_to_the_scheduler(
    service: ServiceProcess, admin: OrdersAdmin,
) -> None:
    admin.set_faults(OP, throttle_rate=1.0, retry_after_s=3)
    worker = agent(service, unguarded())
    started = time.monotonic()
    result = worker.execute(request(deadline_s=30))
    assert not result.ok and not result.permanent and result.calls == 1
    assert "left to the scheduler" in (result.error or "")
    assert time.monotonic() - started < 1.0
    assert result.error_kind == "throttled" and result.throttled and not result.deferred
    assert result.retry_after_s is not None and 2.9 < result.retry_after_s <= 3.6, "the wait asked, stretched"
    assert metric("stepstream_agent_step_seconds_count", agent="inventory", dependency=worker.dependency,
                  outcome="throttled") == 1, "the attempt is timed under the calls' word for how it ended"


def test_a_permanent_refusal_is_answered_after_exactly_one_call_and_logged_as_an_error(
    service: ServiceProcess, admin: OrdersAdmin,
) -> None:
    admin.set_faults(OP, permanent_error_rate=1.0)
    worker = agent(service, DependencyPolicy(retry=RetryPolicy(max_retries=5)))
    req = request()
    with capture_logs() as logs:
        result = worker.execute(req)
    assert not result.ok and result.permanent and result.calls == 1 and result.error_kind == "permanent"
    assert "422" in (result.error or "")
    assert requests_at_service(admin, req.idempotency_key) == 1
    assert [e["log_level"] for e in logs if e["event"] == "permanent failure"] == ["error"]
    assert not [e for e in logs if e["log_level"] == "warning"]
    assert metric("stepstream_agent_step_seconds_count", agent="inventory", dependency=worker.dependency,
                  outcome="rejected") == 1


@pytest.mark.parametrize(("calls_allowed", "max_retries"), [(1, 10), (3, 10), (4, 1), (2, 0)])
def test_an_attempt_never_makes_more_calls_than_the_scheduler_allowed_or_the_policy_permits(
    service: ServiceProcess, admin: OrdersAdmin, calls_allowed: int, max_retries: int,
) -> None:
    admin.set_faults(OP, error_rate=1.0)
    policy = unguarded(RetryPolicy(max_retries=max_retries, initial_backoff_s=0.01, max_backoff_s=0.02))
    req = request(calls_allowed=calls_allowed)
    result = agent(service, policy).execute(req)
    expected = min(calls_allowed, max_retries + 1)
    assert not result.ok and not result.permanent and result.calls == expected
    assert requests_at_service(admin, req.idempotency_key) == expected


def test_every_call_times_out_and_no_call_starts_after_the_deadline(
    service: ServiceProcess, admin: OrdersAdmin,
) -> None:
    admin.set_faults(OP, hang=True, hang_max_s=30)
    policy = unguarded(RetryPolicy(max_retries=50, initial_backoff_s=0.05, max_backoff_s=0.1, call_timeout_s=0.3))
    timed = CallTimes(http_handler(service.base_url, OP))
    # The agent's wall clock is read off the monotonic one, so the request's deadline is one exact monotonic
    # instant for the agent and for this test alike (two separate readings of two clocks drift apart).
    base_wall, base = datetime.now(UTC), time.monotonic()
    req = request(calls_allowed=50, deadline_s=1.5)
    deadline = base + (req.complete_by - base_wall).total_seconds()
    worker = Agent("inventory", timed, policy, dependency=dependency(),
                   now=lambda: base_wall + timedelta(seconds=time.monotonic() - base))
    result = worker.execute(req)
    finished = time.monotonic()

    assert not result.ok and not result.permanent and 2 <= result.calls <= 5
    assert all(t < deadline for t in timed.started), "no call started after the deadline"
    assert finished - deadline < 1.0, "the last call was cut short near the deadline, not left to hang"
    # A last call with only milliseconds left may time out before the service has counted it.
    assert result.calls - 1 <= requests_at_service(admin, req.idempotency_key) <= result.calls


# ---- retry budget --------------------------------------------------------------------------------------


def test_the_retry_budget_caps_retries_per_minute_across_many_concurrent_requests(
    service: ServiceProcess, admin: OrdersAdmin,
) -> None:
    admin.set_faults(OP, error_rate=1.0)
    policy = DependencyPolicy(retry=RetryPolicy(max_retries=3, initial_backoff_s=0.01, max_backoff_s=0.05),
                              budget=BudgetPolicy(retries_per_window=5, ratio=0, window_s=60),
                              breaker=BreakerPolicy(enabled=False))
    worker = agent(service, policy)
    with ThreadPoolExecutor(12) as pool:
        results: list[StepResult] = list(pool.map(lambda _: worker.execute(request()), range(12)))

    assert requests_at_service(admin) == 12 + 5, "every first call, and only 5 retries in all"
    assert sum(r.calls for r in results) == 17
    spent = [r for r in results if "retry budget" in (r.error or "")]
    assert len(spent) >= 12 - 5 and all(not r.permanent for r in spent), "the rest failed fast as transient"
    assert metric("stepstream_agent_retry_budget_remaining", dependency=worker.dependency) == 0


# ---- circuit breaker -----------------------------------------------------------------------------------


def test_the_breaker_opens_under_sustained_failure_stops_calls_probes_and_closes_when_the_service_recovers(
    service: ServiceProcess, admin: OrdersAdmin,
) -> None:
    admin.set_faults(OP, error_rate=1.0)
    policy = DependencyPolicy(retry=RetryPolicy(max_retries=0),
                              breaker=BreakerPolicy(failure_threshold=3, window_s=60, open_for_s=1.0))
    worker = agent(service, policy)

    def state() -> float:
        return metric("stepstream_agent_breaker_state", dependency=worker.dependency)

    assert [worker.execute(request()).calls for _ in range(3)] == [1, 1, 1]
    assert state() == 2, "open"
    fast = [worker.execute(request()) for _ in range(5)]
    assert all(r.calls == 0 and not r.ok and not r.permanent and "circuit breaker" in (r.error or "") for r in fast)
    assert all(r.deferred and r.error_kind == "breaker_open" for r in fast), "refused without a call: deferred"
    assert all(r.retry_after_s is not None and 0 < r.retry_after_s <= 1.0 for r in fast), "the breaker's time left"
    assert requests_at_service(admin) == 3, "no call reached the service while open"

    time.sleep(1.1)
    assert worker.execute(request()).calls == 1, "after the cool-down one probe is let through"
    assert state() == 2 and requests_at_service(admin) == 4, "it failed: open again"
    assert worker.execute(request()).calls == 0

    admin.clear_faults(OP)
    time.sleep(1.1)
    probe = worker.execute(request())
    assert probe.ok and probe.calls == 1
    assert state() == 0, "closed"
    assert all(worker.execute(request()).ok for _ in range(3))
    assert requests_at_service(admin) == 8
    opened = metric("stepstream_agent_breaker_transitions_total", dependency=worker.dependency, state="open")
    assert opened == 2


def test_a_breaker_opening_mid_attempt_stops_that_attempts_retries(
    service: ServiceProcess, admin: OrdersAdmin,
) -> None:
    admin.set_faults(OP, error_rate=1.0)
    policy = DependencyPolicy(retry=RetryPolicy(max_retries=5, initial_backoff_s=0.01, max_backoff_s=0.02),
                              breaker=BreakerPolicy(failure_threshold=2, window_s=60, open_for_s=30))
    result = agent(service, policy).execute(request())
    assert result.calls == 2 and not result.permanent and "circuit breaker" in (result.error or "")
    assert result.error_kind == "breaker_open" and not result.deferred, "it made calls: a failed attempt"
    assert requests_at_service(admin) == 2


# ---- central policy at run time ------------------------------------------------------------------------


def test_a_policy_change_at_run_time_changes_the_next_calls_behaviour_without_a_restart(
    service: ServiceProcess, admin: OrdersAdmin, tmp_path: Path,
) -> None:
    admin.set_faults(OP, error_rate=1.0)
    dep = dependency()
    path = tmp_path / "policy.toml"

    def write(max_retries: int) -> None:
        tmp = tmp_path / "policy.toml.tmp"
        tmp.write_text(f"[defaults.retry]\ninitial_backoff_s = 0.01\nmax_backoff_s = 0.02\n"
                       f"[defaults.breaker]\nenabled = false\n"
                       f"[dependencies.{dep}.retry]\nmax_retries = {max_retries}\n")
        tmp.replace(path)

    write(0)
    worker = agent(service, FilePolicy(path, poll_interval_s=0.0), dep=dep)
    assert worker.execute(request()).calls == 1

    write(2)
    assert worker.execute(request()).calls == 3, "the same agent object, the new policy"

    path.write_text(f"[dependencies.{dep}.retry]\nmax_retries = -1\n")
    with capture_logs() as logs:
        assert worker.execute(request()).calls == 3, "a bad file is refused; the previous policy stays"
    assert any(e["log_level"] == "error" and f"dependencies.{dep}.retry.max_retries" in e.get("error", "")
               for e in logs)


# ---- the runtime's contract with handlers (no service needed) ------------------------------------------


def test_a_handler_can_raise_a_transient_error_with_its_own_suggested_delay() -> None:
    answers: list[Exception | None] = [TransientError("busy", retry_after_s=0.25, kind="throttled"), None]

    def handler(call: Call) -> dict[str, Any]:
        error = answers.pop(0)
        if error is not None:
            raise error
        return {"done": True}

    sleeps = Sleeps()
    result = Agent("custom", handler, unguarded(), sleep=sleeps).execute(request())
    ((slept,),) = sleeps.all
    assert result.ok and result.calls == 2 and 0.25 <= slept <= 0.3


def test_an_unexpected_exception_in_a_handler_is_a_permanent_failure_after_one_call() -> None:
    calls: list[Call] = []

    def handler(call: Call) -> dict[str, Any]:
        calls.append(call)
        raise ZeroDivisionError("a bug")

    with capture_logs() as logs:
        result = Agent("custom", handler, unguarded(RetryPolicy(max_retries=5))).execute(request())
    assert not result.ok and result.permanent and result.calls == 1 and len(calls) == 1
    assert "ZeroDivisionError" in (result.error or "")
    assert [e["log_level"] for e in logs if e["event"] == "permanent failure"] == ["error"]


def test_every_call_is_given_the_policy_timeout_or_the_time_left_whichever_is_shorter() -> None:
    timeouts: list[float] = []

    def handler(call: Call) -> dict[str, Any]:
        timeouts.append(call.timeout_s)
        raise TransientError("down")

    Agent("custom", handler, unguarded(RetryPolicy(call_timeout_s=0.5, max_retries=0))).execute(request())
    Agent("custom", handler, unguarded(RetryPolicy(call_timeout_s=30, max_retries=0))).execute(
        request(deadline_s=2))
    assert timeouts[0] == 0.5 and 1.0 < timeouts[1] <= 2.0


def test_a_drain_during_a_back_off_abandons_the_attempt_without_another_call(
    service: ServiceProcess, admin: OrdersAdmin,
) -> None:
    admin.set_faults(OP, error_rate=1.0)
    stopping = threading.Event()
    worker = Agent("inventory", http_handler(service.base_url, OP),
                   unguarded(RetryPolicy(initial_backoff_s=5, max_backoff_s=5, jitter=0)), stopping,
                   dependency=dependency())
    req = request(deadline_s=30)
    threading.Timer(0.3, stopping.set).start()
    started = time.monotonic()
    with pytest.raises(AttemptAbandoned):
        worker.execute(req)
    assert time.monotonic() - started < 3, "the 5 s back-off ended at the drain"
    assert requests_at_service(admin, req.idempotency_key) == 1
