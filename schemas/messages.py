"""Every message stepstream puts on Kafka: events, inbox commands, agent requests and status updates.

Each class is one Avro record type (``stepstream.<ClassName>``). Changing a class means a new schema
version: run ``python -m schemas.freeze`` and keep the old ``.avsc`` file, so old data stays readable.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from schemas.avro import utc_millis
from schemas.states import progress

Timestamp = Annotated[datetime, AfterValidator(utc_millis)]
JsonObject = dict[str, Any]

ErrorKind = Literal["throttled", "timeout", "connection", "server_error", "breaker_open", "budget_spent",
                   "permanent"]
"""Why an attempt failed, as its agent saw it: the scheduler waits differently for each (see ``StepResult``)."""


def new_id() -> str:
    return uuid.uuid4().hex


def now() -> datetime:
    return utc_millis(datetime.now(UTC))


class Message(BaseModel):
    """Fields every message carries: its own id, the task it concerns, and when it was made."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    kind: ClassVar[str] = "message"

    message_id: str = Field(default_factory=new_id, min_length=1)
    task_id: str = Field(min_length=1, max_length=200)
    occurred_at: Timestamp = Field(default_factory=now)


class Event(Message):
    """A fact on the ``events`` topic. ``sequence`` is the task's version after this event (1, 2, ...)."""

    kind: ClassVar[str] = "event"

    sequence: int = Field(ge=1)
    workflow: str = Field(min_length=1)
    workflow_version: int = Field(ge=1)
    causation_id: str = Field(min_length=1, description="message_id of the message that caused this event")


# ---- events -------------------------------------------------------------------------------------


class TaskAccepted(Event):
    """The scheduler admitted a task; ``input_digest`` tells an idempotent repeat from a contradiction."""

    input: JsonObject
    input_digest: str
    submitter: str | None = None
    reply_topic: str | None = None
    retention_s: float | None = Field(default=None, description="its workflow version's sensitive_retention_s: "
                                      "its data is erased that long after it completed or was compensated")


RejectionCause = Literal["admission_control", "unknown_version", "invalid_input"]
"""Why a submission was refused: the system was full (retry later), its workflow or version is not run by the
scheduler (submit again once one runs it), or its input fails its version's model (never with this data)."""


class TaskRejected(Event):
    """Admission control or validation refused a task; nothing of it runs.

    The submission's digest and addressee are kept (without the input itself) so that a repeat of the
    rejected submission is recognised as a repeat, not a contradiction, and the submitter can be told.
    """

    reason: str
    cause: RejectionCause | None = Field(default=None, description="None: written before causes were recorded, "
                                         "when admission control was the only one")
    input_digest: str | None = None
    submitter: str | None = None
    reply_topic: str | None = None


class StepStarted(Event):
    """An attempt of a step was handed to its agent. ``attempt_id`` is the lock (locked_by).

    The attempt is *queued* until its agent takes the request (``StepAccepted``): an agent must take it by
    ``start_by``, and its work deadline runs from that moment, so time spent waiting behind other requests
    never counts against the step's ``timeout_s``. Events written before acknowledgements existed carry no
    ``start_by``: their attempt ran against ``complete_by`` from the start.
    """

    step: str
    step_index: int = Field(ge=0)
    attempt: int = Field(ge=1)
    attempt_id: str
    complete_by: Timestamp = Field(description="the latest the attempt's work may end: start_by + the step's "
                                               "timeout (before start_by existed: the deadline from the start)")
    calls_allowed: int = Field(ge=0, description="calls the agent may still make within the step's budget")
    start_by: Timestamp | None = Field(default=None, description="an agent must take the request by then; "
                                                                 "None: running from the start (older events)")


class StepAccepted(Event):
    """An agent took the current attempt's request and began its work: the running deadline starts here.

    ``complete_by`` is ``accepted_at`` plus the step's (or the compensation's) timeout, never later than
    the attempt's latest end; ``waited_ms`` is how long the request waited for an agent (its queue wait).
    """

    step: str
    attempt_id: str
    compensation: bool = Field(default=False, description="the attempt is a compensation attempt")
    accepted_at: Timestamp
    complete_by: Timestamp
    waited_ms: int = Field(ge=0, description="from the attempt's start (handed over) to accepted_at")


class StepSucceeded(Event):
    """The current attempt's agent reported success."""

    step: str
    attempt_id: str
    output: JsonObject
    calls: int = Field(ge=0)


class StepFailed(Event):
    """An attempt ended in failure: reported by its agent, or its deadline expired (``timed_out``).
    ``failure_count`` is the step's failures so far: a throttled attempt (the service pacing us) adds none."""

    step: str
    attempt_id: str
    error: str
    permanent: bool
    timed_out: bool = False
    calls: int = Field(ge=0)
    failure_count: int = Field(ge=0)
    error_kind: ErrorKind | None = Field(default=None, description="why it failed, as its agent saw it (None: its "
                                         "deadline passed, it was abandoned, or written before kinds were recorded)")


class MessageIgnored(Event):
    """A result or command named an attempt that is not current: recorded for operators, no effect."""

    attempt_id: str
    message_type: str
    reason: str


class LateResultRecorded(Event):
    """An agent's definite answer (success or permanent refusal) for an attempt that is no longer current.

    A late success proves the step's side effect exists; it is recorded as that fact, with what it means
    for the task now (``consequence``), rather than dropped as an ignored message. It changes no state:
    every step any attempt started is already in the compensation plan, and an undo fences the step's key
    at the service, so an effect that reports late was applied before its undo and is covered by it.
    """

    step: str
    attempt_id: str
    ok: bool
    permanent: bool = False
    compensation: bool = Field(default=False, description="the answer is of a compensation attempt")
    consequence: str


class TaskCompleted(Event):
    """Every step succeeded."""

    output: JsonObject


class TaskFailed(Event):
    """The task is in ``error``: a step failed and no compensation ran (yet)."""

    step: str
    reason: str


class OperatorAlert(Event):
    """Something needs a person: a contradictory duplicate, an escalation, an exhausted budget."""

    reason: str
    step: str | None = None


class StepRetryScheduled(Event):
    """A timer: the next attempt of ``step`` (numbered ``attempt``) starts no earlier than ``not_before``.

    The step is ``waiting`` until the scheduler fires the timer (``RetryDue``) or an operator asks to try
    now. Written after a failed attempt that must back off, or in place of one that was refused without a
    call (``deferred_attempt_id``: an open breaker or a spent retry budget), which ends that attempt
    without counting it as failed. ``compensation``: the attempt is one of the step's undo.
    """

    step: str
    step_index: int = Field(ge=0)
    attempt: int = Field(ge=1, description="the number of the attempt the timer starts")
    not_before: Timestamp
    reason: str
    error_kind: ErrorKind | None = None
    compensation: bool = False
    deferred_attempt_id: str | None = Field(default=None, description="the attempt this deferral ends, which "
                                                                      "made no call")
    new_round: bool = Field(default=False, description="a long back-off past the failure threshold: the step's "
                                                       "failure count starts again when it ends")


class RetryBroughtForward(Event):
    """An operator asked a waiting step to try now: its timer is moved to now, so the old one is stale."""

    step: str
    command_id: str
    operator: str | None = None


# ---- compensation events -------------------------------------------------------------------------
# The compensation log is the event log: CompensationStarted names the plan, then each completed step is
# undone (or skipped) in reverse completion order, then TaskCompensated or TaskCompensationFailed.


class CompensationStarted(Event):
    """Undoing began. ``steps``: the steps that may have been applied, in the order they will be undone.

    A step may have been applied once any attempt of it started: its call may have landed although the
    attempt timed out, was abandoned or answered late (and a redelivered request may still call), so the
    plan is every started step, last started first, not only the ones that reported success.

    ``trigger`` says why: the workflow's policy after a step gave up (``escalation``, ``step`` names it),
    an operator's ``compensate`` of a task in error, or an operator's ``cancel`` of a running task.
    """

    trigger: Literal["escalation", "operator", "cancel"]
    reason: str
    steps: list[str]
    step: str | None = None
    command_id: str | None = None
    operator: str | None = None


class StepCompensationSkipped(Event):
    """A step in the plan declares no compensating action: recorded as having nothing to undo."""

    step: str
    reason: str


class StepCompensationStarted(Event):
    """An attempt of a step's compensation was handed to its agent. ``attempt_id`` is the lock.

    Queued until its agent takes it, exactly like a forward attempt (``StepStarted``). ``not_before`` is
    set when the step's service cannot refuse a late forward call (``Compensation.forward_may_land_s``): the
    undo is made no earlier, once no forward attempt of the step can still land.
    """

    step: str
    step_index: int = Field(ge=0)
    attempt: int = Field(ge=1)
    attempt_id: str
    complete_by: Timestamp = Field(description="the latest the attempt's work may end: start_by + the "
                                               "compensation's timeout (before start_by existed: the deadline)")
    calls_allowed: int = Field(ge=0, description="calls the agent may still make within the compensation's budget")
    start_by: Timestamp | None = Field(default=None, description="an agent must take the request by then; "
                                                                 "None: running from the start (older events)")
    not_before: Timestamp | None = Field(default=None, description="the undo is called no earlier: when the "
                                                                   "last forward attempt can no longer land")


class StepCompensated(Event):
    """The current compensation attempt's agent reported success: the step is undone."""

    step: str
    attempt_id: str
    output: JsonObject
    calls: int = Field(ge=0)


class StepCompensationFailed(Event):
    """A compensation attempt ended in failure: reported by its agent, or its deadline expired."""

    step: str
    attempt_id: str
    error: str
    permanent: bool
    timed_out: bool = False
    calls: int = Field(ge=0)
    failure_count: int = Field(ge=0)
    error_kind: ErrorKind | None = Field(default=None, description="why it failed, as its agent saw it (None: its "
                                         "deadline passed, it was abandoned, or written before kinds were recorded)")


class TaskCompensated(Event):
    """Every step that may have been applied was undone (its key fenced at the service) or has no undo."""


class TaskCompensationFailed(Event):
    """The compensation of ``step`` gave up: the task needs an operator (``retry-compensation``).

    ``not_undone`` names every step whose effect may still be held at its service, in the order an
    operator's retry will undo them: ``step`` itself, then the earlier steps the compensation did not reach.
    """

    step: str
    reason: str
    not_undone: list[str] = Field(default_factory=list)


# ---- operator events ----------------------------------------------------------------------------


class StepResubmitted(Event):
    """An operator resubmitted the failed step of a task in error: it runs again with a fresh budget."""

    step: str
    command_id: str
    operator: str | None = None


class CompensationRetried(Event):
    """An operator retried the failed compensation of ``step``: it runs again with a fresh budget."""

    step: str
    command_id: str
    operator: str | None = None


class OperatorCommandRefused(Event):
    """An operator's command the task's state does not allow: recorded, nothing else changes."""

    command_id: str
    action: str
    reason: str
    step: str | None = None
    operator: str | None = None


# ---- quarantine ----------------------------------------------------------------------------------


class TaskQuarantined(Event):
    """The scheduler cannot fold this task's history (an event its decider refuses or cannot read): the task
    is set aside, its commands dead-lettered, until an operator releases it under a version that folds it.

    ``sequence`` follows the last event of the task on the log, read or not, so a fixed version folds it as
    one more record. ``unfolded_sequence`` is the first event that could not be folded (None: not readable).
    """

    reason: str
    unfolded_sequence: int | None = None


class TaskReleased(Event):
    """An operator released a quarantined task whose history this scheduler folds: its commands run again.
    ``status`` is the task's status as folded, the one the projections show again."""

    status: str
    command_id: str
    operator: str | None = None


# ---- erasure -------------------------------------------------------------------------------------


class TaskDataErased(Event):
    """The task's data key was deleted (crypto-shredding): its sealed values open nowhere from now on.

    ``operator`` is who ordered it: an operator's name, or ``retention`` when its workflow's retention for
    sensitive data ran out.
    """

    command_id: str
    operator: str | None = None


# ---- commands on the inbox ----------------------------------------------------------------------


class SubmitTask(Message):
    """A submission. The same ``task_id`` again with the same data is a no-op; other data is refused."""

    kind: ClassVar[str] = "command"

    workflow: str = Field(min_length=1)
    workflow_version: int | None = Field(default=None, description="None means the latest registered")
    input: JsonObject
    submitter: str | None = None
    reply_topic: str | None = None
    data_key: str | None = Field(default=None, description="the task's data key, wrapped by a master key "
                                 "(kid:base64): what the input's sealed fields were sealed with. Only older "
                                 "submitters put it on inbox; a current one proposes it on keys (key_ref)")
    key_ref: str | None = Field(default=None, description="the reference of the data key the input's sealed "
                                "fields were sealed with, proposed on the keys topic before this submission "
                                "(eventstore.keys): the key itself is never on inbox")


class StepResult(Message):
    """An agent's answer for one attempt.

    A failure says what the agent learned: ``error_kind``, and ``retry_after_s``, the least the next
    attempt should wait (the service's ``Retry-After``, or its breaker's remaining open time); the
    scheduler never starts the next attempt earlier. A ``breaker_open`` or ``budget_spent`` answer with no
    call made is a deferral, not a failed attempt. Results written before these fields carry neither.
    """

    kind: ClassVar[str] = "command"

    step: str
    attempt_id: str
    ok: bool
    output: JsonObject | None = None
    error: str | None = None
    permanent: bool = False
    calls: int = Field(default=1, ge=0)
    error_kind: ErrorKind | None = Field(default=None, description="why the attempt failed (None: unknown or ok)")
    retry_after_s: float | None = Field(default=None, ge=0, description="the next attempt waits at least this long")

    @property
    def deferred(self) -> bool:
        """The agent refused to call (open breaker, spent retry budget) and made no call: nothing failed."""
        return not self.ok and self.calls == 0 and self.error_kind in ("breaker_open", "budget_spent")

    @property
    def throttled(self) -> bool:
        """The service asked the agent to slow down (429, or an answer with Retry-After): the attempt's calls
        count, but it is not a failure of the step -- the service is pacing, not failing."""
        return not self.ok and not self.permanent and self.error_kind == "throttled"


class AttemptAccepted(Message):
    """An agent took an attempt's request and begins its work now (``accepted_at``, the agent's clock).

    Sent on ``inbox`` before the attempt's result, by the same producer with the same key, so the result
    normally follows it on the same partition. The work deadline runs from here: ``accepted_at`` plus the
    request's ``timeout_s``. A redelivered request is acknowledged again; the second changes nothing.
    """

    kind: ClassVar[str] = "command"

    step: str
    attempt_id: str
    compensation: bool = Field(default=False, description="the attempt is a compensation attempt")
    accepted_at: Timestamp


class RetryDue(Message):
    """The scheduler's timer for a waiting step fired: start the attempt it was set for.

    Names the timer exactly (step, attempt number, ``not_before``, forward or undo), so a timer the task
    has moved past -- fired twice, after a restart, or overtaken by an operator's try-now -- changes nothing.
    """

    kind: ClassVar[str] = "command"

    step: str
    attempt: int = Field(ge=1)
    not_before: Timestamp
    compensation: bool = False


class RecoverStep(Message):
    """The supervisor asks the scheduler to recover an attempt whose deadline passed."""

    kind: ClassVar[str] = "command"

    attempt_id: str
    reason: str


OperatorAction = Literal["resubmit", "compensate", "cancel", "retry-compensation", "try-now", "release", "erase"]


class OperatorCommand(Message):
    """An operator's intervention on one task. The same ``command_id`` again changes nothing.

    ``step`` names the step for ``resubmit`` and ``retry-compensation`` (default: the one that failed) and
    ``try-now`` (default: the one waiting); ``compensate``, ``cancel``, ``release`` (of a quarantined task)
    and ``erase`` (shred an ended task's data key) act on the whole task. The outcome is an event naming
    ``command_id``: ``OperatorCommandRefused``, or the transition it caused.
    """

    kind: ClassVar[str] = "command"

    command_id: str = Field(min_length=1, max_length=200, description="chosen by the operator, for idempotency")
    action: OperatorAction
    step: str | None = None
    operator: str | None = None


# ---- other messages -----------------------------------------------------------------------------


class AgentRequest(Message):
    """Work for an agent: one attempt of one step.

    A request with ``start_by`` is acknowledged (``AttemptAccepted``) when an agent takes it, and its work
    deadline is that moment plus ``timeout_s``, never later than ``complete_by``; one taken after
    ``start_by`` is answered at once without a call. Without ``start_by`` (older requests) the deadline is
    ``complete_by``.
    """

    step: str
    attempt: int = Field(ge=1, description="fencing token for the remote service")
    attempt_id: str
    idempotency_key: str = Field(description="the same across every attempt of a step")
    complete_by: Timestamp = Field(description="no work of the attempt after this: start_by + timeout_s when "
                                               "start_by is set, else the attempt's deadline")
    calls_allowed: int = Field(ge=0)
    input: JsonObject
    undoes_key: str | None = Field(
        default=None, description="a compensation's only: the idempotency key of the forward step it undoes; "
        "the service refuses every later forward call with that key (a tombstone)")
    undoes_attempt: int | None = Field(
        default=None, ge=1, description="a compensation's only: the highest forward attempt (fencing token) started")
    start_by: Timestamp | None = Field(default=None, description="take the request by then or answer it unstarted")
    timeout_s: float | None = Field(default=None, gt=0, description="the work deadline's length, from acceptance")
    compensation: bool = Field(default=False, description="the attempt is a compensation attempt")
    not_before: Timestamp | None = Field(default=None, description="a compensation's only: take it (acknowledge "
                                                                   "and call) no earlier than this")
    sealed_output: list[str] = Field(default_factory=list, description="output fields the agent seals with the "
                                     "task's data key before answering ('*': every field)")
    withheld: list[str] = Field(default_factory=list, description="sensitive values left out of the input because "
                                "the step is not granted them (Step.opens): task input fields by name, earlier "
                                "steps' output fields as step.field")

    def work_deadline(self, accepted_at: datetime) -> datetime:
        """When the attempt's work must end if an agent takes the request at ``accepted_at``: the same
        instant the scheduler records from the acknowledgement (both never later than ``complete_by``)."""
        if self.timeout_s is None:
            return self.complete_by
        return min(self.complete_by, utc_millis(accepted_at) + timedelta(seconds=self.timeout_s))


class StatusUpdate(Message):
    """Progress on a submitter's private reply topic."""

    status: Annotated[str, AfterValidator(progress)]  # schemas.states.PROGRESS; Avro: a string
    detail: str | None = None


MESSAGE_TYPES: tuple[type[Message], ...] = (
    TaskAccepted,
    TaskRejected,
    StepStarted,
    StepSucceeded,
    StepFailed,
    MessageIgnored,
    TaskCompleted,
    TaskFailed,
    OperatorAlert,
    SubmitTask,
    StepResult,
    RecoverStep,
    AgentRequest,
    StatusUpdate,
    CompensationStarted,
    StepCompensationSkipped,
    StepCompensationStarted,
    StepCompensated,
    StepCompensationFailed,
    TaskCompensated,
    TaskCompensationFailed,
    StepResubmitted,
    CompensationRetried,
    OperatorCommandRefused,
    OperatorCommand,
    LateResultRecorded,
    StepAccepted,
    AttemptAccepted,
    StepRetryScheduled,
    RetryBroughtForward,
    RetryDue,
    TaskQuarantined,
    TaskReleased,
    TaskDataErased,
)
