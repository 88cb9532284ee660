"""The projection of compensation: what dashboards and the supervisor read about undone and undoing steps."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from projections.rows import ms
from projections.store import SqliteStore
from scheduler.decider import Command, TaskState
from schemas.messages import Event, OperatorCommand
from tests.test_decider import NOW, accept, failure, ok, recover, submit
from tests.test_decider_compensation import run

TOPIC = "events"


class Projected:
    """Decides commands for tasks and projects every event into a real store, as the projector would."""

    def __init__(self, store: SqliteStore) -> None:
        self.store = store
        self.offset = 0
        self.states: dict[str, TaskState] = {}

    def __call__(self, command: Command, now: timedelta = timedelta(0)) -> TaskState:
        decision, after = run(command, self.states.get(command.task_id), now=NOW + now)
        assert after is not None
        for event in decision.events:
            self.project(event)
        self.states[command.task_id] = after
        return after

    def project(self, event: Event) -> None:
        assert self.store.apply(TOPIC, 0, self.offset, event)
        self.offset += 1

    def time_out(self, state: TaskState, taken: timedelta, at: timedelta) -> TaskState:
        """The attempt in progress is taken by its agent at ``taken`` and recovered, expired, at ``at``."""
        state = self(accept(state, NOW + taken), taken)
        return self(recover(state), at)

    def through_last_step(self, task_id: str, workflow: str = "saga") -> TaskState:
        state = self(submit(task_id, workflow=workflow))
        for _ in range(3):
            state = self(ok(state))
        return state


@pytest.fixture
def projected(tmp_path: Path) -> Iterator[Projected]:
    store = SqliteStore(tmp_path / "state.db")
    try:
        yield Projected(store)
    finally:
        store.close()


def test_a_compensating_step_shows_its_compensation_queued_then_its_lock_and_deadline_and_the_supervisor_scan_finds_it(
    projected: Projected,
) -> None:
    state = projected.through_last_step("t1")
    state = projected(failure(state, permanent=True))
    task = projected.store.task("t1")
    assert task is not None and task["status"] == "compensating"
    assert task["current_step"] == "ship" and task["error"].startswith("ship: permanent failure")
    steps = {s["step"]: s for s in task["steps"]}
    ship = steps["ship"]
    start_by = ms(NOW + timedelta(seconds=300))
    assert (ship["status"], ship["attempt_id"], ship["complete_by"], ship["start_by"],
            ship["compensation_attempt"]) == ("compensation_queued", "t1:ship:undo:1", start_by, start_by, 1), \
        "the failed step is undone first"
    assert (ship["attempt"], ship["calls_used"]) == (1, 1), "the forward attempt's record is kept"
    assert steps["charge"]["status"] == "succeeded"
    window = NOW - timedelta(days=1)
    assert projected.store.expired_steps(NOW + timedelta(seconds=299), not_before=window) == []
    assert [s["step"] for s in projected.store.queued_steps()] == ["ship"]
    projected(accept(state, NOW + timedelta(seconds=2)), timedelta(seconds=2))
    ship = next(s for s in (projected.store.task("t1") or {})["steps"] if s["step"] == "ship")
    assert (ship["status"], ship["complete_by"], ship["accepted_at"], ship["waited_ms"]) == (
        "compensating", ms(NOW + timedelta(seconds=7)), ms(NOW + timedelta(seconds=2)), 2000)
    assert projected.store.queued_steps() == []
    assert projected.store.expired_steps(NOW + timedelta(seconds=6), not_before=window) == []
    (expired,) = projected.store.expired_steps(NOW + timedelta(seconds=7), not_before=window)
    assert (expired.task_id, expired.step, expired.attempt_id) == ("t1", "ship", "t1:ship:undo:1")


def test_the_expired_step_scan_is_one_index_range_over_queued_processing_and_compensating_steps(
    projected: Projected,
) -> None:
    forward = projected(submit("t1", workflow="saga"))  # queued: its deadline is its start-by, 300 s away
    undoing = projected.through_last_step("t2")
    undoing = projected(failure(undoing, permanent=True))
    projected(accept(undoing))  # running: its deadline is 5 s away
    found = projected.store.expired_steps(NOW + timedelta(hours=1), not_before=NOW - timedelta(days=1), limit=1)
    assert [(e.task_id, e.attempt_id) for e in found] == [("t2", "t2:ship:undo:1")], "oldest deadline first"
    rest = projected.store.expired_steps(NOW + timedelta(hours=1), not_before=NOW - timedelta(days=1),
                                         after=(found[0].complete_by_ms, found[0].task_id, found[0].step))
    assert [(e.task_id, e.attempt_id) for e in rest] == [("t1", forward.steps[0].attempt_id)]
    projected.store.analyze()  # with statistics, as a store that has run a while has them
    plan = projected.store.expired_steps_plan(NOW, not_before=NOW - timedelta(days=1))
    assert "steps_leased" in plan and "TEMP B-TREE" not in plan, plan


def test_dashboards_tell_error_compensating_compensated_and_compensation_failed_apart(projected: Projected) -> None:
    held = projected.through_last_step("in-error", "held")
    projected(failure(held, permanent=True))
    undoing = projected.through_last_step("compensating")
    projected(failure(undoing, permanent=True))
    done = projected.through_last_step("compensated")
    done = projected(failure(done, permanent=True))
    for _ in range(2):
        done = projected(ok(done))
    projected(ok(done))
    stuck = projected.through_last_step("compensation-failed")
    stuck = projected(failure(stuck, permanent=True))
    stuck = projected.time_out(stuck, timedelta(0), timedelta(seconds=6))
    projected.time_out(stuck, timedelta(seconds=6), timedelta(seconds=12))
    assert projected.store.counts_by_status() == {
        "error": 1, "compensating": 1, "compensated": 1, "compensation_failed": 1}
    failed = projected.store.task("compensation-failed")
    assert failed is not None and failed["error"].startswith("ship: failure threshold reached")
    ship = next(s for s in failed["steps"] if s["step"] == "ship")
    assert (ship["status"], ship["compensation_failure_count"], ship["compensation_calls_used"]) == (
        "compensation_failed", 2, 3)
    assert "timed out" in ship["compensation_error"]
    alerts = [a for a in projected.store.alerts() if a["task_id"] == "compensation-failed"]
    assert [a["step"] for a in alerts] == ["ship"]
    compensated = projected.store.task("compensated")
    assert compensated is not None
    assert [s["status"] for s in compensated["steps"]] == [
        "compensated", "compensation_skipped", "compensated", "compensated"]


def test_operator_commands_show_in_the_projection_and_a_refusal_changes_no_row(projected: Projected) -> None:
    held = projected.through_last_step("t1", "held")
    projected(failure(held, permanent=True))
    before = projected.store.task("t1")
    projected(OperatorCommand(task_id="t1", command_id="c1", action="cancel"))
    assert {k: v for k, v in (projected.store.task("t1") or {}).items() if k not in ("sequence", "updated_at")} == {
        k: v for k, v in (before or {}).items() if k not in ("sequence", "updated_at")}
    assert projected.store.history("t1")[-1]["event_type"] == "OperatorCommandRefused"
    projected(OperatorCommand(task_id="t1", command_id="c2", action="resubmit"))
    task = projected.store.task("t1")
    assert task is not None and task["status"] == "running" and task["error"] is None
    ship = next(s for s in task["steps"] if s["step"] == "ship")
    assert (ship["status"], ship["attempt"], ship["failure_count"], ship["calls_used"]) == ("queued", 2, 0, 0)


def test_after_a_successful_retry_of_compensation_the_task_headlines_why_it_was_undone(
    projected: Projected,
) -> None:
    stuck = projected.through_last_step("retried")
    stuck = projected(failure(stuck, permanent=True))
    cause = (projected.store.task("retried") or {})["error"]
    stuck = projected.time_out(stuck, timedelta(0), timedelta(seconds=6))
    stuck = projected.time_out(stuck, timedelta(seconds=6), timedelta(seconds=12))
    assert (projected.store.task("retried") or {})["error"].startswith("ship: failure threshold reached")
    state = projected(OperatorCommand(task_id="retried", command_id="again", action="retry-compensation"),
                      timedelta(seconds=13))
    assert (projected.store.task("retried") or {})["error"] == cause
    for _ in range(5):
        if state.status == "compensated":
            break
        state = projected(ok(state), timedelta(seconds=14))
    task = projected.store.task("retried")
    assert task is not None and (task["status"], task["error"]) == ("compensated", cause)
    assert cause and cause.startswith("ship: ")
