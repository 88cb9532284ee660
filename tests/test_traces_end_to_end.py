"""A task's trace over real processes: the scheduler, each agent and the order service each export their
spans (``OTEL_TRACES_EXPORTER=console`` into a folder), and the spans of one task form one tree: the
task's root, a span per attempt (forward and undo), under it the agent that took it, under that each
call, and under each call the service's own span, linked across processes by ``traceparent``."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from eventstore.tracing import attempt_span, task_root, task_trace_id
from schemas.messages import StepCompensationStarted, StepStarted
from tests.kafka_helpers import wait_for
from tests.system import System
from tests.test_compensation_end_to_end import one_done_one_undone, saga

__all__ = ["saga"]

pytestmark = pytest.mark.kafka

Span = dict[str, Any]


@pytest.fixture
def test_env(test_env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    """Every process of the system (the order service too) writes its spans to a file of its own."""
    return {**test_env, "OTEL_TRACES_EXPORTER": "console", "STEPSTREAM_TRACES_DIR": str(tmp_path / "traces")}


def spans_of(folder: Path, task_id: str) -> list[Span]:
    trace_id = f"0x{task_trace_id(task_id):032x}"
    spans = [json.loads(line) for path in folder.glob("*.jsonl") for line in path.read_text().splitlines() if line]
    return [s for s in spans if s["context"]["trace_id"] == trace_id]


def hex_id(span_id: int) -> str:
    return f"0x{span_id:016x}"


def tree_problems(task_id: str, spans: list[Span], attempt_ids: list[str]) -> list[str]:
    """What keeps ``spans`` from being the task's whole tree (empty when it is one)."""
    by_id = {s["context"]["span_id"]: s for s in spans}
    service_of: Callable[[Span], str] = lambda s: s["resource"]["attributes"]["service.name"]  # noqa: E731
    problems = []
    root = by_id.get(hex_id(task_root(task_id).span_id))
    if root is None or root["parent_id"] is not None:
        problems.append("no root span")
    for attempt_id in attempt_ids:
        attempt = by_id.get(hex_id(attempt_span(task_id, attempt_id).span_id))
        if attempt is None or attempt["parent_id"] != hex_id(task_root(task_id).span_id):
            problems.append(f"no span for attempt {attempt_id} under the root")
        agents = [s for s in spans if s["name"].startswith("agent ")
                  and s["parent_id"] == hex_id(attempt_span(task_id, attempt_id).span_id)]
        if not agents:
            problems.append(f"no agent span under attempt {attempt_id}")
        for agent in agents:
            calls = [s for s in spans if s["parent_id"] == agent["context"]["span_id"] and s["name"].startswith("call")]
            if not calls:
                problems.append(f"no call span under {agent['name']} of {attempt_id}")
            for call in calls:
                served = [s for s in spans if s["parent_id"] == call["context"]["span_id"]]
                if [service_of(s) for s in served] != ["orders-service"] or service_of(call) == "orders-service":
                    problems.append(f"call of {attempt_id} not continued by the order service alone: "
                                    f"{[(s['name'], service_of(s)) for s in served]}")
    return problems


def assert_one_tree(folder: Path, task_id: str, attempt_ids: list[str]) -> None:
    """Within the exporters' flush interval, the task's spans form its whole tree."""
    assert wait_for(lambda: not tree_problems(task_id, spans_of(folder, task_id), attempt_ids), timeout_s=30), \
        tree_problems(task_id, spans_of(folder, task_id), attempt_ids)


def test_a_tasks_spans_form_one_tree_across_the_scheduler_agents_and_service(saga: System, tmp_path: Path) -> None:
    one_done_one_undone(saga, "traced-done", "traced-undone")

    folder = tmp_path / "traces"
    for task_id in ("traced-done", "traced-undone"):
        attempts = [e.attempt_id for e in saga.events(task_id) if isinstance(e, StepStarted | StepCompensationStarted)]
        assert_one_tree(folder, task_id, attempts)
        spans = spans_of(folder, task_id)
        services = {s["resource"]["attributes"]["service.name"] for s in spans}
        assert {"scheduler", "orders-service"} <= services and len(services) >= 4, services
    undos = [s["name"] for s in spans_of(folder, "traced-undone") if s["name"].startswith("undo ")]
    assert sorted(undos) == ["undo charge#1", "undo reserve#1", "undo ship#1"]
