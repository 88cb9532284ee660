"""Pacing a throttled dependency, without a broker: the AIMD limit, what the breaker records, and what an
attempt answers when the service throttles it. Clocks are fakes (tests/fakes.py): nothing sleeps."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from structlog.testing import capture_logs

from agents.breaker import BreakerPolicy, BreakerState
from agents.budget import BudgetPolicy
from agents.dependencies import DependencyRegistry, Tally
from agents.faults import PermanentError, TransientError, classify_status
from agents.http import http_handler
from agents.pace import Pace, PacePolicy
from agents.policy import DependencyPolicy, parse_policy
from agents.runtime import Agent, Call
from schemas.messages import AgentRequest
from tests.fakes import FakeClock, FakeTime

# ---- the AIMD limit --------------------------------------------------------------------------------------


def test_a_throttle_cuts_the_limit_multiplicatively_and_each_call_that_passes_raises_it_by_one() -> None:
    clock = FakeClock()
    pace = Pace(PacePolicy(initial_limit=10, decrease=0.5), clock=clock)
    started = [pace.try_start() for _ in range(10)]
    assert None not in started and pace.try_start() is None, "ten in flight: the eleventh waits"
    clock.advance(0.1)
    pace.finished(started[0], throttled=True, retry_after_s=2)
    assert pace.snapshot().limit == 5
    clock.advance(0.1)
    began = pace.try_start()
    assert began is None, "nine still in flight over a limit of five: no new call"
    for s in started[1:6]:
        pace.finished(s, passed=True)  # in flight 9..5, each at least half the limit: in use
    assert pace.snapshot().limit == 10


def test_throttles_of_calls_sent_before_a_cut_do_not_cut_again() -> None:
    clock = FakeClock()
    pace = Pace(PacePolicy(initial_limit=32, decrease=0.5), clock=clock)
    burst = [pace.try_start() for _ in range(20)]
    clock.advance(0.05)
    for began in burst:
        assert began is not None
        pace.finished(began, throttled=True)
    assert pace.snapshot().limit == 16, "one cut for the burst, not twenty (32 * 0.5 ** 20)"
    clock.advance(0.05)
    later = pace.try_start()
    assert later is not None
    clock.advance(0.05)
    pace.finished(later, throttled=True)
    assert pace.snapshot().limit == 8, "a call sent at the lowered pace and throttled again: the next cut"


def test_the_limit_stays_within_its_bounds_and_an_idle_limit_is_not_raised() -> None:
    clock = FakeClock()
    pace = Pace(PacePolicy(initial_limit=4, min_limit=2, max_limit=5, decrease=0.1), clock=clock)
    for _ in range(5):
        began = pace.try_start()
        assert began is not None
        clock.advance(1)
        pace.finished(began, throttled=True)
    assert pace.snapshot().limit == 2, "never below min_limit"
    for _ in range(3):
        calls = [pace.try_start() for _ in range(int(pace.snapshot().limit))]
        for began in calls:
            assert began is not None
            pace.finished(began, passed=True)
    assert pace.snapshot().limit == 5, "never above max_limit"
    pace.configure(PacePolicy(initial_limit=2, min_limit=1, max_limit=3))
    assert pace.snapshot().limit == 3, "a new policy clamps what was learned"
    idle = Pace(PacePolicy(initial_limit=10), clock=clock)
    began = idle.try_start()
    assert began is not None
    idle.finished(began, passed=True)
    assert idle.snapshot().limit == 10, "one call in flight of ten proves nothing about a higher limit"


def test_the_pace_remembers_until_when_the_service_asked_to_wait() -> None:
    clock = FakeClock()
    pace = Pace(clock=clock)
    began = pace.try_start()
    assert began is not None
    pace.finished(began, throttled=True, retry_after_s=2.0)
    clock.advance(0.5)
    state = pace.snapshot()
    assert state.retry_after_left_s == pytest.approx(1.5) and state.in_flight == 0


# ---- what the breaker records ----------------------------------------------------------------------------


@pytest.mark.parametrize(("fault", "verdict"), [
    (None, "success"),
    (PermanentError("422"), "success"),
    (classify_status(429), "ignored"),
    (classify_status(503, retry_after_s=2), "ignored"),
    (classify_status(503), "failure"),
    (TransientError("timed out", kind="timeout"), "failure"),
    (TransientError("refused", kind="connection"), "failure"),
])
def test_the_policy_says_what_the_breaker_records_and_a_throttle_is_not_a_failure(fault: Any, verdict: str) -> None:
    assert DependencyPolicy().verdict(fault) == verdict


def test_a_policy_file_may_make_the_breaker_count_throttles_too() -> None:
    policy = parse_policy({"dependencies": {"rails": {"breaker_records": ["throttled", "server_error"]}}})
    assert policy.for_dependency("rails").verdict(classify_status(429)) == "failure"
    assert policy.for_dependency("rails").verdict(TransientError("slow", kind="timeout")) == "ignored"
    assert policy.defaults.verdict(classify_status(429)) == "ignored"


def test_a_storm_of_throttles_never_opens_the_breaker_and_real_failures_do() -> None:
    clock = FakeClock()
    dependency = DependencyRegistry(clock).get("rails", DependencyPolicy(breaker=BreakerPolicy(failure_threshold=5)))
    for _ in range(500):
        began = dependency.pace.try_start()
        assert began is not None and dependency.breaker.try_acquire()
        clock.advance(0.01)
        dependency.record(began, classify_status(503, retry_after_s=2))
    assert dependency.breaker.state is BreakerState.CLOSED
    for _ in range(5):
        began = dependency.pace.try_start()
        assert began is not None and dependency.breaker.try_acquire()
        dependency.record(began, classify_status(503))
    state = dependency.snapshot()
    assert state.breaker is BreakerState.OPEN and state.calls["throttled"] == 500 and state.calls["failed"] == 5


# ---- the aggregated log ------------------------------------------------------------------------------


def test_calls_are_logged_as_one_line_per_dependency_per_interval_telling_throttles_from_failures() -> None:
    clock = FakeClock()
    tally = Tally("payments", clock, every_s=10)
    with capture_logs() as logs:
        for n in range(130):
            clock.advance(0.05)
            tally.count("throttled" if n < 120 else "failed" if n < 123 else "ok")
        clock.advance(10.5)
        tally.count("timed_out")
    first, line = logs
    assert first["event"] == "payments: 1 throttled, 0 failed, 0 timed out of 1 calls in the last 0 s", "at once"
    assert line["event"] == "payments: 119 throttled, 3 failed, 1 timed out of 130 calls in the last 17 s"
    assert (line["throttled"], line["failed"], line["timed_out"], line["ok"]) == (119, 3, 1, 7)
    with capture_logs() as quiet:
        clock.advance(11)
        tally.count("ok")
        tally.flush()
    assert quiet == [], "an interval of successes says nothing"
    with capture_logs() as last:
        tally.count("throttled")
        tally.count("throttled")
        tally.flush()
    assert [e["throttled"] for e in last] == [1, 1], "trouble after a quiet spell at once; the rest on stopping"


# ---- an attempt against a throttling service -------------------------------------------------------------


def request(*, deadline_s: float = 10.0, clock: FakeTime, wall: datetime | None = None) -> AgentRequest:
    """A request due ``deadline_s`` from now on ``clock`` (or from ``wall``, for an agent on the real clock)."""
    task_id = f"t-{uuid.uuid4().hex[:8]}"
    return AgentRequest(task_id=task_id, step="pay", attempt=1, attempt_id=f"{task_id}:pay:1",
                        idempotency_key=f"{task_id}:pay", calls_allowed=3, input={},
                        complete_by=(wall or clock.wall()) + timedelta(seconds=deadline_s))


GUARDED = DependencyPolicy(breaker=BreakerPolicy(failure_threshold=1, failure_rate=0.01),
                          budget=BudgetPolicy(retries_per_window=0, ratio=0))
"""A breaker that opens on one failure and a budget of no retries: a throttle counted by either shows."""


def scripted(clock: FakeTime, answers: list[Exception | None], policy: DependencyPolicy = GUARDED,
             sleep: Callable[[float], bool] | None = None) -> Agent:
    def handler(call: Call) -> dict[str, Any]:
        clock.advance(0.01)
        answer = answers.pop(0)
        if answer is not None:
            raise answer
        return {"paid": True}

    return Agent("payout", handler, policy, sleep=sleep or clock.sleep, monotonic=clock.monotonic, now=clock.wall,
                 dependencies=DependencyRegistry(clock))


def test_short_throttles_are_waited_out_in_the_attempt_without_the_breaker_or_the_retry_budget() -> None:
    clock = FakeTime()
    agent = scripted(clock, [classify_status(429, retry_after_s=0.5), classify_status(503, retry_after_s=1), None])
    result = agent.execute(request(clock=clock))
    assert result.ok and result.calls == 3, "a breaker opening on one failure, a budget of no retries: untouched"
    assert clock.now >= 1.5, "each call waited at least what the service asked"
    (state,) = agent.dependencies.snapshots()
    assert state.breaker is BreakerState.CLOSED and state.calls == {"ok": 1, "throttled": 2, "failed": 0,
                                                                     "timed_out": 0, "rejected": 0}
    assert state.pace_limit < 32, "the throttles lowered the pace"


def test_a_long_throttle_ends_the_attempt_as_a_throttle_carrying_the_wait_for_the_scheduler() -> None:
    clock = FakeTime()
    agent = scripted(clock, [classify_status(503, retry_after_s=2)])
    result = agent.execute(request(clock=clock))
    assert not result.ok and result.calls == 1 and result.throttled and not result.deferred
    assert result.retry_after_s is not None and 2.0 <= result.retry_after_s <= 2.4
    assert clock.now < 0.1, "no sleeping in the attempt: the slot is free for other tasks"


def test_an_attempt_the_pace_keeps_from_calling_until_its_deadline_is_a_throttle_without_a_call() -> None:
    clock = FakeTime()
    policy = DependencyPolicy(pace=PacePolicy(initial_limit=1, max_limit=1))
    agent = scripted(clock, [None], policy)
    held = agent.dependencies.get(agent.dependency, policy).pace.try_start()
    assert held is not None, "another attempt's call is in flight"
    result = agent.execute(request(clock=clock, deadline_s=0.5))
    assert not result.ok and result.calls == 0 and result.throttled and result.retry_after_s == 1.0


def test_a_failed_call_then_paced_out_stays_a_failure_of_the_step() -> None:
    clock = FakeTime()
    policy = DependencyPolicy(pace=PacePolicy(initial_limit=1, max_limit=1))
    held: list[float | None] = []

    def sleep(seconds: float) -> bool:
        if not held:
            held.append(pace.try_start())  # another attempt's call takes the only slot during the back-off
        return clock.sleep(seconds)

    agent = scripted(clock, [classify_status(503), None], policy, sleep)
    pace = agent.dependencies.get(agent.dependency, policy).pace
    result = agent.execute(request(clock=clock, deadline_s=1.0))
    assert held != [None] and result.calls == 1 and not result.ok
    assert result.error_kind == "server_error" and not result.throttled, "the pace does not disguise the 503"


# ---- a keep-alive connection the service closed ----------------------------------------------------------


class ClosesReusedConnections(BaseHTTPRequestHandler):
    """Answers the first request of each connection and keeps it alive; drops the connection, unanswered,
    when a second request comes on it (a server whose idle timeout ran out as the client reused it)."""

    protocol_version = "HTTP/1.1"
    requests: list[str] = []  # noqa: RUF012 (one server per test module, read after it stops)

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        reused = getattr(self, "_answered", False)
        self.requests.append("dropped" if reused else "answered")
        if reused:
            self.close_connection = True
            return
        self._answered = True
        body = b'{"paid": true}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_a_request_dying_on_a_reused_keep_alive_connection_is_sent_again_at_once_and_is_not_a_failure() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), ClosesReusedConnections)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with httpx.Client() as client:
            handler = http_handler(f"http://127.0.0.1:{server.server_port}", "pay", client)
            agent = Agent("payout", handler, DependencyPolicy(), dependencies=DependencyRegistry())
            first, second = (agent.execute(request(clock=FakeTime(), wall=datetime.now(UTC))) for _ in range(2))
    finally:
        server.shutdown()
        server.server_close()
    assert first.ok and second.ok and second.calls == 1, "one call, sent twice on the wire"
    assert ClosesReusedConnections.requests == ["answered", "dropped", "answered"]
    (state,) = agent.dependencies.snapshots()
    assert state.calls["failed"] == 0 and state.breaker is BreakerState.CLOSED
