"""The scheduler's write side as a pure decider: ``decide`` turns a command and a task's state into
events, ``evolve`` applies one event to a state, ``fold`` replays a history into a state.

Nothing here does I/O or reads a clock or a random source: the caller passes ``now`` and the number of
tasks in flight, and event ids are derived from the task id and sequence number. Deciding the same
command on the same state therefore always yields the same events, which is what lets a scheduler that
took over a partition (or an operator replaying ``events``) arrive at exactly the state its predecessor
had, and what lets tests compare decisions by value.

State is only ever a fold of events. ``decide`` builds its events by evolving a working copy of the
state as it goes, so every decision it returns has already passed ``evolve``'s transition checks.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any, Literal, TypeAlias

import orjson

from scheduler.workflow import Workflow, WorkflowNotFoundError, WorkflowRegistry
from schemas.messages import (
    Event,
    MessageIgnored,
    OperatorAlert,
    RecoverStep,
    StepFailed,
    StepResult,
    StepStarted,
    StepSucceeded,
    SubmitTask,
    TaskAccepted,
    TaskCompleted,
    TaskFailed,
    TaskRejected,
)

TaskStatus = Literal[
    "accepted", "running", "completed", "error", "rejected", "compensating", "compensated", "compensation_failed"
]
StepStatus = Literal[
    "pending", "processing", "succeeded", "failed", "compensating", "compensated", "compensation_failed"
]
TERMINAL: frozenset[str] = frozenset({"completed", "error", "rejected", "compensated", "compensation_failed"})
"""Task statuses no command can leave: a terminal task only records ignored messages and alerts."""

Command: TypeAlias = SubmitTask | StepResult | RecoverStep

# Event ids are uuid5(task id, sequence): unique within the log (a task's sequence numbers never repeat)
# and the same every time the same decision is made again.
_EVENT_IDS = uuid.uuid5(uuid.NAMESPACE_URL, "urn:stepstream:event")


class InvalidTransition(ValueError):
    """An event cannot follow the state it is applied to: a sequence gap or an impossible transition.

    Raised by ``evolve``; seen at replay time it means the event log is corrupt or was written by a
    buggy decider, and folding must stop rather than guess.
    """


@dataclass(frozen=True)
class StepState:
    """One step of a task, as far as the task got: a step appears when its first attempt starts.

    ``calls_used`` only grows and never exceeds the step's ``attempt_budget``; ``calls_allowed`` is what
    the current (or last) attempt was granted, kept so a timed-out attempt can be charged in full.
    ``error`` is the last failure's, kept across retries for operators.
    """

    name: str
    status: StepStatus = "pending"
    attempt: int = 0
    attempt_id: str | None = None
    complete_by: datetime | None = None
    failure_count: int = 0
    calls_used: int = 0
    calls_allowed: int = 0
    output: dict[str, Any] | None = None
    error: str | None = None


@dataclass(frozen=True)
class TaskState:
    """A task as the fold of its events. ``sequence`` is its version: the last event's sequence.

    A rejected task keeps the digest and addressee of its submission but not its input (``{}``): that is
    enough to tell a repeat from a contradiction, without storing payloads that were never admitted.
    """

    task_id: str
    workflow: str
    workflow_version: int
    status: TaskStatus
    sequence: int
    input: dict[str, Any]
    input_digest: str
    submitter: str | None
    reply_topic: str | None
    steps: tuple[StepState, ...]
    current_step: int | None

    @property
    def is_terminal(self) -> bool:
        return self.status in TERMINAL

    def step_input(self) -> dict[str, Any]:
        """What the next attempt's agent gets: the task input and the outputs of the steps before it."""
        return {
            "task": self.input,
            "steps": {step.name: step.output for step in self.steps if step.status == "succeeded"},
        }


@dataclass(frozen=True)
class Limits:
    """Bounds the decider enforces. ``max_in_flight`` is per scheduler partition (admission control)."""

    max_in_flight: int = 10_000

    def __post_init__(self) -> None:
        if self.max_in_flight < 0:
            raise ValueError("max_in_flight cannot be negative")


@dataclass(frozen=True)
class Decision:
    """The events a command causes, and, when the command itself must go to the DLQ, why.

    A dead-lettered command may still cause events: a contradictory duplicate submission raises an
    operator alert on the task it contradicts.
    """

    events: tuple[Event, ...]
    dead_letter: str | None = None


def input_digest(workflow: str, version: int | None, input: dict[str, Any]) -> str:
    """SHA-256 of the immutable submission data in canonical JSON, to tell a repeat from a contradiction.

    ``decide`` always passes the pinned version, so a repeat that asks for "latest" (``None``) after a
    newer version was registered still matches the task it repeats.
    """
    canonical = orjson.dumps(
        {"workflow": workflow, "workflow_version": version, "input": input}, option=orjson.OPT_SORT_KEYS
    )
    return hashlib.sha256(canonical).hexdigest()


def attempt_id(task_id: str, step: str, attempt: int) -> str:
    """The lock of one attempt (``locked_by``): results and recoveries naming another one change nothing."""
    return f"{task_id}:{step}:{attempt}"


# ---- decide -------------------------------------------------------------------------------------


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
            return _admit(command, registry, now, in_flight, limits)
        return _resubmit(command, state, now)
    if state is None:
        return Decision((), dead_letter=f"unknown task {command.task_id!r}")
    builder = _Builder.on(command, state, now)
    reason = _not_current(state, command)
    if reason is None and isinstance(command, RecoverStep):
        reason = _deadline_not_passed(_current(state)[1], now)
    if reason is not None:
        builder.emit(
            MessageIgnored,
            attempt_id=command.attempt_id,
            message_type=type(command).__name__,
            reason=reason,
        )
        return builder.decision()
    try:
        workflow = registry.get(state.workflow, state.workflow_version)
    except WorkflowNotFoundError as exc:
        return Decision((), dead_letter=f"unknown workflow {state.workflow!r} v{state.workflow_version}: {exc}")
    if isinstance(command, StepResult):
        _on_result(builder, workflow, command)
    else:
        _on_timeout(builder, workflow, command)
    return builder.decision()


class _Builder:
    """Accumulates one decision's events, stamping the fields every event shares and evolving as it goes.

    Evolving each event as it is made numbers the sequence without gaps and lets later events of the same
    decision see the effect of earlier ones (a retry sees the failure count its StepFailed set).
    """

    def __init__(self, command: Command, state: TaskState | None, now: datetime, workflow: str,
                 version: int) -> None:
        self._command = command
        self._state = state
        self._workflow = workflow
        self._version = version
        self.now = now
        self._events: list[Event] = []

    @classmethod
    def on(cls, command: Command, state: TaskState, now: datetime) -> _Builder:
        """A builder for a decision on an existing task, whose events keep its pinned workflow version."""
        return cls(command, state, now, state.workflow, state.workflow_version)

    @property
    def state(self) -> TaskState:
        if self._state is None:
            raise ValueError("no event has created the task yet")
        return self._state

    def emit(self, event_type: type[Event], **fields: Any) -> None:
        sequence = (self._state.sequence if self._state is not None else 0) + 1
        event = event_type(
            message_id=uuid.uuid5(_EVENT_IDS, f"{self._command.task_id}\x00{sequence}").hex,
            task_id=self._command.task_id,
            occurred_at=self.now,
            sequence=sequence,
            workflow=self._workflow,
            workflow_version=self._version,
            causation_id=self._command.message_id,
            **fields,
        )
        self._state = evolve(self._state, event)
        self._events.append(event)

    def decision(self, dead_letter: str | None = None) -> Decision:
        return Decision(tuple(self._events), dead_letter)


def _admit(command: SubmitTask, registry: WorkflowRegistry, now: datetime, in_flight: int,
           limits: Limits) -> Decision:
    """A first submission: pin the workflow version, then reject (past the bound) or accept and start."""
    try:
        workflow = registry.get(command.workflow, command.workflow_version)
    except WorkflowNotFoundError as exc:
        wanted = "latest" if command.workflow_version is None else f"v{command.workflow_version}"
        return Decision((), dead_letter=f"unknown workflow {command.workflow!r} ({wanted}): {exc}")
    builder = _Builder(command, None, now, workflow.name, workflow.version)
    submission = {
        "input_digest": input_digest(workflow.name, workflow.version, command.input),
        "submitter": command.submitter,
        "reply_topic": command.reply_topic,
    }
    if in_flight >= limits.max_in_flight:
        reason = f"admission control: {in_flight} tasks in flight, the limit is {limits.max_in_flight}"
        builder.emit(TaskRejected, reason=reason, **submission)
        return builder.decision()
    builder.emit(TaskAccepted, input=command.input, **submission)
    _start_attempt(builder, workflow, 0)
    return builder.decision()


def _resubmit(command: SubmitTask, state: TaskState, now: datetime) -> Decision:
    """The same task id again: a no-op if it is the same submission, else a contradiction for the DLQ.

    Nothing of the existing task is overwritten either way, whatever its status; the contradiction is
    recorded on the task as an operator alert so it shows where operators look for the task.
    """
    version = state.workflow_version if command.workflow_version is None else command.workflow_version
    digest = input_digest(command.workflow, version, command.input)
    if command.workflow == state.workflow and digest == state.input_digest:
        return Decision(())
    reason = (
        f"contradictory duplicate submission of task {state.task_id!r}: {command.workflow!r} v{version} "
        f"with input digest {digest[:12]} differs from the submitted {state.workflow!r} "
        f"v{state.workflow_version} with digest {state.input_digest[:12]}"
    )
    builder = _Builder.on(command, state, now)
    builder.emit(OperatorAlert, reason=reason)
    return builder.decision(dead_letter=reason)


def _current(state: TaskState) -> tuple[int, StepState]:
    """The index and state of the step in progress; callers have checked there is one."""
    if state.current_step is None:
        raise ValueError(f"task {state.task_id!r} has no attempt in progress")
    return state.current_step, state.steps[state.current_step]


def _not_current(state: TaskState, command: StepResult | RecoverStep) -> str | None:
    """Why ``command`` does not concern the attempt in progress, or None when it does."""
    if state.is_terminal:
        return f"task is {state.status}"
    if state.current_step is None:
        return "no attempt is in progress"
    current = state.steps[state.current_step]
    if current.attempt_id != command.attempt_id:
        return f"not the current attempt: step {current.name!r} is at {current.attempt_id}"
    if isinstance(command, StepResult) and command.step != current.name:
        return f"the result names step {command.step!r} but attempt {command.attempt_id} is of {current.name!r}"
    return None


def _deadline_not_passed(current: StepState, now: datetime) -> str | None:
    """A recovery is conditional on the deadline: the supervisor's clock may run ahead of the scheduler's."""
    if current.complete_by is not None and now < current.complete_by:
        return f"deadline not passed: attempt {current.attempt_id} may run until {current.complete_by.isoformat()}"
    return None


def _on_result(builder: _Builder, workflow: Workflow, result: StepResult) -> None:
    """The current attempt's agent answered: move on to the next step, retry, or escalate."""
    index, current = _current(builder.state)
    charged = min(result.calls, current.calls_allowed)
    if result.ok:
        builder.emit(StepSucceeded, step=current.name, attempt_id=current.attempt_id,
                     output=result.output or {}, calls=charged)
    else:
        error = result.error or "the agent reported a failure without detail"
        builder.emit(StepFailed, step=current.name, attempt_id=current.attempt_id, error=error,
                     permanent=result.permanent, calls=charged, failure_count=current.failure_count + 1)
    if result.calls > charged:
        builder.emit(
            OperatorAlert,
            step=current.name,
            reason=(
                f"agent overspent: attempt {current.attempt_id} reported {result.calls} calls but was allowed "
                f"{current.calls_allowed}; only {charged} were counted against the step's budget"
            ),
        )
    if result.ok:
        if index + 1 < len(workflow.steps):
            _start_attempt(builder, workflow, index + 1)
        else:
            outputs = {step.name: step.output for step in builder.state.steps}
            builder.emit(TaskCompleted, output=outputs)
    elif result.permanent:
        _escalate(builder, current.name, f"permanent failure of step {current.name!r}: {error}")
    else:
        _retry_or_escalate(builder, workflow, index)


def _on_timeout(builder: _Builder, workflow: Workflow, recover: RecoverStep) -> None:
    """The current attempt's deadline passed: it failed transiently, having spent its whole allowance.

    Charging the full allowance is the only safe assumption about an attempt that never answered: it may
    have made every call it was allowed, and the step's end-to-end budget must hold regardless.
    """
    index, current = _current(builder.state)
    builder.emit(
        StepFailed,
        step=current.name,
        attempt_id=current.attempt_id,
        error=f"attempt {current.attempt_id} timed out: {recover.reason}",
        permanent=False,
        timed_out=True,
        calls=current.calls_allowed,
        failure_count=current.failure_count + 1,
    )
    _retry_or_escalate(builder, workflow, index)


def _retry_or_escalate(builder: _Builder, workflow: Workflow, index: int) -> None:
    """Below the workflow's failure threshold, a transiently failed step gets another attempt."""
    step = builder.state.steps[index]
    if step.failure_count >= workflow.failure_threshold:
        _escalate(
            builder,
            step.name,
            f"failure threshold reached: {step.failure_count} failed attempts of step {step.name!r} "
            f"(threshold {workflow.failure_threshold})",
        )
    else:
        _start_attempt(builder, workflow, index)


def _start_attempt(builder: _Builder, workflow: Workflow, index: int) -> None:
    """Hand the next attempt of step ``index`` to its agent, granting what is left of the step's budget.

    An attempt with nothing left to spend could only fail, so the step escalates instead.
    """
    step = workflow.steps[index]
    steps = builder.state.steps
    prior = steps[index] if index < len(steps) else StepState(step.name)
    allowed = min(step.calls_per_attempt, step.attempt_budget - prior.calls_used)
    if allowed <= 0:
        _escalate(
            builder,
            step.name,
            f"attempt budget exhausted: step {step.name!r} used {prior.calls_used} of its "
            f"{step.attempt_budget} calls",
        )
        return
    attempt = prior.attempt + 1
    builder.emit(
        StepStarted,
        step=step.name,
        step_index=index,
        attempt=attempt,
        attempt_id=attempt_id(builder.state.task_id, step.name, attempt),
        complete_by=builder.now + timedelta(seconds=step.timeout_s),
        calls_allowed=allowed,
    )


def _escalate(builder: _Builder, step: str, reason: str) -> None:
    """Give up on a step: the one place that decides what that does to its task.

    Every path that stops retrying comes here. Both escalation policies currently end the task in
    ``error`` with an operator alert, because the model has no compensation events yet; the workflow's
    ``compensate`` policy will branch here, and only here, when it does.
    """
    builder.emit(TaskFailed, step=step, reason=reason)
    builder.emit(OperatorAlert, step=step, reason=reason)


# ---- evolve -------------------------------------------------------------------------------------


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
    match event:
        case MessageIgnored() | OperatorAlert():
            return replace(state, sequence=event.sequence)
        case TaskAccepted() | TaskRejected():
            raise InvalidTransition(f"task {state.task_id!r} already exists: {type(event).__name__} again")
    if state.is_terminal:
        raise InvalidTransition(f"task {state.task_id!r} is {state.status}: {type(event).__name__} cannot follow")
    match event:
        case StepStarted():
            return _step_started(state, event)
        case StepSucceeded():
            index, step = _attempt_in_progress(state, event.step, event.attempt_id)
            done = replace(step, status="succeeded", output=event.output, calls_used=step.calls_used + event.calls)
            return _with_step(state, event, index, done)
        case StepFailed():
            index, step = _attempt_in_progress(state, event.step, event.attempt_id)
            if event.failure_count != step.failure_count + 1:
                raise InvalidTransition(
                    f"step {step.name!r} had {step.failure_count} failures, the event says {event.failure_count}"
                )
            failed = replace(step, status="failed", error=event.error, failure_count=event.failure_count,
                             calls_used=step.calls_used + event.calls)
            return _with_step(state, event, index, failed)
        case TaskCompleted():
            if not state.steps or any(step.status != "succeeded" for step in state.steps):
                raise InvalidTransition(f"task {state.task_id!r} cannot complete before all its steps succeeded")
            return replace(state, status="completed", sequence=event.sequence)
        case TaskFailed():
            if not any(step.name == event.step and step.status == "failed" for step in state.steps):
                raise InvalidTransition(f"task {state.task_id!r} cannot fail on step {event.step!r}: it has not failed")
            return replace(state, status="error", sequence=event.sequence)
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


def _step_started(state: TaskState, event: StepStarted) -> TaskState:
    """A first attempt appends its step (all earlier ones must have succeeded); a retry follows a failure."""
    if state.current_step is not None:
        raise InvalidTransition(f"task {state.task_id!r} already has an attempt in progress")
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
        complete_by=event.complete_by,
        calls_allowed=event.calls_allowed,
    )
    steps = (*state.steps[:index], started, *state.steps[index + 1 :])
    return replace(state, status="running", sequence=event.sequence, steps=steps, current_step=index)


def _attempt_in_progress(state: TaskState, step: str, attempt: str) -> tuple[int, StepState]:
    """The step whose attempt ``attempt`` is in progress: only that attempt's outcome can be recorded."""
    if state.current_step is None:
        raise InvalidTransition(f"task {state.task_id!r} has no attempt in progress")
    current = state.steps[state.current_step]
    if current.name != step or current.attempt_id != attempt:
        raise InvalidTransition(
            f"attempt {attempt} of step {step!r} is not in progress (current: {current.attempt_id})"
        )
    return state.current_step, current


def _with_step(state: TaskState, event: Event, index: int, step: StepState) -> TaskState:
    """``state`` with the attempt at ``index`` ended: no step is in progress until the next one starts."""
    steps = (*state.steps[:index], step, *state.steps[index + 1 :])
    return replace(state, sequence=event.sequence, steps=steps, current_step=None)
