"""Whether a message from an agent or the supervisor concerns the attempt in progress, and if not, why.

Messages are delivered at least once and may arrive late, so most of what the decider refuses is
decided here; a definite answer for a past attempt is still recorded as the fact it is.
"""

from __future__ import annotations

from datetime import datetime

from scheduler.decider.decision import Builder
from scheduler.decider.ids import attempt_id, compensation_attempt_id
from scheduler.decider.state import StepState, TaskState
from schemas.messages import AttemptAccepted, LateResultRecorded, RecoverStep, StepResult
from schemas.states import StepStatus


def not_current(state: TaskState, command: StepResult | RecoverStep | AttemptAccepted) -> str | None:
    """Why ``command`` does not concern the attempt in progress, or None when it does."""
    if state.is_terminal:
        return f"task is {state.status}"
    if state.current_step is None:
        return "no attempt is in progress"
    current = state.steps[state.current_step]
    if current.lock != command.attempt_id:
        return f"not the current attempt: step {current.name!r} is at {current.lock}"
    if isinstance(command, StepResult | AttemptAccepted) and command.step != current.name:
        return f"the message names step {command.step!r} but attempt {command.attempt_id} is of {current.name!r}"
    return None


def record_late_result(builder: Builder, result: StepResult) -> bool:
    """Record a definite answer for a past attempt of this task as a fact; False if it is no such answer.

    Only a success or a permanent refusal is a fact worth keeping (a late transient failure says nothing
    new), and only for an attempt this task really started. Nothing changes but the record: the step is
    already in any compensation plan, and the undo that covers it fences its key at the service.
    """
    if not (result.ok or result.permanent):
        return False
    state = builder.state
    index = next((i for i, step in enumerate(state.steps) if step.name == result.step), None)
    if index is None:
        return False
    step = state.steps[index]
    forward = {attempt_id(state.task_id, step.name, n) for n in range(1, step.attempt + 1)}
    undo = {compensation_attempt_id(state.task_id, step.name, n) for n in range(1, step.compensation.attempt + 1)}
    if result.attempt_id not in forward | undo:
        return False
    is_undo = result.attempt_id in undo
    builder.emit(LateResultRecorded, step=step.name, attempt_id=result.attempt_id, ok=result.ok,
                 permanent=result.permanent, compensation=is_undo,
                 consequence=_late_consequence(step, result.ok, is_undo))
    return True


def _late_consequence(step: StepState, ok: bool, is_undo: bool) -> str:
    """What a late answer means for the task as it stands: the line an operator reads in its timeline."""
    what = ("its undo was applied" if ok else "its undo was refused") if is_undo else (
        "its effect exists at the service" if ok else "that call was refused, earlier calls may have landed")
    if is_undo:
        now = {StepStatus.COMPENSATED: "the step is recorded as undone",
               StepStatus.COMPENSATING: "an undo attempt with the same key is in progress and will get the same answer"}
        return f"late answer from an undo of step {step.name!r}: {what}; " + now.get(
            step.status, f"the step is {step.status}: a retried undo uses the same key")
    by_status = {
        StepStatus.SUCCEEDED: "the step already succeeded with the same idempotency key",
        StepStatus.PROCESSING: f"attempt {step.attempt_id} in progress uses the same idempotency key and gets it "
                               "replayed",
        StepStatus.COMPENSATING: "its undo is in progress",
        StepStatus.COMPENSATED: "its undo fenced the key at the service, so this effect landed before the undo and was "
                       "released by it",
        StepStatus.COMPENSATION_SKIPPED: "the step declares no compensating action: the effect stays",
        StepStatus.COMPENSATION_FAILED: "its undo failed: retry-compensation undoes it",
        # A failed step is the last started; a compensation undoes it first, so only a task in error has one.
        StepStatus.FAILED: "compensating the task undoes it; resubmitting the step replays it",
    }
    return f"late answer for step {step.name!r}: {what}; {by_status.get(step.status, f'the step is {step.status}')}"


def deadline_not_passed(current: StepState, now: datetime) -> str | None:
    """A recovery is conditional on the deadline in force: start-by for a queued attempt, complete-by for a
    running one (the supervisor's clock may run ahead of the scheduler's, and its view behind the log)."""
    lease = current.current_lease
    if lease is None or now >= lease.deadline:
        return None
    if lease.queued:
        return f"start-by not passed: attempt {current.lock} may wait for an agent until {lease.deadline.isoformat()}"
    return f"deadline not passed: attempt {current.lock} may run until {lease.deadline.isoformat()}"


def not_queued(current: StepState) -> str | None:
    """An acknowledgement starts the work deadline once: a redelivered request's second one changes nothing."""
    lease = current.current_lease
    if lease is None or lease.queued:
        return None
    if lease.accepted_at is None:
        return f"attempt {current.lock} runs from its start (no start-by): nothing to accept"
    return (f"attempt {current.lock} already accepted at {lease.accepted_at.isoformat()}: its deadline stays "
            f"{lease.complete_by.isoformat()}")
