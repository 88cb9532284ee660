"""What ``Client.wait`` returns: a finished task as the state store shows it, typed.

A submitter waiting for a task wants to branch on how it ended (``completed``, or ``compensated`` after a
refusal, or ``compensation_failed`` for an operator) and say why; a dict of store columns made every caller
know the column names and compare strings. :class:`TaskResult` names them once, with the states as the
enums of :mod:`schemas.states`, and keeps the store's row for whoever prints it whole (``stepstream submit
--wait --json``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from schemas.states import TERMINAL, StepStatus, TaskStatus

__all__ = ["StepSummary", "TaskResult"]


def _time(millis: int | None) -> datetime | None:
    return None if millis is None else datetime.fromtimestamp(millis / 1000, UTC)


@dataclass(frozen=True)
class StepSummary:
    """One step of a finished task: where it ended, after how many attempts, failures and calls, and why
    it failed if it did (the last error its agent answered)."""

    name: str
    status: StepStatus
    attempt: int
    failure_count: int
    calls_used: int
    error: str | None

    @classmethod
    def of(cls, row: Mapping[str, Any]) -> StepSummary:
        return cls(name=row["step"], status=StepStatus(row["status"]), attempt=int(row["attempt"]),
                   failure_count=int(row["failure_count"]), calls_used=int(row.get("calls_used") or 0),
                   error=row.get("error"))


@dataclass(frozen=True)
class TaskResult:
    """A task in a terminal state (``status`` is one of :data:`schemas.states.TERMINAL`), its steps in
    workflow order, and the error that ended it, if any."""

    task_id: str
    workflow: str
    workflow_version: int
    status: TaskStatus
    error: str | None
    steps: tuple[StepSummary, ...]
    updated_at: datetime | None
    row: Mapping[str, Any] = field(repr=False, compare=False)
    """The state store's row as it was read (every column, the steps as rows): for printing it whole."""

    @classmethod
    def of(cls, row: Mapping[str, Any]) -> TaskResult:
        """The result of a task row of the store (``Store.task``); ValueError if the task has not ended."""
        status = TaskStatus(row["status"])
        if status not in TERMINAL:
            raise ValueError(f"task {row['task_id']} is {status}, not finished")
        return cls(task_id=row["task_id"], workflow=row["workflow"], workflow_version=int(row["workflow_version"]),
                   status=status, error=row.get("error"),
                   steps=tuple(StepSummary.of(step) for step in row.get("steps") or ()),
                   updated_at=_time(row.get("updated_at")), row=row)

    @property
    def completed(self) -> bool:
        """Every step succeeded."""
        return self.status is TaskStatus.COMPLETED

    def step(self, name: str) -> StepSummary:
        """The step ``name``; KeyError naming the steps there are."""
        for step in self.steps:
            if step.name == name:
                return step
        raise KeyError(f"task {self.task_id} has no step {name!r} (steps: {', '.join(s.name for s in self.steps)})")
