"""The scheduler's write side as a pure decider: ``decide`` turns a command and a task's state into
events, ``evolve`` applies one event to a state, ``fold`` replays a history into a state.

Nothing here does I/O or reads a clock or a random source: the caller passes ``now`` and the number of
tasks in flight, and event ids are derived from the task id and sequence number. Deciding the same
command on the same state therefore always yields the same events, which is what lets a scheduler that
took over a partition (or an operator replaying ``events``) arrive at exactly the state its predecessor
had, and what lets tests compare decisions by value.

State is only ever a fold of events. ``decide`` builds its events by evolving a working copy of the
state as it goes, so every decision it returns has already passed ``evolve``'s transition checks.

An attempt is *queued* from ``StepStarted`` until its agent acknowledges taking the request
(``AttemptAccepted``, recorded as ``StepAccepted``): only its start-by runs meanwhile, and its work
deadline (complete-by) is counted from the acknowledgement, so waiting behind other requests never fails a
step. Recoveries wait for the deadline in force; a result needs no acknowledgement before it; a second
acknowledgement, or one for another attempt, changes nothing.

Compensation is part of the same machine. When a step gives up and its workflow's policy is
``compensate`` (or an operator cancels a running task, or orders compensation of a task in error), the
task goes to ``compensating``: ``CompensationStarted`` names the steps that *may have been applied*, last
started first, and each is undone by its compensation's agent in attempts that are locked, timed, budgeted
and recovered exactly like forward attempts, or recorded as having nothing to undo. The task ends
``compensated``, or ``compensation_failed`` with an operator alert naming the step that could not be
undone; nothing is undone out of order, so the steps before it stay as they were until an operator
retries it.

"May have been applied" is every step any attempt of which started, not only the ones that reported
success. An attempt that timed out, was abandoned by a cancel, failed after a call whose answer was lost,
or answered too late may have left its effect at the service; and agent requests are delivered at least
once, so even an attempt that reported "no call made" can be redelivered and call. Compensating actions
are therefore required to be safe when the forward action never happened, and each undo carries the
forward step's idempotency key so the service refuses every later forward call with it (a tombstone):
once a step is undone, no attempt of it still in flight or redelivered can apply anything, which is what
makes ``compensated`` mean that nothing is left held. A definite answer that arrives for an attempt that
is no longer current is recorded as the fact it is (``LateResultRecorded``), never silently dropped.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any, Literal, TypeAlias

import orjson

from scheduler.workflow import Compensation, Workflow, WorkflowNotFoundError, WorkflowRegistry
from schemas.messages import (
    AttemptAccepted,
    CompensationRetried,
    CompensationStarted,
    Event,
    LateResultRecorded,
    MessageIgnored,
    OperatorAlert,
    OperatorCommand,
    OperatorCommandRefused,
    RecoverStep,
    StepAccepted,
    StepCompensated,
    StepCompensationFailed,
    StepCompensationSkipped,
    StepCompensationStarted,
    StepFailed,
    StepResubmitted,
    StepResult,
    StepStarted,
    StepSucceeded,
    SubmitTask,
    TaskAccepted,
    TaskCompensated,
    TaskCompensationFailed,
    TaskCompleted,
    TaskFailed,
    TaskRejected,
)

TaskStatus = Literal[
    "accepted", "running", "completed", "error", "rejected", "compensating", "compensated", "compensation_failed"
]
StepStatus = Literal[
    "pending", "processing", "succeeded", "failed", "compensating", "compensated", "compensation_failed",
    "compensation_skipped",
]
TERMINAL: frozenset[str] = frozenset({"completed", "error", "rejected", "compensated", "compensation_failed"})
"""Task statuses no agent result or recovery can leave: a terminal task only records ignored messages."""
FINAL: frozenset[str] = frozenset({"completed", "compensated"})
"""Terminal statuses nothing can leave. ``error`` and ``compensation_failed`` wait for an operator;
``rejected`` is left by a repeat of the same submission once admission control has room (a client told
to retry later retries under the same task id, its idempotency key)."""

Command: TypeAlias = SubmitTask | StepResult | RecoverStep | OperatorCommand | AttemptAccepted
_RECORDS = (MessageIgnored, LateResultRecorded, OperatorAlert, OperatorCommandRefused)
"""Events that record something for operators and change nothing but the sequence (and seen commands)."""

# Event ids are uuid5(task id, sequence): unique within the log (a task's sequence numbers never repeat)
# and the same every time the same decision is made again.
_EVENT_IDS = uuid.uuid5(uuid.NAMESPACE_URL, "urn:stepstream:event")


class InvalidTransition(ValueError):
    """An event cannot follow the state it is applied to: a sequence gap or an impossible transition.

    Raised by ``evolve``; seen at replay time it means the event log is corrupt or was written by a
    buggy decider, and folding must stop rather than guess.
    """


@dataclass(frozen=True)
class Lease:
    """The clock of one attempt: handed over at ``started_at``, to be taken by an agent by ``start_by``,
    taken at ``accepted_at``, its work to end by ``complete_by``.

    While *queued* (no agent has acknowledged it) its deadline is ``start_by``, and ``complete_by`` is only
    the latest its work could end (``start_by`` + timeout); once accepted, ``complete_by`` is counted from
    ``accepted_at``. An attempt started without ``start_by`` (events written before acknowledgements)
    runs against ``complete_by`` from its start.
    """

    started_at: datetime
    complete_by: datetime
    start_by: datetime | None = None
    accepted_at: datetime | None = None

    @property
    def queued(self) -> bool:
        return self.start_by is not None and self.accepted_at is None

    @property
    def deadline(self) -> datetime:
        """Start-by while queued, complete-by once running: what the supervisor waits for before recovering."""
        if self.start_by is not None and self.accepted_at is None:
            return self.start_by
        return self.complete_by

    @property
    def timeout(self) -> timedelta | None:
        """While queued, the length of the work deadline the attempt was granted (None once running)."""
        return self.complete_by - self.start_by if self.start_by is not None and self.accepted_at is None else None


@dataclass(frozen=True)
class CompensationState:
    """The compensation of one step, as far as it got: its attempts, budget spent and outcome.

    Counted apart from the forward step's because it is a different call with its own budget; its
    attempt numbers are the fencing tokens of the compensating call.
    """

    attempt: int = 0
    attempt_id: str | None = None
    lease: Lease | None = None
    failure_count: int = 0
    calls_used: int = 0
    calls_allowed: int = 0
    output: dict[str, Any] | None = None
    error: str | None = None


@dataclass(frozen=True)
class StepState:
    """One step of a task, as far as the task got: a step appears when its first attempt starts.

    ``calls_used`` only grows within a round and never exceeds the step's ``attempt_budget``; an
    operator's resubmit opens a new round. ``calls_allowed`` is what the current (or last) attempt was
    granted, kept so a timed-out attempt can be charged in full. ``error`` is the last failure's, kept
    across retries for operators.
    """

    name: str
    status: StepStatus = "pending"
    attempt: int = 0
    attempt_id: str | None = None
    lease: Lease | None = None
    failure_count: int = 0
    calls_used: int = 0
    calls_allowed: int = 0
    output: dict[str, Any] | None = None
    error: str | None = None
    compensation: CompensationState = field(default_factory=CompensationState)

    @property
    def lock(self) -> str | None:
        """The attempt in progress (``locked_by``): the forward one, or the compensation's."""
        if self.status == "processing":
            return self.attempt_id
        if self.status == "compensating":
            return self.compensation.attempt_id
        return None

    @property
    def current_lease(self) -> Lease | None:
        """The clock of the attempt in progress: the forward one, or the compensation's."""
        if self.status == "processing":
            return self.lease
        if self.status == "compensating":
            return self.compensation.lease
        return None

    @property
    def deadline(self) -> datetime | None:
        """Of the attempt in progress: its start-by while queued, its complete-by once an agent took it."""
        lease = self.current_lease
        return None if lease is None else lease.deadline


@dataclass(frozen=True)
class TaskState:
    """A task as the fold of its events. ``sequence`` is its version: the last event's sequence.

    A rejected task keeps the digest and addressee of its submission but not its input (``{}``): that is
    enough to tell a repeat from a contradiction, without storing payloads that were never admitted.
    ``current_step`` is the step with an attempt in progress, forward or compensating. ``commands`` are
    the operator command ids already answered, so a repeated command changes nothing.
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
    commands: frozenset[str] = frozenset()

    @property
    def is_terminal(self) -> bool:
        return self.status in TERMINAL

    def step_input(self) -> dict[str, Any]:
        """What the next attempt's agent gets: the task input and the outputs of the steps before it."""
        return {
            "task": self.input,
            "steps": {step.name: step.output for step in self.steps if step.status == "succeeded"},
        }

    def compensation_input(self, index: int) -> dict[str, Any]:
        """What a compensation's agent gets: the task input, the step's output and the outputs before it.

        The same for every attempt of the compensation (outputs never change once recorded), which the
        remote service requires of requests sharing an idempotency key.
        """
        return {
            "task": self.input,
            "steps": {step.name: step.output for step in self.steps[: index + 1] if step.output is not None},
        }

    def undo_plan(self) -> list[str]:
        """The steps a compensation starting now must undo, in order: every step that may have been applied.

        A step appears in ``steps`` when its first attempt starts, and steps start one after another, so
        this is every step present that is not undone yet, last started first (see the module docstring
        for why a failed step counts).
        """
        return [step.name for step in reversed(self.steps) if step.status in _MAY_BE_APPLIED]

    def not_undone(self, workflow: Workflow) -> list[str]:
        """The steps whose effect may still be held, in undo order: started, with an undo not yet done."""
        return [step.name for step in reversed(self.steps)
                if step.status in _UNDO_CANDIDATES and workflow.step(step.name).compensation is not None]

    def undo_candidate(self) -> int | None:
        """The step to undo next: the last started one not yet undone (or whose undoing failed)."""
        for index in range(len(self.steps) - 1, -1, -1):
            if self.steps[index].status in _UNDO_CANDIDATES:
                return index
        return None


_MAY_BE_APPLIED: frozenset[str] = frozenset({"succeeded", "failed"})
"""Step statuses, outside an attempt in progress, of a step whose effect may exist and has not been undone."""
_UNDO_CANDIDATES: frozenset[str] = _MAY_BE_APPLIED | {"compensation_failed"}


DEFAULT_MAX_IN_FLIGHT = 2_000
"""Non-terminal tasks per inbox partition before submissions are rejected: what the system can work off
well within a queued step's start-by. Measured on the reference machine (BENCHMARKS.md, issue 12 item 3),
the whole system completes about 310 steps/s with a 50 ms service; a backlog of N tasks (3 steps each)
takes 3N/310 s, and the last request of it waits about that long for an agent. 6 partitions x 2,000 =
12,000 tasks is about 116 s of work, under half the default start-by of 300 s: a burst the system admits
is worked off without an attempt expiring queued, one past it is refused at the door (``TaskRejected``,
HTTP 429) instead of failing in the middle. Faster machines or more agents can raise it, in proportion."""


@dataclass(frozen=True)
class Limits:
    """Bounds the decider enforces. ``max_in_flight`` is per scheduler partition (admission control)."""

    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT

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


def compensation_attempt_id(task_id: str, step: str, attempt: int) -> str:
    """The lock of one compensation attempt; ``undo`` keeps it apart from every forward attempt id."""
    return f"{task_id}:{step}:undo:{attempt}"


def idempotency_key(task_id: str, step: str) -> str:
    """The key the remote service deduplicates a step's calls by: the same across all its attempts."""
    return f"{task_id}:{step}"


def compensation_idempotency_key(task_id: str, step: str) -> str:
    """The key of a step's compensating call: stable across its attempts, distinct from the step's own."""
    return f"{task_id}:{step}:undo"


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
        return _resubmit(command, state, registry, now, in_flight, limits)
    if state is None:
        return Decision((), dead_letter=f"unknown task {command.task_id!r}")
    builder = _Builder.on(command, state, now)
    if isinstance(command, OperatorCommand):
        return _on_operator(builder, command, registry)
    reason = _not_current(state, command)
    if reason is None and isinstance(command, RecoverStep):
        reason = _deadline_not_passed(_current(state)[1], now)
    if reason is None and isinstance(command, AttemptAccepted):
        reason = _not_queued(_current(state)[1])
    if reason is not None and isinstance(command, StepResult) and _record_late_result(builder, command):
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
        _on_accepted(builder, command)
        return builder.decision()
    try:
        workflow = registry.get(state.workflow, state.workflow_version)
    except WorkflowNotFoundError as exc:
        return Decision((), dead_letter=f"unknown workflow {state.workflow!r} v{state.workflow_version}: {exc}")
    undoing = _current(state)[1].status == "compensating"
    if isinstance(command, StepResult):
        (_on_compensation_result if undoing else _on_result)(builder, workflow, command)
    else:
        (_on_compensation_timeout if undoing else _on_timeout)(builder, workflow, command)
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
           limits: Limits, rejected: TaskState | None = None) -> Decision:
    """A first submission, or the repeat of a ``rejected`` one: pin the workflow version, then reject
    (past the bound) or accept and start."""
    version = command.workflow_version if rejected is None else rejected.workflow_version  # pinned already
    try:
        workflow = registry.get(command.workflow, version)
    except WorkflowNotFoundError as exc:
        wanted = "latest" if version is None else f"v{version}"
        return Decision((), dead_letter=f"unknown workflow {command.workflow!r} ({wanted}): {exc}")
    builder = (_Builder(command, None, now, workflow.name, workflow.version) if rejected is None
               else _Builder.on(command, rejected, now))
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


def _resubmit(command: SubmitTask, state: TaskState, registry: WorkflowRegistry, now: datetime, in_flight: int,
              limits: Limits) -> Decision:
    """The same task id again: a no-op if it is the same submission, else a contradiction for the DLQ.

    Nothing of the existing task is overwritten either way, whatever its status; the contradiction is
    recorded on the task as an operator alert so it shows where operators look for the task. The one
    exception is a task that admission control rejected: the same submission again asks for admission
    again (and is rejected again, visibly, while the system is still full).
    """
    version = state.workflow_version if command.workflow_version is None else command.workflow_version
    digest = input_digest(command.workflow, version, command.input)
    if command.workflow == state.workflow and digest == state.input_digest:
        if state.status == "rejected":
            return _admit(command, registry, now, in_flight, limits, rejected=state)
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


def _not_current(state: TaskState, command: StepResult | RecoverStep | AttemptAccepted) -> str | None:
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


def _record_late_result(builder: _Builder, result: StepResult) -> bool:
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
        now = {"compensated": "the step is recorded as undone",
               "compensating": "an undo attempt with the same key is in progress and will get the same answer"}
        return f"late answer from an undo of step {step.name!r}: {what}; " + now.get(
            step.status, f"the step is {step.status}: a retried undo uses the same key")
    by_status = {
        "succeeded": "the step already succeeded with the same idempotency key",
        "processing": f"attempt {step.attempt_id} in progress uses the same idempotency key and gets it replayed",
        "compensating": "its undo is in progress",
        "compensated": "its undo fenced the key at the service, so this effect landed before the undo and was "
                       "released by it",
        "compensation_skipped": "the step declares no compensating action: the effect stays",
        "compensation_failed": "its undo failed: retry-compensation undoes it",
        # A failed step is the last started; a compensation undoes it first, so only a task in error has one.
        "failed": "compensating the task undoes it; resubmitting the step replays it",
    }
    return f"late answer for step {step.name!r}: {what}; {by_status.get(step.status, f'the step is {step.status}')}"


def _deadline_not_passed(current: StepState, now: datetime) -> str | None:
    """A recovery is conditional on the deadline in force: start-by for a queued attempt, complete-by for a
    running one (the supervisor's clock may run ahead of the scheduler's, and its view behind the log)."""
    lease = current.current_lease
    if lease is None or now >= lease.deadline:
        return None
    if lease.queued:
        return f"start-by not passed: attempt {current.lock} may wait for an agent until {lease.deadline.isoformat()}"
    return f"deadline not passed: attempt {current.lock} may run until {lease.deadline.isoformat()}"


def _not_queued(current: StepState) -> str | None:
    """An acknowledgement starts the work deadline once: a redelivered request's second one changes nothing."""
    lease = current.current_lease
    if lease is None or lease.queued:
        return None
    if lease.accepted_at is None:
        return f"attempt {current.lock} runs from its start (no start-by): nothing to accept"
    return (f"attempt {current.lock} already accepted at {lease.accepted_at.isoformat()}: its deadline stays "
            f"{lease.complete_by.isoformat()}")


def _on_accepted(builder: _Builder, accepted: AttemptAccepted) -> None:
    """An agent took the queued attempt in progress: its work deadline runs from ``accepted_at``.

    The length is the one the attempt was granted (start-by to latest end), and the deadline is never
    later than that latest end: the agent computes the same instant from its request, so both sides
    agree on when the attempt's work must stop.
    """
    _index, current = _current(builder.state)
    lease = current.current_lease
    if lease is None or lease.timeout is None:
        raise ValueError(f"attempt {current.lock} is not queued")
    builder.emit(
        StepAccepted,
        step=current.name,
        attempt_id=current.lock,
        compensation=current.status == "compensating",
        accepted_at=accepted.accepted_at,
        complete_by=min(accepted.accepted_at + lease.timeout, lease.complete_by),
        waited_ms=max(0, (accepted.accepted_at - lease.started_at) // timedelta(milliseconds=1)),
    )


def _alert_overspend(builder: _Builder, step: str, attempt: str | None, reported: int, allowed: int) -> None:
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


# ---- forward steps ------------------------------------------------------------------------------


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
    _alert_overspend(builder, current.name, current.attempt_id, result.calls, current.calls_allowed)
    if result.ok:
        if index + 1 < len(workflow.steps):
            _start_attempt(builder, workflow, index + 1)
        else:
            outputs = {step.name: step.output for step in builder.state.steps}
            builder.emit(TaskCompleted, output=outputs)
    elif result.permanent:
        _escalate(builder, workflow, current.name, f"permanent failure of step {current.name!r}: {error}")
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
        error=_expiry(current.attempt_id, current.lease, recover),
        permanent=False,
        timed_out=True,
        calls=current.calls_allowed,
        failure_count=current.failure_count + 1,
    )
    _retry_or_escalate(builder, workflow, index)


def _expiry(attempt: str | None, lease: Lease | None, recover: RecoverStep) -> str:
    """Why an expired attempt failed: no agent took it in time, or its work outlived its deadline."""
    if lease is not None and lease.queued:
        return f"attempt {attempt} was not taken by an agent before its start-by: {recover.reason}"
    return f"attempt {attempt} timed out: {recover.reason}"


def _retry_or_escalate(builder: _Builder, workflow: Workflow, index: int) -> None:
    """Below the workflow's failure threshold, a transiently failed step gets another attempt."""
    step = builder.state.steps[index]
    if step.failure_count >= workflow.failure_threshold:
        _escalate(
            builder,
            workflow,
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
            workflow,
            step.name,
            f"attempt budget exhausted: step {step.name!r} used {prior.calls_used} of its "
            f"{step.attempt_budget} calls",
        )
        return
    attempt = prior.attempt + 1
    start_by = builder.now + timedelta(seconds=step.queue_timeout_s)
    builder.emit(
        StepStarted,
        step=step.name,
        step_index=index,
        attempt=attempt,
        attempt_id=attempt_id(builder.state.task_id, step.name, attempt),
        start_by=start_by,
        complete_by=start_by + timedelta(seconds=step.timeout_s),
        calls_allowed=allowed,
    )


def _escalate(builder: _Builder, workflow: Workflow, step: str, reason: str) -> None:
    """Give up on a step: the one place that decides what that does to its task.

    Every path that stops retrying comes here. The workflow's policy chooses: ``error`` stops the task
    with an operator alert (an operator may resubmit the step or order compensation); ``compensate``
    undoes the completed steps at once, and alerts only if that fails.
    """
    if workflow.escalation == "compensate":
        _begin_compensation(builder, workflow, "escalation", reason, step=step)
        return
    builder.emit(TaskFailed, step=step, reason=reason)
    builder.emit(OperatorAlert, step=step, reason=reason)


# ---- compensation -------------------------------------------------------------------------------


def _begin_compensation(builder: _Builder, workflow: Workflow, trigger: Literal["escalation", "operator", "cancel"],
                        reason: str, *, step: str | None = None, command: OperatorCommand | None = None) -> None:
    """Record the plan (every step that may have been applied, last started first) and start undoing it."""
    plan = builder.state.undo_plan()
    builder.emit(CompensationStarted, trigger=trigger, reason=reason, steps=plan, step=step,
                 command_id=command.command_id if command else None, operator=command.operator if command else None)
    _compensate_next(builder, workflow)


def _compensate_next(builder: _Builder, workflow: Workflow) -> None:
    """Undo the last started step not yet undone; a step without a compensation has nothing to undo."""
    while (index := builder.state.undo_candidate()) is not None:
        spec = workflow.steps[index]
        if spec.compensation is None:
            builder.emit(StepCompensationSkipped, step=spec.name,
                         reason=f"step {spec.name!r} declares no compensating action: nothing to undo")
            continue
        _start_compensation_attempt(builder, workflow, index)
        return
    builder.emit(TaskCompensated)


def _start_compensation_attempt(builder: _Builder, workflow: Workflow, index: int) -> None:
    """Hand the next attempt of step ``index``'s compensation to its agent, within the compensation's budget."""
    spec = workflow.steps[index]
    compensation = spec.compensation
    if compensation is None:
        raise ValueError(f"step {spec.name!r} has no compensation to attempt")
    prior = builder.state.steps[index].compensation
    allowed = min(compensation.calls_per_attempt, compensation.attempt_budget - prior.calls_used)
    if allowed <= 0:
        _compensation_failed(
            builder,
            workflow,
            spec.name,
            f"compensation budget exhausted: the compensation of step {spec.name!r} used {prior.calls_used} "
            f"of its {compensation.attempt_budget} calls",
        )
        return
    attempt = prior.attempt + 1
    not_before = _forward_landed_by(builder.state.steps[index], compensation)
    start_by = max(builder.now, not_before or builder.now) + timedelta(seconds=compensation.queue_timeout_s)
    builder.emit(
        StepCompensationStarted,
        step=spec.name,
        step_index=index,
        attempt=attempt,
        attempt_id=compensation_attempt_id(builder.state.task_id, spec.name, attempt),
        start_by=start_by,
        complete_by=start_by + timedelta(seconds=compensation.timeout_s),
        calls_allowed=allowed,
        not_before=not_before if not_before is not None and not_before > builder.now else None,
    )


def _forward_landed_by(step: StepState, compensation: Compensation) -> datetime | None:
    """When no forward attempt of ``step`` can land any more, for a service that cannot refuse a late one:
    the last attempt's latest end plus how long a call may still take to land (None: the service fences)."""
    if compensation.fenced or step.lease is None:
        return None
    assert compensation.forward_may_land_s is not None
    return step.lease.complete_by + timedelta(seconds=compensation.forward_may_land_s)


def _on_compensation_result(builder: _Builder, workflow: Workflow, result: StepResult) -> None:
    """The current compensation attempt's agent answered: undo the next step, retry, or give up."""
    index, current = _current(builder.state)
    undo = current.compensation
    charged = min(result.calls, undo.calls_allowed)
    if result.ok:
        builder.emit(StepCompensated, step=current.name, attempt_id=undo.attempt_id, output=result.output or {},
                     calls=charged)
    else:
        error = result.error or "the agent reported a failure without detail"
        builder.emit(StepCompensationFailed, step=current.name, attempt_id=undo.attempt_id, error=error,
                     permanent=result.permanent, calls=charged, failure_count=undo.failure_count + 1)
    _alert_overspend(builder, current.name, undo.attempt_id, result.calls, undo.calls_allowed)
    if result.ok:
        _compensate_next(builder, workflow)
    elif result.permanent:
        _compensation_failed(builder, workflow, current.name,
                             f"permanent failure of the compensation of step {current.name!r}: {error}")
    else:
        _retry_compensation_or_fail(builder, workflow, index)


def _on_compensation_timeout(builder: _Builder, workflow: Workflow, recover: RecoverStep) -> None:
    """The compensation attempt's deadline passed: charged in full, like a forward attempt that never answered."""
    index, current = _current(builder.state)
    undo = current.compensation
    builder.emit(
        StepCompensationFailed,
        step=current.name,
        attempt_id=undo.attempt_id,
        error=_expiry(undo.attempt_id, undo.lease, recover),
        permanent=False,
        timed_out=True,
        calls=undo.calls_allowed,
        failure_count=undo.failure_count + 1,
    )
    _retry_compensation_or_fail(builder, workflow, index)


def _retry_compensation_or_fail(builder: _Builder, workflow: Workflow, index: int) -> None:
    """The workflow's failure threshold bounds a compensation's failed attempts as it bounds a step's."""
    step = builder.state.steps[index]
    if step.compensation.failure_count >= workflow.failure_threshold:
        _compensation_failed(
            builder,
            workflow,
            step.name,
            f"failure threshold reached: {step.compensation.failure_count} failed attempts of the compensation "
            f"of step {step.name!r} (threshold {workflow.failure_threshold})",
        )
    else:
        _start_compensation_attempt(builder, workflow, index)


def _compensation_failed(builder: _Builder, workflow: Workflow, step: str, reason: str) -> None:
    """A step cannot be undone: stop (undoing earlier steps first could break their order) and tell a person
    exactly which steps may still hold something at their services."""
    not_undone = builder.state.not_undone(workflow)
    reason = f"{reason}; not undone, so possibly still held: {', '.join(not_undone)}"
    builder.emit(TaskCompensationFailed, step=step, reason=reason, not_undone=not_undone)
    builder.emit(OperatorAlert, step=step, reason=reason)


# ---- operator commands --------------------------------------------------------------------------


def _on_operator(builder: _Builder, command: OperatorCommand, registry: WorkflowRegistry) -> Decision:
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
            _start_attempt(builder, workflow, index)
        case "retry-compensation":
            assert index is not None
            builder.emit(CompensationRetried, step=state.steps[index].name, command_id=command.command_id,
                         operator=command.operator)
            _start_compensation_attempt(builder, workflow, index)
        case "compensate":
            _begin_compensation(builder, workflow, "operator",
                                f"compensation ordered by {who} (command {command.command_id})", command=command)
        case "cancel":
            if state.current_step is not None:
                _abandon(builder, command)
            _begin_compensation(builder, workflow, "cancel",
                                f"task cancelled by {who} (command {command.command_id})", command=command)
    return builder.decision()


def _abandon(builder: _Builder, command: OperatorCommand) -> None:
    """End the attempt in flight of a cancelled task; its agent's late answer will name a stale attempt.

    Charged its whole allowance, like a timeout: how many calls it made is unknown.
    """
    _index, current = _current(builder.state)
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
    if action in ("compensate", "cancel"):
        if command.step is not None:
            return f"{action} acts on the whole task: it takes no step", None
        if action == "compensate" and status != "error":
            return (f"task is {status}{doing}: only a task in error can be compensated "
                    "(cancel a running task; retry-compensation after compensation_failed)"), None
        if action == "cancel" and status not in ("accepted", "running"):
            return f"task is {status}: only a running task can be cancelled", None
        return None, None
    wanted: StepStatus = "failed" if action == "resubmit" else "compensation_failed"
    needed = "error" if action == "resubmit" else "compensation_failed"
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


# ---- evolve -------------------------------------------------------------------------------------

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
