"""The spans the scheduler records from the events it appends (see :mod:`eventstore.tracing`).

The scheduler sees the whole life of a task and of each attempt in its events, so it records the spans
no single other process could: the task's root when the task is accepted, and each attempt's span when
the attempt ends, from the moment it was handed over (its lease's start) to its end.
"""

from __future__ import annotations

from datetime import UTC, datetime

from eventstore.tracing import attempt_span, emit_span, task_root
from scheduler.decider import TaskState
from schemas.messages import (
    Event,
    StepCompensated,
    StepCompensationFailed,
    StepFailed,
    StepSucceeded,
    TaskAccepted,
)

_ATTEMPT_ENDS = (StepSucceeded, StepFailed, StepCompensated, StepCompensationFailed)


def record_spans(event: Event, before: TaskState | None, now: datetime | None = None) -> None:
    """The spans ``event`` completes, given the task's state before it."""
    end = now or datetime.now(UTC)
    if isinstance(event, TaskAccepted):
        emit_span(f"task {event.workflow}", task_root(event.task_id), None, event.occurred_at, end,
                  {"stepstream.task_id": event.task_id, "stepstream.workflow": event.workflow,
                   "stepstream.workflow_version": event.workflow_version})
        return
    if not isinstance(event, _ATTEMPT_ENDS) or before is None:
        return
    undo = isinstance(event, StepCompensated | StepCompensationFailed)
    step = next((s for s in before.steps if s.name == event.step), None)
    if step is None:
        return
    lease, attempt = (step.compensation.lease, step.compensation.attempt) if undo else (step.lease, step.attempt)
    started = lease.started_at if lease is not None else event.occurred_at
    failed = isinstance(event, StepFailed | StepCompensationFailed)
    emit_span(f"{'undo' if undo else 'attempt'} {event.step}#{attempt}",
              attempt_span(event.task_id, event.attempt_id), task_root(event.task_id), started, end,
              {"stepstream.task_id": event.task_id, "stepstream.step": event.step,
               "stepstream.attempt_id": event.attempt_id, "stepstream.calls": event.calls,
               "stepstream.outcome": "failed" if failed else "ok"},
              error=event.error if isinstance(event, StepFailed | StepCompensationFailed) else None)
