"""The projection of waiting: a step waiting for its timer is ``waiting`` in the store, with when and why,
and so is its task (a forward wait); an undo's wait leaves the task ``compensating``."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from eventstore.topics import TopicLayout
from projections.rows import ms
from projections.store import SqliteStore
from scheduler.decider import Command, TaskState, pending
from schemas.messages import OperatorCommand, SubmitTask
from stepstream.http.app import create_app
from tests.test_decider_timers import NOW, failure, run

SUBMIT = SubmitTask(task_id="t", workflow="flow", input={})

TOPIC = "events"


class Projected:
    """Decides commands of one task with the timer tests' workflow and projects every event, as the projector."""

    def __init__(self, store: SqliteStore) -> None:
        self.store = store
        self.offset = 0
        self.state: TaskState | None = None

    def __call__(self, command: Command, at: timedelta = timedelta(0)) -> TaskState:
        self.state, events = run(self.state, command, NOW + at)
        for event in events:
            assert self.store.apply(TOPIC, 0, self.offset, event)
            self.offset += 1
        return self.state

    def task(self) -> dict[str, Any]:
        task = self.store.task("t")
        assert task is not None
        return task

    def step(self) -> dict[str, Any]:
        step: dict[str, Any] = self.task()["steps"][0]
        return step


@pytest.fixture
def projected(tmp_path: Path) -> Iterator[Projected]:
    store = SqliteStore(tmp_path / "state.db")
    try:
        yield Projected(store)
    finally:
        store.close()


def test_a_step_waiting_for_its_timer_is_waiting_with_retry_at_and_reason_until_its_attempt_starts(
        projected: Projected) -> None:
    state = projected(failure(projected(SUBMIT), retry_after_s=12))
    task = projected.task()
    retry_at = ms(NOW + timedelta(seconds=12))
    assert (task["status"], task["retry_at"], task["current_step"]) == ("waiting", retry_at, None)
    assert "back-off after 1 failed attempt" in task["wait_reason"]
    step = projected.step()
    assert (step["status"], step["retry_at"], step["wait_reason"]) == ("waiting", retry_at, task["wait_reason"])
    assert [row["task_id"] for row in projected.store.waiting_steps()] == ["t"]
    assert [row["task_id"] for row in projected.store.tasks(state="waiting")] == ["t"]

    due = pending(state)
    assert due is not None
    projected(due, timedelta(seconds=12))
    task = projected.task()
    assert (task["status"], task["retry_at"], task["wait_reason"]) == ("running", None, None)
    assert projected.step()["status"] == "queued" and projected.store.waiting_steps() == []


def test_try_now_moves_the_retry_to_now_and_a_cancel_ends_the_wait(projected: Projected) -> None:
    projected(failure(projected(SUBMIT), retry_after_s=60))
    state = projected(OperatorCommand(task_id="t", command_id="c1", action="try-now"), timedelta(seconds=5))
    assert projected.task()["status"] == "running" and projected.step()["retry_at"] is None
    history = [row["event_type"] for row in projected.store.history("t")]
    assert history[-2:] == ["RetryBroughtForward", "StepStarted"]

    projected(failure(state), timedelta(seconds=6))
    assert projected.task()["status"] == "waiting"
    projected(OperatorCommand(task_id="t", command_id="c2", action="cancel"), timedelta(seconds=7))
    task, step = projected.task(), projected.step()
    assert (task["status"], task["retry_at"]) == ("compensating", None)
    assert (step["status"], step["retry_at"]) == ("compensation_queued", None), "the waiting step is undone"


def test_the_api_lists_waiting_steps_and_waiting_tasks_with_when_and_why(projected: Projected) -> None:
    projected(failure(projected(SUBMIT), retry_after_s=12))
    client = TestClient(create_app(projected.store, TopicLayout(prefix="t.", partitions=1)))
    [item] = client.get("/api/steps/waiting").json()["items"]
    assert (item["task_id"], item["step"], item["status"], item["retry_at"]) == (
        "t", "pay", "waiting", ms(NOW + timedelta(seconds=12)))
    assert item["wait_reason"].startswith("back-off after 1 failed attempt") and item["retry_in_ms"] < 0, \
        "its time (in 2025) has passed: due, about to be fired"
    [task] = client.get("/api/tasks?state=waiting").json()["items"]
    assert (task["task_id"], task["retry_at"]) == ("t", item["retry_at"])
