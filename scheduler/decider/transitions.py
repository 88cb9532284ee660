"""``evolve``: the one place that says which event may follow which state, and what it makes of it.

Replay (``fold``), the scheduler's state store and every decision (which evolves each event as it makes
it) go through these checks, so a log that breaks them stops a fold instead of being guessed at.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from scheduler.decider.state import ERASABLE, Lease, StepState, StepStatus, TaskState, TaskStatus
from schemas.messages import (
    CompensationRetried,
    CompensationStarted,
    Event,
    LateResultRecorded,
    MessageIgnored,
    OperatorAlert,
    OperatorCommandRefused,
    StepAccepted,
    StepCompensated,
    StepCompensationFailed,
    StepCompensationSkipped,
    StepCompensationStarted,
    StepFailed,
    StepResubmitted,
    StepStarted,
    StepSucceeded,
    TaskAccepted,
    TaskCompensated,
    TaskCompensationFailed,
    TaskCompleted,
    TaskDataErased,
    TaskFailed,
    TaskRejected,
)

_RECORDS = (MessageIgnored, LateResultRecorded, OperatorAlert, OperatorCommandRefused)
"""Events that record something for operators and change nothing but the sequence (and seen commands)."""


class InvalidTransition(ValueError):
    """An event cannot follow the state it is applied to: a sequence gap or an impossible transition.

    Raised by ``evolve``; seen at replay time it means the event log is corrupt or was written by a
    buggy decider, and folding must stop rather than guess.
    """


_ALLOWED_FROM: dict[type[Event], frozenset[str]] = {
    StepStarted: frozenset({"accepted", "running"}),
    StepAccepted: frozenset({"running", "compensating"}),
    StepSucceeded: frozenset({"running"}),
    StepFailed: frozenset({"running"}),
    TaskCompleted: frozenset({"running"}),
    TaskFailed: frozenset({"running"}),
    CompensationStarted: frozenset({"running", "error"}),
    StepCompensationSkipped: frozenset({"compensating"}),
    StepCompensationStarted: frozenset({"compensating"}),
    StepCompensated: frozenset({"compensating"}),
    StepCompensationFailed: frozenset({"compensating"}),
    TaskCompensated: frozenset({"compensating"}),
    TaskCompensationFailed: frozenset({"compensating"}),
    StepResubmitted: frozenset({"error"}),
    CompensationRetried: frozenset({"compensation_failed"}),
    TaskDataErased: ERASABLE,
}
"""The task statuses each transition may follow; operator transitions are the only way out of a terminal one."""


def evolve(state: TaskState | None, event: Event) -> TaskState:
    """The state after ``event``. Raises InvalidTransition when the event cannot follow ``state``."""
    if state is None:
        return _created(event)
    if event.task_id != state.task_id:
        raise InvalidTransition(f"event for task {event.task_id!r} applied to task {state.task_id!r}")
    if event.sequence != state.sequence + 1:
        raise InvalidTransition(
            f"task {state.task_id!r} is at sequence {state.sequence}: "
            f"{type(event).__name__} with sequence {event.sequence} does not follow"
        )
    if (event.workflow, event.workflow_version) != (state.workflow, state.workflow_version):
        raise InvalidTransition(
            f"task {state.task_id!r} is pinned to {state.workflow!r} v{state.workflow_version}, "
            f"the event names {event.workflow!r} v{event.workflow_version}"
        )
    if isinstance(event, TaskAccepted | TaskRejected):
        return _readmitted(state, event)
    command_id = getattr(event, "command_id", None)
    if command_id is not None:
        if command_id in state.commands:
            raise InvalidTransition(f"operator command {command_id!r} was already answered")
        state = replace(state, commands=state.commands | {command_id})
    if isinstance(event, _RECORDS):
        return replace(state, sequence=event.sequence)
    allowed = _ALLOWED_FROM.get(type(event))
    if allowed is None:
        raise InvalidTransition(f"{type(event).__name__} is not an event of the task state machine")
    if state.status not in allowed:
        raise InvalidTransition(f"task {state.task_id!r} is {state.status}: {type(event).__name__} cannot follow")
    if state.current_step is not None and not isinstance(
        event, StepAccepted | StepSucceeded | StepFailed | StepCompensated | StepCompensationFailed
    ):
        raise InvalidTransition(f"task {state.task_id!r} has an attempt in progress: "
                                f"{type(event).__name__} cannot follow before it ends")
    match event:
        case StepStarted():
            return _step_started(state, event)
        case StepAccepted():
            return _accepted(state, event)
        case StepSucceeded():
            index, step = _attempt_in_progress(state, event.step, event.attempt_id, "processing")
            done = replace(step, status="succeeded", output=event.output, calls_used=step.calls_used + event.calls)
            return _with_step(state, event, index, done)
        case StepFailed():
            index, step = _attempt_in_progress(state, event.step, event.attempt_id, "processing")
            _check_failure_count(step.name, step.failure_count, event.failure_count)
            failed = replace(step, status="failed", error=event.error, failure_count=event.failure_count,
                             calls_used=step.calls_used + event.calls)
            return _with_step(state, event, index, failed)
        case TaskCompleted():
            if not state.steps or any(step.status != "succeeded" for step in state.steps):
                raise InvalidTransition(f"task {state.task_id!r} cannot complete before all its steps succeeded")
            return replace(state, status="completed", sequence=event.sequence)
        case TaskFailed():
            _step_in(state, event.step, "failed")
            return replace(state, status="error", sequence=event.sequence)
        case CompensationStarted():
            return _compensation_started(state, event)
        case StepCompensationSkipped():
            index = _next_to_undo(state, event.step, ("succeeded", "failed"))
            return _with_step(state, event, index, replace(state.steps[index], status="compensation_skipped"))
        case StepCompensationStarted():
            return _compensation_attempt_started(state, event)
        case StepCompensated():
            index, step = _attempt_in_progress(state, event.step, event.attempt_id, "compensating")
            undo = replace(step.compensation, output=event.output,
                           calls_used=step.compensation.calls_used + event.calls)
            return _with_step(state, event, index, replace(step, status="compensated", compensation=undo))
        case StepCompensationFailed():
            index, step = _attempt_in_progress(state, event.step, event.attempt_id, "compensating")
            _check_failure_count(step.name, step.compensation.failure_count, event.failure_count)
            undo = replace(step.compensation, error=event.error, failure_count=event.failure_count,
                           calls_used=step.compensation.calls_used + event.calls)
            return _with_step(state, event, index, replace(step, status="compensation_failed", compensation=undo))
        case TaskCompensated():
            if state.undo_candidate() is not None:
                raise InvalidTransition(f"task {state.task_id!r} still has steps that may have been applied to undo")
            return replace(state, status="compensated", sequence=event.sequence)
        case TaskCompensationFailed():
            _step_in(state, event.step, "compensation_failed")
            return replace(state, status="compensation_failed", sequence=event.sequence)
        case StepResubmitted():
            index = _step_in(state, event.step, "failed")
            fresh = replace(state.steps[index], failure_count=0, calls_used=0)
            return replace(_with_step(state, event, index, fresh), status="running")
        case CompensationRetried():
            index = _step_in(state, event.step, "compensation_failed")
            step = state.steps[index]
            fresh = replace(step, compensation=replace(step.compensation, failure_count=0, calls_used=0))
            return replace(_with_step(state, event, index, fresh), status="compensating")
        case TaskDataErased():
            if state.erased:
                raise InvalidTransition(f"task {state.task_id!r} was already erased")
            return replace(state, erased=True, sequence=event.sequence)
    raise InvalidTransition(f"{type(event).__name__} is not an event of the task state machine")


def fold(events: Iterable[Event], state: TaskState | None = None) -> TaskState | None:
    """Replay: the state after ``events``, starting from ``state`` (None: from the beginning)."""
    for event in events:
        state = evolve(state, event)
    return state


def _created(event: Event) -> TaskState:
    if event.sequence != 1:
        raise InvalidTransition(
            f"task {event.task_id!r} has no state: {type(event).__name__} with sequence {event.sequence} "
            "cannot be its first event"
        )
    match event:
        case TaskAccepted():
            status: TaskStatus = "accepted"
            data, digest = event.input, event.input_digest
        case TaskRejected():
            status, data, digest = "rejected", {}, event.input_digest or ""
        case _:
            raise InvalidTransition(
                f"task {event.task_id!r} has no state: its first event must be TaskAccepted or TaskRejected, "
                f"not {type(event).__name__}"
            )
    return TaskState(
        task_id=event.task_id,
        workflow=event.workflow,
        workflow_version=event.workflow_version,
        status=status,
        sequence=1,
        input=data,
        input_digest=digest,
        submitter=event.submitter,
        reply_topic=event.reply_topic,
        steps=(),
        current_step=None,
    )


def _readmitted(state: TaskState, event: TaskAccepted | TaskRejected) -> TaskState:
    """A rejected task asking for admission again: accepted now, or rejected once more."""
    if state.status != "rejected":
        raise InvalidTransition(f"task {state.task_id!r} already exists: {type(event).__name__} again")
    if event.input_digest != state.input_digest:
        raise InvalidTransition(f"task {state.task_id!r} was rejected with input digest "
                                f"{state.input_digest[:12]}: {type(event).__name__} names another submission")
    if isinstance(event, TaskRejected):
        return replace(state, sequence=event.sequence)
    return replace(state, status="accepted", sequence=event.sequence, input=event.input,
                   submitter=event.submitter, reply_topic=event.reply_topic)


def _step_started(state: TaskState, event: StepStarted) -> TaskState:
    """A first attempt appends its step (all earlier ones must have succeeded); a retry follows a failure."""
    index = event.step_index
    if index == len(state.steps):
        if any(step.status != "succeeded" for step in state.steps):
            raise InvalidTransition(f"step {event.step!r} cannot start before every earlier step succeeded")
        prior = StepState(event.step)
    elif index < len(state.steps):
        prior = state.steps[index]
        if prior.name != event.step:
            raise InvalidTransition(f"step {index} of task {state.task_id!r} is {prior.name!r}, not {event.step!r}")
    else:
        raise InvalidTransition(f"step {event.step!r} (index {index}) skips a step of task {state.task_id!r}")
    if prior.status not in ("pending", "failed"):
        raise InvalidTransition(f"step {prior.name!r} is {prior.status}: it cannot start another attempt")
    if event.attempt != prior.attempt + 1:
        raise InvalidTransition(
            f"step {prior.name!r} was at attempt {prior.attempt}: the next is {prior.attempt + 1}, not {event.attempt}"
        )
    started = replace(
        prior,
        status="processing",
        attempt=event.attempt,
        attempt_id=event.attempt_id,
        lease=Lease(event.occurred_at, event.complete_by, event.start_by),
        calls_allowed=event.calls_allowed,
    )
    steps = (*state.steps[:index], started, *state.steps[index + 1 :])
    return replace(state, status="running", sequence=event.sequence, steps=steps, current_step=index)


def _accepted(state: TaskState, event: StepAccepted) -> TaskState:
    """The queued attempt in progress was taken by an agent: its deadline becomes the work deadline."""
    status: StepStatus = "compensating" if event.compensation else "processing"
    index, step = _attempt_in_progress(state, event.step, event.attempt_id, status)
    lease = step.current_lease
    if lease is None or not lease.queued:
        raise InvalidTransition(f"attempt {event.attempt_id} of step {step.name!r} is not queued: "
                                "it cannot be accepted")
    lease = replace(lease, accepted_at=event.accepted_at, complete_by=event.complete_by)
    taken = (replace(step, compensation=replace(step.compensation, lease=lease)) if event.compensation
             else replace(step, lease=lease))
    steps = (*state.steps[:index], taken, *state.steps[index + 1 :])
    return replace(state, sequence=event.sequence, steps=steps)


def _compensation_started(state: TaskState, event: CompensationStarted) -> TaskState:
    """The plan must be exactly the started steps, last first; only an operator compensates a task in error."""
    expected = "error" if event.trigger == "operator" else "running"
    if state.status != expected:
        raise InvalidTransition(f"task {state.task_id!r} is {state.status}: a compensation by {event.trigger} "
                                f"starts from {expected}")
    if event.trigger != "escalation" and event.command_id is None:
        raise InvalidTransition(f"a {event.trigger} compensation names the operator command that ordered it")
    if event.trigger == "escalation":
        _step_in(state, event.step or "", "failed")
    plan = state.undo_plan()
    if event.steps != plan:
        raise InvalidTransition(f"compensation plan {event.steps} is not the started steps in reverse: {plan}")
    return replace(state, status="compensating", sequence=event.sequence)


def _compensation_attempt_started(state: TaskState, event: StepCompensationStarted) -> TaskState:
    """A compensation attempt: of the last started step not yet undone, numbered after the previous one."""
    index = _next_to_undo(state, event.step, ("succeeded", "failed", "compensation_failed"))
    if event.step_index != index:
        raise InvalidTransition(f"step {event.step!r} is at index {index}, not {event.step_index}")
    step = state.steps[index]
    if event.attempt != step.compensation.attempt + 1:
        raise InvalidTransition(
            f"the compensation of step {step.name!r} was at attempt {step.compensation.attempt}: "
            f"the next is {step.compensation.attempt + 1}, not {event.attempt}"
        )
    undo = replace(step.compensation, attempt=event.attempt, attempt_id=event.attempt_id,
                   lease=Lease(event.occurred_at, event.complete_by, event.start_by), calls_allowed=event.calls_allowed)
    steps = (*state.steps[:index], replace(step, status="compensating", compensation=undo), *state.steps[index + 1 :])
    return replace(state, sequence=event.sequence, steps=steps, current_step=index)


def _next_to_undo(state: TaskState, name: str, statuses: tuple[StepStatus, ...]) -> int:
    """``name``'s index, if it is the step to undo next (reverse start order) and in one of ``statuses``."""
    index = state.undo_candidate()
    if index is None or state.steps[index].name != name or state.steps[index].status not in statuses:
        expected = state.steps[index].name if index is not None else "none"
        raise InvalidTransition(f"step {name!r} is not the next to undo of task {state.task_id!r} ({expected} is)")
    return index


def _step_in(state: TaskState, name: str, status: StepStatus) -> int:
    """The index of step ``name``, which must be in ``status``."""
    for index, step in enumerate(state.steps):
        if step.name == name and step.status == status:
            return index
    raise InvalidTransition(f"task {state.task_id!r} has no step {name!r} in {status}")


def _check_failure_count(step: str, before: int, after: int) -> None:
    if after != before + 1:
        raise InvalidTransition(f"step {step!r} had {before} failures, the event says {after}")


def _attempt_in_progress(state: TaskState, step: str, attempt: str | None,
                         status: StepStatus) -> tuple[int, StepState]:
    """The step whose attempt ``attempt`` is in progress: only that attempt's outcome can be recorded."""
    if state.current_step is None:
        raise InvalidTransition(f"task {state.task_id!r} has no attempt in progress")
    current = state.steps[state.current_step]
    if current.name != step or current.lock != attempt or current.status != status:
        raise InvalidTransition(
            f"attempt {attempt} of step {step!r} is not in progress (current: {current.lock}, {current.status})"
        )
    return state.current_step, current


def _with_step(state: TaskState, event: Event, index: int, step: StepState) -> TaskState:
    """``state`` with the step at ``index`` replaced; no attempt is in progress until the next one starts."""
    steps = (*state.steps[:index], step, *state.steps[index + 1 :])
    return replace(state, sequence=event.sequence, steps=steps, current_step=None)
