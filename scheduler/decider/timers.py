"""Timers: a retried attempt that must wait is recorded as ``StepRetryScheduled`` and started by ``RetryDue``.

Waiting is a state of the task, not a sleep anywhere: the timer is an event, so it survives restarts and
rebalances like everything else the decider knows, and the scheduler that owns the partition fires it by
sending ``RetryDue`` to ``inbox`` once its time has come (``scheduler.timers``). The decider starts the
attempt only for a ``RetryDue`` naming the step's current timer exactly and only once ``not_before`` has
passed, so a repeated, late or overtaken firing changes nothing, and ``evolve`` refuses any attempt of a
waiting step that starts before its timer.

How long to wait is the larger of the step's (or the compensation's) back-off and what the agent learned
(``Retry-After``, an open breaker's remaining time): the service's word is a floor, never shortened. A
workflow's ``step_total_s`` bounds when a forward step's retry may start (``past_total``): a retry it would
put later is not scheduled, and the step escalates instead.
"""

from __future__ import annotations

import math
from datetime import datetime, timedelta

from scheduler.decider.decision import Builder
from scheduler.decider.state import StepState, TaskState
from scheduler.workflow import Backoff, Workflow
from schemas.avro import utc_millis
from schemas.messages import ErrorKind, RetryDue, StepResult, StepRetryScheduled
from schemas.states import StepStatus


def suggested_s(result: StepResult | None) -> float:
    """The least wait the agent asked for (``Retry-After``, an open breaker's time left); 0 when none."""
    return result.retry_after_s if result is not None and result.retry_after_s is not None else 0.0


def wait_s(backoff: Backoff, failures: int, seed: str, result: StepResult | None) -> float:
    """Seconds before the next attempt: the back-off after ``failures`` failed attempts, at least what the
    agent asked for."""
    return max(backoff.delay_s(failures, seed), suggested_s(result))


def wait_reason(result: StepResult | None, failures: int, attempts: str, error: str | None) -> str:
    """Why the next attempt waits, for operators: the service pacing us (a throttle, no failure), or the
    back-off after ``failures`` failed ``attempts``."""
    if result is not None and result.throttled:
        return f"throttled, not failed: the service asked to wait {suggested_s(result):.1f}s: {error}"
    return f"back-off after {failures} failed {attempts}: {error}"


DEFERRAL_MIN_S = 1.0
"""The least a deferred attempt waits: an agent that just refused to call (its breaker open, its retry
budget spent) would refuse again at once, and a deferral costs no failure to slow it down."""


def defer_s(backoff: Backoff, failures: int, seed: str, result: StepResult) -> float:
    """Seconds before retrying an attempt refused without a call: as a retry, and never under a second."""
    return max(DEFERRAL_MIN_S, wait_s(backoff, failures, seed, result))


def not_before(now: datetime, delay_s: float) -> datetime:
    """When an attempt ``delay_s`` from ``now`` may start: rounded up to the millisecond the log keeps, so the
    attempt is never early by a rounding."""
    return utc_millis(now) + timedelta(milliseconds=math.ceil(delay_s * 1000))


def past_total(workflow: Workflow, step: StepState, at: datetime) -> str | None:
    """Why a retry of ``step`` starting at ``at`` would be past the workflow's total time for a step (its
    ``step_total_s`` from the step's first attempt), or None when it is within it or there is none."""
    total_s, first = workflow.step_total_s, step.first_started_at
    if total_s is None or first is None or at <= first + timedelta(seconds=total_s):
        return None
    return (f"total time spent: step {step.name!r} may be retried for {total_s:g}s from its first attempt, "
            f"and its next attempt could start only {(at - first).total_seconds():.1f}s after it")


def schedule(builder: Builder, index: int, attempt: int, delay_s: float, reason: str, *, compensation: bool,
             kind: ErrorKind | None, deferred_attempt_id: str | None = None, new_round: bool = False) -> None:
    """Record the timer for attempt ``attempt`` of step ``index``, ``delay_s`` from now (``not_before``)."""
    builder.emit(
        StepRetryScheduled,
        step=builder.state.steps[index].name,
        step_index=index,
        attempt=attempt,
        not_before=not_before(builder.now, delay_s),
        reason=reason,
        error_kind=kind,
        compensation=compensation,
        deferred_attempt_id=deferred_attempt_id,
        new_round=new_round,
    )


def pending(state: TaskState) -> RetryDue | None:
    """The firing of the task's current timer (what the scheduler sends when it is due), if a step waits.

    The one definition of "the current timer": the scheduler arms exactly this, and ``due`` starts an
    attempt only for a firing equal to it.
    """
    if state.is_terminal:
        return None
    for step in state.steps:
        if step.status == StepStatus.WAITING and step.timer is not None:
            return RetryDue(task_id=state.task_id, step=step.name, attempt=step.timer.attempt,
                            not_before=step.timer.not_before, compensation=step.timer.compensation)
    return None


def same_timer(a: RetryDue, b: RetryDue) -> bool:
    """Two firings of one timer (their message ids and times differ)."""
    return (a.task_id, a.step, a.attempt, a.not_before, a.compensation) == (
        b.task_id, b.step, b.attempt, b.not_before, b.compensation)


def due(builder: Builder, command: RetryDue) -> int | None:
    """The index of the step ``command``'s timer starts now, or None when the timer is not current or not due.

    Not current: the task ended or moved on (a repeated firing, one after a restart, one overtaken by an
    operator's try-now or a cancel); not due: the firing's clock ran ahead of this one (the scheduler
    fires it again). Either way nothing is recorded: a stale timer is routine, not news for operators.
    """
    state = builder.state
    current = pending(state)
    if current is None or not same_timer(current, command) or builder.now < command.not_before:
        return None
    return next(index for index, step in enumerate(state.steps) if step.name == command.step)
