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

A package rather than sibling modules of ``scheduler/``, because these modules are one pure machine with
one public face (this module) and the service beside them does the I/O. One job each: ``state`` (what a
task is), ``transitions`` (``evolve``, ``fold``), ``ids`` (event ids, locks, keys, digests), ``decision``
(a decision and its builder), ``dispatch`` (``decide``), ``relevance`` (whether a message concerns the
attempt in progress), ``admission``, ``attempts`` (what forward and undo attempts share), ``forward``,
``compensation``, ``operator`` and ``timers`` (waiting between attempts). Callers import from here only.
"""

from scheduler.decider.admission import DEFAULT_MAX_IN_FLIGHT, Limits
from scheduler.decider.decision import Command, Decision
from scheduler.decider.dispatch import decide
from scheduler.decider.ids import (
    attempt_id,
    compensation_attempt_id,
    compensation_idempotency_key,
    idempotency_key,
    input_digest,
)
from scheduler.decider.state import (
    CompensationState,
    Lease,
    StepState,
    TaskState,
)
from scheduler.decider.timers import pending, same_timer
from scheduler.decider.transitions import InvalidTransition, evolve, fold

__all__ = [
    "DEFAULT_MAX_IN_FLIGHT",
    "Command",
    "CompensationState",
    "Decision",
    "InvalidTransition",
    "Lease",
    "Limits",
    "StepState",
    "TaskState",
    "attempt_id",
    "compensation_attempt_id",
    "compensation_idempotency_key",
    "decide",
    "evolve",
    "fold",
    "idempotency_key",
    "input_digest",
    "pending",
    "same_timer",
]
