"""What a task is, as the fold of its events: its status, its steps, and each attempt's clock.

Kept apart from the transitions that build it because everything else (the decision handlers, the
scheduler service, the API's terminal states) reads a state and never needs to know how it was made.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Literal

from scheduler.workflow import Workflow

TaskStatus = Literal[
    "accepted", "running", "completed", "error", "rejected", "compensating", "compensated", "compensation_failed"
]
StepStatus = Literal[
    "pending", "processing", "succeeded", "failed", "compensating", "compensated", "compensation_failed",
    "compensation_skipped",
]
TERMINAL: frozenset[str] = frozenset({"completed", "error", "rejected", "compensated", "compensation_failed"})
"""Task statuses no agent result or recovery can leave: a terminal task only records ignored messages."""
ERASABLE: frozenset[str] = frozenset({"completed", "error", "compensated", "compensation_failed"})
"""Task statuses whose data may be erased: ended, with nothing in flight that needs it. A task in ``error`` or
``compensation_failed`` may be erased too, and is then left as it is: nothing can run or undo it any more."""
FINAL: frozenset[str] = frozenset({"completed", "compensated"})
"""Terminal statuses nothing can leave. ``error`` and ``compensation_failed`` wait for an operator;
``rejected`` is left by a repeat of the same submission once admission control has room (a client told
to retry later retries under the same task id, its idempotency key)."""


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
    ``erased``: the task's data key was deleted; its sealed values stay in the state as they are, opaque.
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
    erased: bool = False

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
