"""``Client.wait``'s answer: a finished task's store row, typed; a row of an unfinished task is no result.
Against a live system: tests/test_submission.py and tests/test_sensitive_end_to_end.py."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from schemas.states import StepStatus, TaskStatus
from stepstream.client import StepSummary, TaskResult


def row(status: str, **changes: Any) -> dict[str, Any]:
    """A task as ``Store.task`` reads it: its columns, and its steps as rows in workflow order."""
    steps = [{"task_id": "t", "step": "reserve", "step_index": 0, "status": "compensated", "attempt": 1,
              "failure_count": 0, "calls_used": 1, "error": None, "updated_at": 1},
             {"task_id": "t", "step": "charge", "step_index": 1, "status": "failed", "attempt": 2,
              "failure_count": 2, "calls_used": 3, "error": "refused with 422: card [sealed] is blocked",
              "updated_at": 2}]
    return {"task_id": "t", "workflow": "orders", "workflow_version": 3, "status": status, "sequence": 9,
            "error": "step charge failed", "updated_at": 1_700_000_000_000, "steps": steps, **changes}


def test_a_finished_task_reads_as_its_state_its_error_and_each_step() -> None:
    result = TaskResult.of(row("compensated"))
    assert result.status is TaskStatus.COMPENSATED and not result.completed
    assert (result.task_id, result.workflow, result.workflow_version) == ("t", "orders", 3)
    assert result.error == "step charge failed"
    assert result.updated_at == datetime(2023, 11, 14, 22, 13, 20, tzinfo=UTC)
    assert [step.name for step in result.steps] == ["reserve", "charge"]
    assert result.step("charge") == StepSummary(name="charge", status=StepStatus.FAILED, attempt=2, failure_count=2,
                                                calls_used=3, error="refused with 422: card [sealed] is blocked")
    assert result.row["sequence"] == 9, "the store's row, whole, for printing"
    assert TaskResult.of(row("completed", error=None)).completed


def test_asking_for_a_step_the_task_does_not_have_names_the_steps_it_has() -> None:
    with pytest.raises(KeyError, match=r"no step 'ship' \(steps: reserve, charge\)"):
        TaskResult.of(row("completed")).step("ship")


def test_a_task_still_running_is_not_a_result() -> None:
    with pytest.raises(ValueError, match="task t is running, not finished"):
        TaskResult.of(row("running"))
