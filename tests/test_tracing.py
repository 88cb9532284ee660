"""One trace per task, linked across processes: the parents each process names, checked with the SDK's
in-memory exporter (the end-to-end run over real processes is in ``tests/test_traces_end_to_end.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any, cast

import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from agents.breaker import BreakerPolicy
from agents.http import http_handler
from agents.policy import DependencyPolicy
from agents.runtime import Agent
from eventstore.producer import EventProducer
from eventstore.runtime import Record
from eventstore.tracing import (
    TRACEPARENT,
    attempt_span,
    headers_of,
    install_tracing,
    parent_of,
    task_root,
    task_trace_id,
)
from scheduler.decider import evolve
from scheduler.traces import record_spans
from schemas.messages import Message, StepStarted, StepSucceeded, TaskAccepted
from tests.fakes import EPOCH, FakeTime
from tests.test_agent_acknowledgement import queued_request

_EXPORTER = InMemorySpanExporter()
install_tracing("tests", SimpleSpanProcessor(_EXPORTER))


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    _EXPORTER.clear()
    yield _EXPORTER
    _EXPORTER.clear()


class Sent:
    """The producer the runtime hands the agent: keeps each message with its headers."""

    def __init__(self) -> None:
        self.messages: list[tuple[Message, list[tuple[str, bytes]]]] = []

    def send(self, _topic: str, message: Message, *, headers: list[tuple[str, bytes]] | None = None,
             **_: Any) -> None:
        self.messages.append((message, headers or []))


def traceparent(span: ReadableSpan) -> str:
    context = span.get_span_context()
    assert context is not None
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-01"


def test_an_agent_continues_the_attempt_span_and_hands_each_call_span_to_the_service(
    spans: InMemorySpanExporter,
) -> None:
    request = queued_request(waited_s=0)
    seen: list[httpx.Request] = []
    client = httpx.Client(transport=httpx.MockTransport(
        lambda r: seen.append(r) or httpx.Response(200, json={"done": True})))
    clock = FakeTime()
    agent = Agent("payments", http_handler("http://orders", "payments/charge", client),
                  DependencyPolicy(breaker=BreakerPolicy(enabled=False)), sleep=clock.sleep,
                  monotonic=clock.monotonic, now=clock.wall)
    sent = Sent()
    headers = headers_of(attempt_span("t", "t:s:1"))
    agent.handle(Record("agent.payments", 0, 3, "t", request, headers), cast(EventProducer, sent), "inbox")

    by_name = {s.name: s for s in spans.get_finished_spans()}
    agent_span, call_span = by_name["agent payments"], by_name["call payments"]
    assert {s.context.trace_id for s in (agent_span, call_span) if s.context} == {task_trace_id("t")}
    assert agent_span.parent is not None and agent_span.parent.span_id == attempt_span("t", "t:s:1").span_id
    assert agent_span.kind is SpanKind.CONSUMER and call_span.kind is SpanKind.CLIENT
    assert call_span.parent is not None and agent_span.context is not None
    assert call_span.parent.span_id == agent_span.context.span_id
    assert seen[0].headers[TRACEPARENT] == traceparent(call_span), "the service continues the call's span"
    assert [dict(h)[TRACEPARENT].decode() for _m, h in sent.messages] == [traceparent(agent_span)] * 2, \
        "the acknowledgement and the answer carry the agent's span back to the scheduler"


def test_a_header_from_another_trace_or_none_at_all_hangs_the_span_from_the_tasks_root() -> None:
    def parent_id(headers: Any) -> int:
        from opentelemetry import trace

        return trace.get_current_span(parent_of("t", headers)).get_span_context().span_id

    own = attempt_span("t", "t:s:1")
    assert parent_id(headers_of(own)) == own.span_id
    assert parent_id(headers_of(attempt_span("other-task", "other-task:s:1"))) == task_root("t").span_id
    assert parent_id(None) == task_root("t").span_id
    assert parent_id({"traceparent": "not a traceparent"}) == task_root("t").span_id


def test_the_scheduler_records_the_root_and_each_attempt_under_the_ids_every_process_derives(
    spans: InMemorySpanExporter,
) -> None:
    common: dict[str, Any] = {"task_id": "t", "workflow": "orders", "workflow_version": 1, "causation_id": "c"}
    accepted = TaskAccepted(**common, sequence=1, input={}, input_digest="d", occurred_at=EPOCH)
    started = StepStarted(**common, sequence=2, step="charge", step_index=0, attempt=1, attempt_id="t:charge:1",
                          calls_allowed=1, occurred_at=EPOCH + timedelta(seconds=1),
                          complete_by=EPOCH + timedelta(seconds=30))
    succeeded = StepSucceeded(**common, sequence=3, step="charge", attempt_id="t:charge:1", output={}, calls=1,
                              occurred_at=EPOCH + timedelta(seconds=3))
    before = evolve(evolve(None, accepted), started)
    record_spans(accepted, None, now=EPOCH)
    record_spans(started, evolve(None, accepted))
    record_spans(succeeded, before, now=EPOCH + timedelta(seconds=3))

    root, attempt = spans.get_finished_spans()
    assert root.name == "task orders" and root.parent is None and root.context is not None
    assert (root.context.trace_id, root.context.span_id) == (task_trace_id("t"), task_root("t").span_id)
    assert attempt.name == "attempt charge#1" and attempt.context is not None and attempt.parent is not None
    assert attempt.context.span_id == attempt_span("t", "t:charge:1").span_id
    assert attempt.parent.span_id == root.context.span_id
    assert attempt.end_time is not None and attempt.start_time is not None
    assert (attempt.end_time - attempt.start_time) / 1e9 == pytest.approx(2.0), "from hand-over to answer"
