"""``evolve``: the one place that says which event may follow which state, and what it makes of it.

Replay (``fold``), the scheduler's state store and every decision (which evolves each event as it makes
it) go through these checks, so a log that breaks them stops a fold instead of being guessed at.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from datetime import datetime

from scheduler.decider.state import Lease, StepState, TaskState, Timer
from schemas.messages import (
    CompensationRetried,
    CompensationStarted,
    Event,
    LateResultRecorded,
    MessageIgnored,
    OperatorAlert,
    OperatorCommandRefused,
    RetryBroughtForward,
    StepAccepted,
    StepCompensated,
    StepCompensationFailed,
    StepCompensationSkipped,
    StepCompensationStarted,
    StepFailed,
    StepResubmitted,
    StepRetryScheduled,
    StepStarted,
    StepSucceeded,
    TaskAccepted,
    TaskCompensated,
    TaskCompensationFailed,
    TaskCompleted,
    TaskDataErased,
    TaskFailed,
    TaskQuarantined,
    TaskRejected,
    TaskReleased,
)
from schemas.states import ERASABLE, StepStatus, TaskStatus

_RECORDS = (MessageIgnored, LateResultRecorded, OperatorAlert, OperatorCommandRefused, TaskQuarantined, TaskReleased)
"""Events that record something for operators and change nothing but the sequence (and seen commands).

A quarantine and its release are records too: whether a task is quarantined is the scheduler's to know
(``scheduler.quarantine``), not a status of the task's state machine, so a version that folds the history
arrives at the state the task had, and the release lets it go on from there."""


class InvalidTransition(ValueError):
    """An event cannot follow the state it is applied to: a sequence gap or an impossible transition.

    Raised by ``evolve``; seen at replay time it means the event log is corrupt or was written by a
    buggy decider, and folding must stop rather than guess.
    """


_ALLOWED_FROM: dict[type[Event], frozenset[TaskStatus]] = {
    StepStarted: frozenset({TaskStatus.ACCEPTED, TaskStatus.RUNNING}),
    StepAccepted: frozenset({TaskStatus.RUNNING, TaskStatus.COMPENSATING}),
    StepSucceeded: frozenset({TaskStatus.RUNNING}),
    StepFailed: frozenset({TaskStatus.RUNNING}),
    TaskCompleted: frozenset({TaskStatus.RUNNING}),
    TaskFailed: frozenset({TaskStatus.RUNNING}),
    CompensationStarted: frozenset({TaskStatus.RUNNING, TaskStatus.ERROR}),
    StepCompensationSkipped: frozenset({TaskStatus.COMPENSATING}),
    StepCompensationStarted: frozenset({TaskStatus.COMPENSATING}),
    StepCompensated: frozenset({TaskStatus.COMPENSATING}),
    StepCompensationFailed: frozenset({TaskStatus.COMPENSATING}),
    TaskCompensated: frozenset({TaskStatus.COMPENSATING}),
    TaskCompensationFailed: frozenset({TaskStatus.COMPENSATING}),
    StepResubmitted: frozenset({TaskStatus.ERROR}),
    CompensationRetried: frozenset({TaskStatus.COMPENSATION_FAILED}),
    StepRetryScheduled: frozenset({TaskStatus.RUNNING, TaskStatus.COMPENSATING}),
    RetryBroughtForward: frozenset({TaskStatus.RUNNING, TaskStatus.COMPENSATING}),
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
        event, StepAccepted | StepSucceeded | StepFailed | StepCompensated | StepCompensationFailed | StepRetryScheduled
    ):
        raise InvalidTransition(f"task {state.task_id!r} has an attempt in progress: "
                                f"{type(event).__name__} cannot follow before it ends")
    match event:
        case StepStarted():
            return _step_started(state, event)
        case StepAccepted():
            return _accepted(state, event)
        case StepSucceeded():
            index, step = _attempt_in_progress(state, event.step, event.attempt_id, StepStatus.PROCESSING)
            done = replace(step, status=StepStatus.SUCCEEDED, output=event.output,
                           calls_used=step.calls_used + event.calls)
            return _with_step(state, event, index, done)
        case StepFailed():
            index, step = _attempt_in_progress(state, event.step, event.attempt_id, StepStatus.PROCESSING)
            _check_failure_count(step.name, step.failure_count, event.failure_count)
            failed = replace(step, status=StepStatus.FAILED, error=event.error, failure_count=event.failure_count,
                             calls_used=step.calls_used + event.calls)
            return _with_step(state, event, index, failed)
        case TaskCompleted():
            if not state.steps or any(step.status != StepStatus.SUCCEEDED for step in state.steps):
                raise InvalidTransition(f"task {state.task_id!r} cannot complete before all its steps succeeded")
            return replace(state, status=TaskStatus.COMPLETED, sequence=event.sequence)
        case TaskFailed():
            _step_in(state, event.step, StepStatus.FAILED)
            return replace(state, status=TaskStatus.ERROR, sequence=event.sequence)
        case CompensationStarted():
            return _compensation_started(state, event)
        case StepCompensationSkipped():
            index = _next_to_undo(state, event.step, (StepStatus.SUCCEEDED, StepStatus.FAILED))
            return _with_step(state, event, index, replace(state.steps[index], status=StepStatus.COMPENSATION_SKIPPED))
        case StepCompensationStarted():
            return _compensation_attempt_started(state, event)
        case StepCompensated():
            index, step = _attempt_in_progress(state, event.step, event.attempt_id, StepStatus.COMPENSATING)
            undo = replace(step.compensation, output=event.output,
                           calls_used=step.compensation.calls_used + event.calls)
            return _with_step(state, event, index, replace(step, status=StepStatus.COMPENSATED, compensation=undo))
        case StepCompensationFailed():
            index, step = _attempt_in_progress(state, event.step, event.attempt_id, StepStatus.COMPENSATING)
            _check_failure_count(step.name, step.compensation.failure_count, event.failure_count)
            undo = replace(step.compensation, error=event.error, failure_count=event.failure_count,
                           calls_used=step.compensation.calls_used + event.calls)
            given_up = replace(step, status=StepStatus.COMPENSATION_FAILED, compensation=undo)
            return _with_step(state, event, index, given_up)
        case TaskCompensated():
            if state.undo_candidate() is not None:
                raise InvalidTransition(f"task {state.task_id!r} still has steps that may have been applied to undo")
            return replace(state, status=TaskStatus.COMPENSATED, sequence=event.sequence)
        case TaskCompensationFailed():
            _step_in(state, event.step, StepStatus.COMPENSATION_FAILED)
            return replace(state, status=TaskStatus.COMPENSATION_FAILED, sequence=event.sequence)
        case StepResubmitted():
            index = _step_in(state, event.step, StepStatus.FAILED)
            fresh = replace(state.steps[index], failure_count=0, calls_used=0, first_started_at=None)
            return replace(_with_step(state, event, index, fresh), status=TaskStatus.RUNNING)
        case StepRetryScheduled():
            return _retry_scheduled(state, event)
        case RetryBroughtForward():
            index = _step_in(state, event.step, StepStatus.WAITING)
            step = state.steps[index]
            assert step.timer is not None
            timer = replace(step.timer, not_before=min(step.timer.not_before, event.occurred_at),
                            reason=f"{step.timer.reason}; brought forward by an operator")
            return _with_step(state, event, index, replace(step, timer=timer))
        case CompensationRetried():
            index = _step_in(state, event.step, StepStatus.COMPENSATION_FAILED)
            step = state.steps[index]
            fresh = replace(step, compensation=replace(step.compensation, failure_count=0, calls_used=0))
            return replace(_with_step(state, event, index, fresh), status=TaskStatus.COMPENSATING)
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
            status: TaskStatus = TaskStatus.ACCEPTED
            data, digest = event.input, event.input_digest
        case TaskRejected():
            status, data, digest = TaskStatus.REJECTED, {}, event.input_digest or ""
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
        rejection=event.reason if isinstance(event, TaskRejected) else None,
    )


def _readmitted(state: TaskState, event: TaskAccepted | TaskRejected) -> TaskState:
    """A rejected task asking for admission again: accepted now, or rejected once more."""
    if state.status != TaskStatus.REJECTED:
        raise InvalidTransition(f"task {state.task_id!r} already exists: {type(event).__name__} again")
    if event.input_digest != state.input_digest:
        raise InvalidTransition(f"task {state.task_id!r} was rejected with input digest "
                                f"{state.input_digest[:12]}: {type(event).__name__} names another submission")
    if isinstance(event, TaskRejected):
        return replace(state, sequence=event.sequence, rejection=event.reason)
    return replace(state, status=TaskStatus.ACCEPTED, sequence=event.sequence, input=event.input,
                   submitter=event.submitter, reply_topic=event.reply_topic, rejection=None)


def _step_started(state: TaskState, event: StepStarted) -> TaskState:
    """A first attempt appends its step (all earlier ones must have succeeded); a retry follows a failure."""
    index = event.step_index
    if index == len(state.steps):
        if any(step.status != StepStatus.SUCCEEDED for step in state.steps):
            raise InvalidTransition(f"step {event.step!r} cannot start before every earlier step succeeded")
        prior = StepState(event.step)
    elif index < len(state.steps):
        prior = state.steps[index]
        if prior.name != event.step:
            raise InvalidTransition(f"step {index} of task {state.task_id!r} is {prior.name!r}, not {event.step!r}")
    else:
        raise InvalidTransition(f"step {event.step!r} (index {index}) skips a step of task {state.task_id!r}")
    if prior.status not in (StepStatus.PENDING, StepStatus.FAILED, StepStatus.WAITING):
        raise InvalidTransition(f"step {prior.name!r} is {prior.status}: it cannot start another attempt")
    _check_timer(prior, event.attempt, event.occurred_at, compensation=False)
    if event.attempt != prior.attempt + 1:
        raise InvalidTransition(
            f"step {prior.name!r} was at attempt {prior.attempt}: the next is {prior.attempt + 1}, not {event.attempt}"
        )
    started = replace(
        prior,
        status=StepStatus.PROCESSING,
        attempt=event.attempt,
        attempt_id=event.attempt_id,
        lease=Lease(event.occurred_at, event.complete_by, event.start_by),
        calls_allowed=event.calls_allowed,
        timer=None,
        first_started_at=prior.first_started_at or event.occurred_at,
    )
    steps = (*state.steps[:index], started, *state.steps[index + 1 :])
    return replace(state, status=TaskStatus.RUNNING, sequence=event.sequence, steps=steps, current_step=index)


def _accepted(state: TaskState, event: StepAccepted) -> TaskState:
    """The queued attempt in progress was taken by an agent: its deadline becomes the work deadline."""
    status: StepStatus = StepStatus.COMPENSATING if event.compensation else StepStatus.PROCESSING
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
    expected = TaskStatus.ERROR if event.trigger == "operator" else TaskStatus.RUNNING
    if state.status != expected:
        raise InvalidTransition(f"task {state.task_id!r} is {state.status}: a compensation by {event.trigger} "
                                f"starts from {expected}")
    if event.trigger != "escalation" and event.command_id is None:
        raise InvalidTransition(f"a {event.trigger} compensation names the operator command that ordered it")
    if event.trigger == "escalation":
        _step_in(state, event.step or "", StepStatus.FAILED)
    plan = state.undo_plan()
    if event.steps != plan:
        raise InvalidTransition(f"compensation plan {event.steps} is not the started steps in reverse: {plan}")
    # A forward retry still waiting will never run: its step is a failed one to undo, its timer stale.
    steps = tuple(replace(step, status=StepStatus.FAILED, timer=None) if step.status == StepStatus.WAITING else step
                  for step in state.steps)
    return replace(state, status=TaskStatus.COMPENSATING, sequence=event.sequence, steps=steps)


def _compensation_attempt_started(state: TaskState, event: StepCompensationStarted) -> TaskState:
    """A compensation attempt: of the last started step not yet undone, numbered after the previous one."""
    index = _next_to_undo(state, event.step, (StepStatus.SUCCEEDED, StepStatus.FAILED, StepStatus.COMPENSATION_FAILED,
                                              StepStatus.WAITING))
    if event.step_index != index:
        raise InvalidTransition(f"step {event.step!r} is at index {index}, not {event.step_index}")
    step = state.steps[index]
    _check_timer(step, event.attempt, event.occurred_at, compensation=True)
    if event.attempt != step.compensation.attempt + 1:
        raise InvalidTransition(
            f"the compensation of step {step.name!r} was at attempt {step.compensation.attempt}: "
            f"the next is {step.compensation.attempt + 1}, not {event.attempt}"
        )
    undo = replace(step.compensation, attempt=event.attempt, attempt_id=event.attempt_id,
                   lease=Lease(event.occurred_at, event.complete_by, event.start_by), calls_allowed=event.calls_allowed)
    steps = (*state.steps[:index], replace(step, status=StepStatus.COMPENSATING, compensation=undo, timer=None),
             *state.steps[index + 1 :])
    return replace(state, sequence=event.sequence, steps=steps, current_step=index)


def _retry_scheduled(state: TaskState, event: StepRetryScheduled) -> TaskState:
    """A timer for the next attempt: after a failed one, or in place of one refused without a call.

    A deferral ends the attempt in progress without a failure (it made no call, so charges nothing); a
    timer after a failure follows the failure's event. Either way the step is ``waiting`` with no attempt
    in progress.
    """
    forward_status = StepStatus.PROCESSING if event.deferred_attempt_id else StepStatus.FAILED
    undo_status = StepStatus.COMPENSATING if event.deferred_attempt_id else StepStatus.COMPENSATION_FAILED
    status = undo_status if event.compensation else forward_status
    if event.deferred_attempt_id is not None:
        index, step = _attempt_in_progress(state, event.step, event.deferred_attempt_id, status)
    else:
        index = _step_in(state, event.step, status)
        step = state.steps[index]
    if event.step_index != index or (state.status == TaskStatus.COMPENSATING) != event.compensation:
        raise InvalidTransition(f"a timer for step {event.step!r} (index {event.step_index}, compensation "
                                f"{event.compensation}) does not fit task {state.task_id!r}, {state.status}")
    next_attempt = (step.compensation.attempt if event.compensation else step.attempt) + 1
    if event.attempt != next_attempt:
        raise InvalidTransition(f"a timer for attempt {event.attempt} of step {step.name!r}: "
                                f"the next is {next_attempt}")
    timer = Timer(event.attempt, event.not_before, event.reason, event.compensation)
    waiting = replace(step, status=StepStatus.WAITING, timer=timer)
    if event.new_round:
        if event.deferred_attempt_id is not None:
            raise InvalidTransition(f"a new round of step {step.name!r} follows a failed attempt, not a deferral")
        if event.compensation:
            undo = step.compensation
            waiting = replace(waiting, compensation=replace(undo, failure_count=0, rounds=undo.rounds + 1))
        else:
            waiting = replace(waiting, failure_count=0, rounds=step.rounds + 1)
    return _with_step(state, event, index, waiting)


def _check_timer(step: StepState, attempt: int, at: datetime, *, compensation: bool) -> None:
    """An attempt of a waiting step is the one its timer was set for, and starts no earlier than it."""
    if step.status != StepStatus.WAITING:
        return
    timer = step.timer
    if timer is None or timer.compensation != compensation or timer.attempt != attempt:
        raise InvalidTransition(f"step {step.name!r} waits for {timer}: attempt {attempt} cannot start")
    if at < timer.not_before:
        raise InvalidTransition(f"step {step.name!r} waits until {timer.not_before.isoformat()}: attempt {attempt} "
                                f"cannot start at {at.isoformat()}")


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
    """A failed attempt counts one failure, or none when it was throttled (the service pacing us)."""
    if after not in (before, before + 1):
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
