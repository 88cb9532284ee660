"""The agent's side of "a deadline measures work, not wait": it acknowledges the request it takes, counts
the attempt's deadline from that moment, and answers a request taken after its start-by without a call."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, cast

from agents.breaker import BreakerPolicy
from agents.policy import DependencyPolicy
from agents.runtime import Agent, Call
from eventstore.producer import EventProducer
from eventstore.runtime import Record
from schemas.messages import AgentRequest, AttemptAccepted, Message, StepResult
from tests.fakes import EPOCH, FakeTime


class Sent:
    """Stands in for the producer the keyed runtime hands the handler: keeps what was sent, in order."""

    def __init__(self) -> None:
        self.messages: list[tuple[str, Message]] = []

    def send(self, topic: str, message: Message, **_: Any) -> None:
        self.messages.append((topic, message))


def queued_request(waited_s: float, timeout_s: float = 5.0, queue_s: float = 300.0,
                   compensation: bool = False) -> AgentRequest:
    """A request handed over ``waited_s`` before the agent's clock reaches it (the clock is at ``waited_s``)."""
    start_by = EPOCH + timedelta(seconds=queue_s)
    return AgentRequest(task_id="t", step="s", attempt=1, attempt_id="t:s:1", idempotency_key="t:s",
                        occurred_at=EPOCH, start_by=start_by, timeout_s=timeout_s,
                        complete_by=start_by + timedelta(seconds=timeout_s), calls_allowed=3, input={},
                        compensation=compensation)


def take(request: AgentRequest, clock: FakeTime, handler: Any) -> list[tuple[str, Message]]:
    agent = Agent("acks", handler, DependencyPolicy(breaker=BreakerPolicy(enabled=False)), sleep=clock.sleep,
                  monotonic=clock.monotonic, now=clock.wall)
    sent = Sent()
    agent.handle(Record("agent.acks", 0, 7, "t", request, []), cast(EventProducer, sent), "inbox")
    return sent.messages


def test_a_request_taken_after_a_long_wait_is_acknowledged_first_and_its_calls_get_the_whole_timeout() -> None:
    clock = FakeTime()
    clock.now = 120.0  # it waited two minutes behind other requests: far longer than the step's 5 s timeout
    timeouts: list[float] = []

    def handler(call: Call) -> dict[str, Any]:
        timeouts.append(call.timeout_s)
        clock.now += 0.05
        return {"done": True}

    messages = take(queued_request(waited_s=120), clock, handler)
    assert [topic for topic, _ in messages] == ["inbox", "inbox"]
    ack, result = (message for _, message in messages)
    assert isinstance(ack, AttemptAccepted) and isinstance(result, StepResult)
    assert (ack.attempt_id, ack.step, ack.compensation, ack.accepted_at) == (
        "t:s:1", "s", False, EPOCH + timedelta(seconds=120))
    assert result.ok and result.calls == 1
    assert timeouts and timeouts[0] > 4.9, "the call may use the step's timeout from acceptance, not what is left of it"


def test_the_work_deadline_runs_from_acceptance_and_never_past_the_requests_latest_end() -> None:
    request = queued_request(waited_s=0, timeout_s=5, queue_s=300)
    assert request.work_deadline(EPOCH + timedelta(seconds=10)) == EPOCH + timedelta(seconds=15)
    assert request.work_deadline(EPOCH + timedelta(seconds=299)) == EPOCH + timedelta(seconds=304)
    assert request.work_deadline(EPOCH + timedelta(seconds=400)) == request.complete_by
    legacy = request.model_copy(update={"start_by": None, "timeout_s": None})
    assert legacy.work_deadline(EPOCH + timedelta(seconds=10)) == request.complete_by, \
        "a request without a start-by keeps its absolute deadline"


def test_a_request_taken_after_its_start_by_is_answered_at_once_without_a_call_or_an_acknowledgement() -> None:
    clock = FakeTime()
    clock.now = 301.0
    calls: list[Call] = []

    def handler(call: Call) -> dict[str, Any]:
        calls.append(call)
        return {}

    messages = take(queued_request(waited_s=301), clock, handler)
    assert calls == []
    [(topic, result)] = messages
    assert topic == "inbox" and isinstance(result, StepResult)
    assert (result.ok, result.permanent, result.calls) == (False, False, 0)
    assert result.error is not None and "not started" in result.error and "start-by" in result.error


def test_a_compensation_request_is_acknowledged_as_one() -> None:
    clock = FakeTime()
    messages = take(queued_request(waited_s=0, compensation=True), clock, lambda call: {})
    ack = messages[0][1]
    assert isinstance(ack, AttemptAccepted) and ack.compensation


def test_a_request_without_a_start_by_is_run_against_its_deadline_without_an_acknowledgement() -> None:
    clock = FakeTime()
    legacy = queued_request(waited_s=0).model_copy(update={"start_by": None, "timeout_s": None})
    messages = take(legacy, clock, lambda call: {"ok": True})
    assert [type(message) for _, message in messages] == [StepResult]


def test_an_undo_with_a_not_before_waits_until_then_before_acknowledging_and_calling() -> None:
    clock = FakeTime()
    clock.now = 10.0
    called_at: list[float] = []

    def handler(call: Call) -> dict[str, Any]:
        called_at.append(clock.now)
        return {"refunded": True}

    request = queued_request(waited_s=10, compensation=True).model_copy(
        update={"not_before": EPOCH + timedelta(seconds=14)})
    messages = take(request, clock, handler)
    ack, result = (message for _, message in messages)
    assert isinstance(ack, AttemptAccepted) and ack.accepted_at == EPOCH + timedelta(seconds=14), \
        "taken once the forward call can no longer land"
    assert called_at == [14.0] and isinstance(result, StepResult) and result.ok
