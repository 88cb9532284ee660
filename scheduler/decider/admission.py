"""Admission: a submission pinned to a workflow version, checked, then accepted and started or rejected.

The door refuses, as ``TaskRejected`` naming why, a submission of a workflow or version this scheduler does
not run, one whose input its version's input model refuses (naming the field: the scheduler trusts no
producer, so it checks what the edges check), and one past the in-flight bound. The first two also go to
the DLQ with the reason. A repeat of the same submission is a no-op and one that contradicts it goes to the
DLQ, but a repeat of a rejected one asks for admission again: once a scheduler runs its version, or the
system has room, it is admitted, so a rollout loses nothing refused meanwhile. An input refused by its
version's model can never pass with the same data: its repeat changes nothing. The door's rules in one
module, apart from running the steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from scheduler.decider.decision import Builder, Decision
from scheduler.decider.forward import start_attempt
from scheduler.decider.ids import input_digest
from scheduler.decider.state import TaskState
from scheduler.workflow import WorkflowNotFoundError, WorkflowRegistry
from schemas.messages import OperatorAlert, RejectionCause, SubmitTask, TaskAccepted, TaskRejected
from schemas.states import TaskStatus

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


def admit(command: SubmitTask, registry: WorkflowRegistry, now: datetime, in_flight: int,
           limits: Limits, rejected: TaskState | None = None) -> Decision:
    """A first submission, or the repeat of a ``rejected`` one: pin the workflow version, check the
    workflow and the input, then reject (past the bound) or accept and start.

    A submission naming no version of a workflow this scheduler does not run at all is pinned to v1, the
    first version of any workflow: its repeat, once the workflow runs, is admitted under v1."""
    version = command.workflow_version if rejected is None else rejected.workflow_version  # pinned already
    try:
        workflow = registry.get(command.workflow, version)
    except WorkflowNotFoundError as exc:
        return _refuse(command, rejected, now, version or 1, f"not run by this scheduler: {exc}"
                       f"{_running(registry, command.workflow)}", "unknown_version")
    errors = workflow.input_errors(command.input, sealed=True)
    if errors:
        reason = f"invalid input for {workflow.name!r} v{workflow.version}: " + "; ".join(
            f"{where or 'input'}: {message}" for where, message in errors)
        if rejected is not None and rejected.rejection == reason:
            return Decision(())  # the same data can never pass: refused already, it stays so
        return _refuse(command, rejected, now, workflow.version, reason, "invalid_input")
    if in_flight >= limits.max_in_flight:
        reason = f"admission control: {in_flight} tasks in flight, the limit is {limits.max_in_flight}"
        return _refuse(command, rejected, now, workflow.version, reason, "admission_control")
    builder = _builder(command, rejected, now, workflow.version)
    builder.emit(TaskAccepted, input=command.input, retention_s=workflow.sensitive_retention_s,
                 **_submission(command, workflow.version))
    start_attempt(builder, workflow, 0)
    return builder.decision()


def _refuse(command: SubmitTask, rejected: TaskState | None, now: datetime, version: int, reason: str,
            cause: RejectionCause) -> Decision:
    """``TaskRejected`` (the store and the submitter's reply topic say why); a submission that is wrong in
    itself, not merely early for a full system, goes to the DLQ too."""
    builder = _builder(command, rejected, now, version)
    builder.emit(TaskRejected, reason=reason, cause=cause, **_submission(command, version))
    return builder.decision(dead_letter=None if cause == "admission_control" else reason)


def _builder(command: SubmitTask, rejected: TaskState | None, now: datetime, version: int) -> Builder:
    return Builder(command, None, now, command.workflow, version) if rejected is None \
        else Builder.on(command, rejected, now)


def _submission(command: SubmitTask, version: int) -> dict[str, Any]:
    """What a rejection keeps of a submission, and an acceptance too: its digest and its addressee."""
    return {"input_digest": input_digest(command.workflow, version, command.input),
            "submitter": command.submitter, "reply_topic": command.reply_topic}


def _running(registry: WorkflowRegistry, name: str) -> str:
    """What the submitter could have asked for instead."""
    versions = sorted(w.version for w in registry.workflows() if w.name == name)
    if versions:
        return f" (this scheduler runs {name!r} v{', v'.join(map(str, versions))})"
    return f" (this scheduler runs {', '.join(sorted({w.name for w in registry.workflows()})) or 'none'})"


def resubmit(command: SubmitTask, state: TaskState, registry: WorkflowRegistry, now: datetime, in_flight: int,
              limits: Limits) -> Decision:
    """The same task id again: a no-op if it is the same submission, else a contradiction for the DLQ.

    Nothing of the existing task is overwritten either way, whatever its status; the contradiction is
    recorded on the task as an operator alert so it shows where operators look for the task. The one
    exception is a rejected task: the same submission again asks for admission again (``admit``), and is
    rejected again, visibly, while the system is still full or its version still unknown here.
    """
    version = state.workflow_version if command.workflow_version is None else command.workflow_version
    digest = input_digest(command.workflow, version, command.input)
    if command.workflow == state.workflow and digest == state.input_digest:
        if state.status == TaskStatus.REJECTED:
            return admit(command, registry, now, in_flight, limits, rejected=state)
        return Decision(())
    reason = (
        f"contradictory duplicate submission of task {state.task_id!r}: {command.workflow!r} v{version} "
        f"with input digest {digest[:12]} differs from the submitted {state.workflow!r} "
        f"v{state.workflow_version} with digest {state.input_digest[:12]}"
    )
    builder = Builder.on(command, state, now)
    builder.emit(OperatorAlert, reason=reason)
    return builder.decision(dead_letter=reason)
