"""The names of task and step states: the one place they are spelt, for every topic, store and API.

They live in ``schemas`` because they travel: a submitter's reply topic carries them (``StatusUpdate``), the
state store's rows, ``/api/tasks?state=``, the ``stepstream_tasks{state=...}`` gauge, the CLI and the
dashboard show them, and the decider folds events into them. ``schemas`` is the one package every other
may import, so each of those derives its list from here instead of keeping a copy.

A new state is added here, and only here: the decider's transitions, the projection's rows, the API's
enum, ``stepstream tasks --state`` and the dashboard's tiles pick it up (the decider and the projection still
have to say when a task or step enters it). A state that is terminal goes in ``TERMINAL`` too.
"""

from __future__ import annotations

from enum import StrEnum


class TaskStatus(StrEnum):
    """Where a task stands. The order is the order the API, the CLI and the dashboard list them in.

    ``waiting`` is the store's: a running task whose step waits for its retry timer (the decider keeps the
    task ``running`` and the step ``waiting``). ``quarantined`` is the scheduler's verdict on a task whose
    history this version cannot fold (``scheduler.quarantine``): not a state of the task machine, and not
    terminal, since an operator's release lets the task go on."""

    ACCEPTED = "accepted"
    RUNNING = "running"
    WAITING = "waiting"
    COMPLETED = "completed"
    ERROR = "error"
    COMPENSATING = "compensating"
    COMPENSATED = "compensated"
    COMPENSATION_FAILED = "compensation_failed"
    REJECTED = "rejected"
    QUARANTINED = "quarantined"


class StepStatus(StrEnum):
    """Where a step stands.

    ``pending`` is the decider's only (a step row is written when its first attempt starts). The store
    splits an attempt in progress by whether an agent took it: ``queued`` then ``processing``, and
    ``compensation_queued`` then ``compensating``; the decider keeps that split in the attempt's lease
    (``Lease.queued``) and calls both halves ``processing`` (``compensating``).
    """

    PENDING = "pending"
    QUEUED = "queued"
    PROCESSING = "processing"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    COMPENSATION_QUEUED = "compensation_queued"
    COMPENSATING = "compensating"
    COMPENSATED = "compensated"
    COMPENSATION_FAILED = "compensation_failed"
    COMPENSATION_SKIPPED = "compensation_skipped"
    WAITING = "waiting"


TERMINAL: frozenset[TaskStatus] = frozenset({
    TaskStatus.COMPLETED, TaskStatus.ERROR, TaskStatus.REJECTED, TaskStatus.COMPENSATED,
    TaskStatus.COMPENSATION_FAILED,
})
"""Task statuses no agent result or recovery can leave: a terminal task only records ignored messages."""

ERASABLE: frozenset[TaskStatus] = frozenset({
    TaskStatus.COMPLETED, TaskStatus.ERROR, TaskStatus.COMPENSATED, TaskStatus.COMPENSATION_FAILED,
})
"""Task statuses whose data may be erased: ended, with nothing in flight that needs it. A task in ``error`` or
``compensation_failed`` may be erased too, and is then left as it is: nothing can run or undo it any more."""

FINAL: frozenset[TaskStatus] = frozenset({TaskStatus.COMPLETED, TaskStatus.COMPENSATED})
"""Terminal statuses nothing can leave. ``error`` and ``compensation_failed`` wait for an operator;
``rejected`` is left by a repeat of the same submission once admission control has room (a client told
to retry later retries under the same task id, its idempotency key)."""

STEPS_IN_PROGRESS: tuple[StepStatus, ...] = (
    StepStatus.QUEUED, StepStatus.PROCESSING, StepStatus.COMPENSATION_QUEUED, StepStatus.COMPENSATING)
"""Stored step statuses of an attempt in progress, forward or compensating: the ones with a deadline."""

STEPS_WAITING: tuple[StepStatus, ...] = (StepStatus.QUEUED, StepStatus.COMPENSATION_QUEUED)
"""Stored step statuses of an attempt no agent has taken yet."""

STEPS_FAILED: tuple[StepStatus, ...] = (StepStatus.FAILED, StepStatus.COMPENSATION_FAILED)
"""Step statuses whose last attempt failed, forward or compensating."""

STEP_PROGRESS: tuple[StepStatus, ...] = (StepStatus.SUCCEEDED, StepStatus.FAILED, StepStatus.COMPENSATED)
"""The step outcomes a reply topic reports, as ``step_<status>`` (``step_succeeded``, ...)."""

PROGRESS: frozenset[str] = frozenset(TaskStatus) | {f"step_{status}" for status in STEP_PROGRESS}
"""Every ``StatusUpdate.status``: a task's status, or a step's outcome."""

_FORMER: dict[str, TaskStatus] = {"received": TaskStatus.ACCEPTED, "failed": TaskStatus.ERROR}
"""Spellings reply topics carried before they used the task statuses (updates already written keep them)."""


def progress(status: str) -> str:
    """A ``StatusUpdate.status`` as read: a former spelling becomes today's, anything unknown is refused."""
    status = _FORMER.get(status, status)
    if status not in PROGRESS:
        raise ValueError(f"not a task status or step outcome: {status!r}")
    return status


def step_progress(status: StepStatus) -> str:
    """The ``StatusUpdate.status`` reporting that a step reached ``status``."""
    if status not in STEP_PROGRESS:
        raise ValueError(f"a reply topic does not report steps {status}")
    return f"step_{status}"
