"""``decide``: routes a command to admission, the operator's handling, or the attempt in progress.

Only the routing and the checks every agent message passes live here; what each command does is in
its own module (admission, forward, compensation, operator).
"""

from __future__ import annotations

from datetime import datetime

from scheduler.decider.admission import Limits, admit, resubmit
from scheduler.decider.attempts import in_progress, on_accepted
from scheduler.decider.compensation import (
    on_compensation_result,
    on_compensation_timeout,
    start_compensation_attempt,
)
from scheduler.decider.decision import Builder, Command, Decision
from scheduler.decider.forward import on_result, on_timeout, start_attempt
from scheduler.decider.operator import on_operator
from scheduler.decider.relevance import deadline_not_passed, not_current, not_queued, record_late_result
from scheduler.decider.state import TaskState
from scheduler.decider.timers import due
from scheduler.workflow import WorkflowNotFoundError, WorkflowRegistry
from schemas.messages import (
    AttemptAccepted,
    MessageIgnored,
    OperatorCommand,
    RecoverStep,
    RetryDue,
    StepResult,
    SubmitTask,
)
from schemas.states import StepStatus


def decide(
    command: Command,
    state: TaskState | None,
    *,
    registry: WorkflowRegistry,
    now: datetime,
    in_flight: int,
    limits: Limits,
) -> Decision:
    """The events ``command`` causes on the task whose current state is ``state`` (None: no such task).

    ``now`` (time zone aware) stamps the events and sets deadlines; ``in_flight`` is the number of
    non-terminal tasks on this partition, for admission control.
    """
    if now.tzinfo is None:
        raise ValueError("now must carry a time zone")
    if state is not None and state.task_id != command.task_id:
        raise ValueError(f"state of task {state.task_id!r} given for a command on task {command.task_id!r}")
    if isinstance(command, SubmitTask):
        if state is None:
            return admit(command, registry, now, in_flight, limits)
        return resubmit(command, state, registry, now, in_flight, limits)
    if state is None:
        return Decision((), dead_letter=f"unknown task {command.task_id!r}")
    builder = Builder.on(command, state, now)
    if isinstance(command, OperatorCommand):
        return on_operator(builder, command, registry)
    if isinstance(command, RetryDue):
        return _fire(builder, command, registry)
    reason = not_current(state, command)
    if reason is None and isinstance(command, RecoverStep):
        reason = deadline_not_passed(in_progress(state)[1], now)
    if reason is None and isinstance(command, AttemptAccepted):
        reason = not_queued(in_progress(state)[1])
    if reason is not None and isinstance(command, StepResult) and record_late_result(builder, command):
        return builder.decision()
    if reason is not None:
        builder.emit(
            MessageIgnored,
            attempt_id=command.attempt_id,
            message_type=type(command).__name__,
            reason=reason,
        )
        return builder.decision()
    if isinstance(command, AttemptAccepted):
        on_accepted(builder, command)
        return builder.decision()
    try:
        workflow = registry.get(state.workflow, state.workflow_version)
    except WorkflowNotFoundError as exc:
        return Decision((), dead_letter=f"unknown workflow {state.workflow!r} v{state.workflow_version}: {exc}")
    undoing = in_progress(state)[1].status == StepStatus.COMPENSATING
    if isinstance(command, StepResult):
        (on_compensation_result if undoing else on_result)(builder, workflow, command)
    else:
        (on_compensation_timeout if undoing else on_timeout)(builder, workflow, command)
    return builder.decision()


def _fire(builder: Builder, command: RetryDue, registry: WorkflowRegistry) -> Decision:
    """A timer fired: start the attempt it was set for, if it is the step's current timer and due."""
    index = due(builder, command)
    if index is None:
        return Decision(())
    state = builder.state
    try:
        workflow = registry.get(state.workflow, state.workflow_version)
    except WorkflowNotFoundError as exc:
        return Decision((), dead_letter=f"unknown workflow {state.workflow!r} v{state.workflow_version}: {exc}")
    (start_compensation_attempt if command.compensation else start_attempt)(builder, workflow, index)
    return builder.decision()
