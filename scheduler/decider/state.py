"""What a task is, as the fold of its events: its status, its steps, and each attempt's clock.

Kept apart from the transitions that build it because everything else (the decision handlers, the
scheduler service, the API's terminal states) reads a state and never needs to know how it was made.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

from scheduler.workflow import Workflow
from schemas.states import FINAL, TERMINAL, StepStatus, TaskStatus


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
class Timer:
    """A waiting step's timer: attempt number ``attempt`` (forward or of the undo) starts at ``not_before``.

    A ``RetryDue`` starts it only if it names this timer exactly, so an old or repeated one changes nothing.
    """

    attempt: int
    not_before: datetime
    reason: str
    compensation: bool = False


@dataclass(frozen=True)
class CompensationState:
    """The compensation of one step, as far as it got: its attempts, budget spent and outcome.

    Counted apart from the forward step's because it is a different call with its own budget; its
    attempt numbers are the fencing tokens of the compensating call. ``rounds``: the long back-offs it
    waited out (``Compensation.backoff_rounds``).
    """

    attempt: int = 0
    attempt_id: str | None = None
    lease: Lease | None = None
    failure_count: int = 0
    calls_used: int = 0
    calls_allowed: int = 0
    output: dict[str, Any] | None = None
    error: str | None = None
    rounds: int = 0


@dataclass(frozen=True)
class StepState:
    """One step of a task, as far as the task got: a step appears when its first attempt starts.

    ``calls_used`` only grows within a round and never exceeds the step's ``attempt_budget``; an
    operator's resubmit opens a new round. ``calls_allowed`` is what the current (or last) attempt was
    granted, kept so a timed-out attempt can be charged in full. ``error`` is the last failure's, kept
    across retries for operators. A ``waiting`` step has a ``timer`` for its next attempt (forward, or of
    its undo while the task compensates) and no attempt in progress. ``rounds`` counts the long back-offs
(a ``backoff`` escalation) the step has waited out, each followed by a fresh round of attempts.
    ``first_started_at``: when the step's first attempt started (again after an operator's resubmit), the
    start of the total time a workflow may bound its retries by (``Workflow.step_total_s``).
    """

    name: str
    status: StepStatus = StepStatus.PENDING
    attempt: int = 0
    attempt_id: str | None = None
    lease: Lease | None = None
    failure_count: int = 0
    calls_used: int = 0
    calls_allowed: int = 0
    output: dict[str, Any] | None = None
    error: str | None = None
    compensation: CompensationState = field(default_factory=CompensationState)
    timer: Timer | None = None
    rounds: int = 0
    first_started_at: datetime | None = None

    @property
    def lock(self) -> str | None:
        """The attempt in progress (``locked_by``): the forward one, or the compensation's."""
        if self.status == StepStatus.PROCESSING:
            return self.attempt_id
        if self.status == StepStatus.COMPENSATING:
            return self.compensation.attempt_id
        return None

    @property
    def current_lease(self) -> Lease | None:
        """The clock of the attempt in progress: the forward one, or the compensation's."""
        if self.status == StepStatus.PROCESSING:
            return self.lease
        if self.status == StepStatus.COMPENSATING:
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
    ``erased``: the task's data key was deleted; its sealed values stay in the state as they are, opaque.
    ``current_step`` is the step with an attempt in progress, forward or compensating. ``commands`` are
    the operator command ids already answered, so a repeated command changes nothing. ``rejection``: why a
    rejected task was refused, so a repeat refused for the same lasting reason (invalid input) changes nothing.
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
    erased: bool = False
    rejection: str | None = None

    @property
    def is_terminal(self) -> bool:
        return self.status in TERMINAL

    def settled(self) -> TaskState:
        """What a task that reached a final status (``FINAL``) keeps: no input, outputs, errors or clocks.

        Nothing can start an attempt of a completed or compensated task again, so all a command can still
        need is the submission's digest (a repeat changes nothing, other data is refused), the status, the
        sequence, the steps' names, statuses and attempt counts (a late answer is recorded as the fact it is)
        and the operator command ids already answered. Kept in memory and in the scheduler's restore, this is
        a few hundred bytes per finished task, whatever its input and outputs held.
        """
        if self.status not in FINAL:
            raise ValueError(f"task {self.task_id!r} is {self.status}: only a finished task is settled")
        return replace(self, input={}, steps=tuple(
            replace(step, lease=None, output=None, error=None, first_started_at=None,
                    compensation=replace(step.compensation, lease=None, output=None, error=None))
            for step in self.steps))

    def step_input(self) -> dict[str, Any]:
        """What the next attempt's agent gets: the task input and the outputs of the steps before it."""
        return {
            "task": self.input,
            "steps": {step.name: step.output for step in self.steps if step.status == StepStatus.SUCCEEDED},
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


_MAY_BE_APPLIED: frozenset[StepStatus] = frozenset({StepStatus.SUCCEEDED, StepStatus.FAILED, StepStatus.WAITING})
"""Step statuses, outside an attempt in progress, of a step whose effect may exist and has not been undone."""
_UNDO_CANDIDATES: frozenset[StepStatus] = _MAY_BE_APPLIED | {StepStatus.COMPENSATION_FAILED}
