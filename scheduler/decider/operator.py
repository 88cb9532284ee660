"""Operator commands: resubmit a failed step, retry a failed undo, compensate a task in error, cancel one,
make a waiting step try now, or erase an ended task's data (its data key is deleted: see
``scheduler.sealing``).

Each is checked against the task's state first; a refusal is recorded on the task where operators look,
and a repeated command (same id) changes nothing.
"""

from __future__ import annotations

from scheduler.decider.attempts import in_progress
from scheduler.decider.compensation import begin_compensation, start_compensation_attempt
from scheduler.decider.decision import Builder, Decision
from scheduler.decider.forward import start_attempt
from scheduler.decider.state import TaskState
from scheduler.workflow import WorkflowNotFoundError, WorkflowRegistry
from schemas.messages import (
    CompensationRetried,
    OperatorCommand,
    OperatorCommandRefused,
    RetryBroughtForward,
    StepFailed,
    StepResubmitted,
    TaskDataErased,
)
from schemas.states import ERASABLE, StepStatus, TaskStatus


def on_operator(builder: Builder, command: OperatorCommand, registry: WorkflowRegistry) -> Decision:
    """Apply an operator's command, or record why the task's state refuses it. A repeat changes nothing."""
    state = builder.state
    if command.command_id in state.commands:
        return Decision(())
    refusal, index = _check_operator(state, command)
    if refusal is not None:
        builder.emit(OperatorCommandRefused, command_id=command.command_id, action=command.action,
                     step=command.step, operator=command.operator, reason=refusal)
        return builder.decision()
    try:
        workflow = registry.get(state.workflow, state.workflow_version)
    except WorkflowNotFoundError as exc:
        return Decision((), dead_letter=f"unknown workflow {state.workflow!r} v{state.workflow_version}: {exc}")
    who = f"operator {command.operator}" if command.operator else "an operator"
    match command.action:
        case "resubmit":
            assert index is not None
            builder.emit(StepResubmitted, step=state.steps[index].name, command_id=command.command_id,
                         operator=command.operator)
            start_attempt(builder, workflow, index)
        case "retry-compensation":
            assert index is not None
            builder.emit(CompensationRetried, step=state.steps[index].name, command_id=command.command_id,
                         operator=command.operator)
            start_compensation_attempt(builder, workflow, index)
        case "try-now":
            assert index is not None
            timer = state.steps[index].timer
            assert timer is not None
            # The timer moves to now: the old one's firing no longer names it, so it changes nothing.
            builder.emit(RetryBroughtForward, step=state.steps[index].name, command_id=command.command_id,
                         operator=command.operator)
            (start_compensation_attempt if timer.compensation else start_attempt)(builder, workflow, index)
        case "compensate":
            begin_compensation(builder, workflow, "operator",
                                f"compensation ordered by {who} (command {command.command_id})", command=command)
        case "erase":
            builder.emit(TaskDataErased, command_id=command.command_id, operator=command.operator)
        case "cancel":
            if state.current_step is not None:
                _abandon(builder, command)
            begin_compensation(builder, workflow, "cancel",
                                f"task cancelled by {who} (command {command.command_id})", command=command)
    return builder.decision()


def _abandon(builder: Builder, command: OperatorCommand) -> None:
    """End the attempt in flight of a cancelled task; its agent's late answer will name a stale attempt.

    Charged its whole allowance, like a timeout: how many calls it made is unknown.
    """
    _index, current = in_progress(builder.state)
    builder.emit(
        StepFailed,
        step=current.name,
        attempt_id=current.attempt_id,
        error=f"attempt {current.attempt_id} abandoned: task cancelled (command {command.command_id})",
        permanent=False,
        calls=current.calls_allowed,
        failure_count=current.failure_count + 1,
    )


def _check_operator(state: TaskState, command: OperatorCommand) -> tuple[str | None, int | None]:
    """Why the state refuses ``command`` (None: it does not), and the index of the step it acts on."""
    status = state.status
    action = command.action
    doing = ""
    if state.current_step is not None:
        current = state.steps[state.current_step]
        doing = f" (step {current.name!r} is {current.status}, attempt {current.lock})"
    if action == "release":
        # A quarantined task's commands never reach the decider: the scheduler releases it or dead-letters them.
        return f"task is {status}: it is not quarantined", None
    if state.erased:
        return (f"task data erased: its input and outputs open nowhere, so {action} cannot run or undo anything"
                if action != "erase" else "task data already erased"), None
    if action == "erase":
        if command.step is not None:
            return "erase acts on the whole task: it takes no step", None
        if status not in ERASABLE:
            return (f"task is {status}{doing}: only an ended task's data can be erased "
                    "(cancel a running task first)"), None
        return None, None
    if action in ("compensate", "cancel"):
        if command.step is not None:
            return f"{action} acts on the whole task: it takes no step", None
        if action == "compensate" and status != TaskStatus.ERROR:
            return (f"task is {status}{doing}: only a task in error can be compensated "
                    "(cancel a running task; retry-compensation after compensation_failed)"), None
        if action == "cancel" and status not in (TaskStatus.ACCEPTED, TaskStatus.RUNNING):
            return f"task is {status}: only a running task can be cancelled", None
        return None, None
    if action == "try-now":
        wanted = StepStatus.WAITING
        if status not in (TaskStatus.RUNNING, TaskStatus.COMPENSATING):
            return f"task is {status}: try-now needs a running or compensating task with a step waiting", None
    else:
        wanted = StepStatus.FAILED if action == "resubmit" else StepStatus.COMPENSATION_FAILED
        needed = TaskStatus.ERROR if action == "resubmit" else TaskStatus.COMPENSATION_FAILED
        if status != needed:
            return f"task is {status}{doing}: {action} needs a task in {needed}", None
    names = [step.name for step in state.steps]
    if command.step is None:
        index = next((i for i, step in enumerate(state.steps) if step.status == wanted), None)
        if index is None:
            return f"task has no step in {wanted}", None
    elif command.step in names:
        index = names.index(command.step)
    else:
        return f"task has no step {command.step!r} that ran (steps: {', '.join(names)})", None
    step = state.steps[index]
    if step.status != wanted:
        return f"step {step.name!r} is {step.status}: {action} needs a step in {wanted}", None
    return None, index
