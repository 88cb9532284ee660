"""What forward attempts and undo attempts share: the attempt in progress, its acknowledgement, its expiry,
and the charge of an agent that overspent.

Both machines lock, time and budget attempts the same way, so these live once, below both.
"""

from __future__ import annotations

from datetime import timedelta

from scheduler.decider.decision import Builder
from scheduler.decider.state import Lease, StepState, TaskState
from schemas.messages import AttemptAccepted, OperatorAlert, RecoverStep, StepAccepted
from schemas.states import StepStatus


def in_progress(state: TaskState) -> tuple[int, StepState]:
    """The index and state of the step in progress; callers have checked there is one."""
    if state.current_step is None:
        raise ValueError(f"task {state.task_id!r} has no attempt in progress")
    return state.current_step, state.steps[state.current_step]


def on_accepted(builder: Builder, accepted: AttemptAccepted) -> None:
    """An agent took the queued attempt in progress: its work deadline runs from ``accepted_at``.

    The length is the one the attempt was granted (start-by to latest end), and the deadline is never
    later than that latest end: the agent computes the same instant from its request, so both sides
    agree on when the attempt's work must stop.
    """
    _index, current = in_progress(builder.state)
    lease = current.current_lease
    if lease is None or lease.timeout is None:
        raise ValueError(f"attempt {current.lock} is not queued")
    builder.emit(
        StepAccepted,
        step=current.name,
        attempt_id=current.lock,
        compensation=current.status == StepStatus.COMPENSATING,
        accepted_at=accepted.accepted_at,
        complete_by=min(accepted.accepted_at + lease.timeout, lease.complete_by),
        waited_ms=max(0, (accepted.accepted_at - lease.started_at) // timedelta(milliseconds=1)),
    )


def alert_overspend(builder: Builder, step: str, attempt: str | None, reported: int, allowed: int) -> None:
    """An agent reported more calls than it was allowed: only the allowance is charged, and a person is told."""
    if reported > allowed:
        builder.emit(
            OperatorAlert,
            step=step,
            reason=(
                f"agent overspent: attempt {attempt} reported {reported} calls but was allowed "
                f"{allowed}; only {allowed} were counted against the budget"
            ),
        )


def expiry(attempt: str | None, lease: Lease | None, recover: RecoverStep) -> str:
    """Why an expired attempt failed: no agent took it in time, or its work outlived its deadline."""
    if lease is not None and lease.queued:
        return f"attempt {attempt} was not taken by an agent before its start-by: {recover.reason}"
    return f"attempt {attempt} timed out: {recover.reason}"
