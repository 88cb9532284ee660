"""Compensation: undo every step that may have been applied, last started first, in attempts locked, timed,
budgeted and recovered like forward ones (see the package docstring for why a failed step counts).

Stopping at the first step that cannot be undone keeps the order: nothing before it is touched until
an operator retries it.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Literal

from scheduler.decider.attempts import alert_overspend, expiry, in_progress
from scheduler.decider.decision import Builder
from scheduler.decider.ids import compensation_attempt_id
from scheduler.decider.state import StepState
from scheduler.decider.timers import defer_s, schedule, suggested_s, wait_reason, wait_s
from scheduler.workflow import Compensation, Workflow
from schemas.messages import (
    CompensationStarted,
    OperatorAlert,
    OperatorCommand,
    RecoverStep,
    StepCompensated,
    StepCompensationFailed,
    StepCompensationSkipped,
    StepCompensationStarted,
    StepResult,
    TaskCompensated,
    TaskCompensationFailed,
)


def begin_compensation(builder: Builder, workflow: Workflow, trigger: Literal["escalation", "operator", "cancel"],
                        reason: str, *, step: str | None = None, command: OperatorCommand | None = None) -> None:
    """Record the plan (every step that may have been applied, last started first) and start undoing it."""
    plan = builder.state.undo_plan()
    builder.emit(CompensationStarted, trigger=trigger, reason=reason, steps=plan, step=step,
                 command_id=command.command_id if command else None, operator=command.operator if command else None)
    _compensate_next(builder, workflow)


def _compensate_next(builder: Builder, workflow: Workflow) -> None:
    """Undo the last started step not yet undone; a step without a compensation has nothing to undo."""
    while (index := builder.state.undo_candidate()) is not None:
        spec = workflow.steps[index]
        if spec.compensation is None:
            builder.emit(StepCompensationSkipped, step=spec.name,
                         reason=f"step {spec.name!r} declares no compensating action: nothing to undo")
            continue
        start_compensation_attempt(builder, workflow, index)
        return
    builder.emit(TaskCompensated)


def start_compensation_attempt(builder: Builder, workflow: Workflow, index: int) -> None:
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
    landed_by = _forward_landed_by(builder.state.steps[index], compensation)
    not_before = landed_by if landed_by is not None and landed_by > builder.now else None
    start_by = (not_before or builder.now) + timedelta(seconds=compensation.queue_timeout_s)
    builder.emit(
        StepCompensationStarted,
        step=spec.name,
        step_index=index,
        attempt=attempt,
        attempt_id=compensation_attempt_id(builder.state.task_id, spec.name, attempt),
        start_by=start_by,
        complete_by=start_by + timedelta(seconds=compensation.timeout_s),
        calls_allowed=allowed,
        not_before=not_before,
    )


def _forward_landed_by(step: StepState, compensation: Compensation) -> datetime | None:
    """When no forward attempt of ``step`` can land any more, for a service that cannot refuse a late one:
    the last attempt's latest end plus how long a call may still take to land (None: the service fences)."""
    if compensation.fenced or step.lease is None:
        return None
    assert compensation.forward_may_land_s is not None
    return step.lease.complete_by + timedelta(seconds=compensation.forward_may_land_s)


def on_compensation_result(builder: Builder, workflow: Workflow, result: StepResult) -> None:
    """The current compensation attempt's agent answered: undo the next step, retry, or give up."""
    index, current = in_progress(builder.state)
    undo = current.compensation
    if result.deferred:
        compensation = _compensation_of(workflow, index)
        schedule(builder, index, undo.attempt + 1,
                 defer_s(compensation.backoff, undo.failure_count, f"{undo.attempt_id}/deferred", result),
                 f"undo attempt {undo.attempt_id} deferred without a call: {result.error}", compensation=True,
                 kind=result.error_kind, deferred_attempt_id=undo.attempt_id)
        return
    charged = min(result.calls, undo.calls_allowed)
    if result.ok:
        builder.emit(StepCompensated, step=current.name, attempt_id=undo.attempt_id, output=result.output or {},
                     calls=charged)
    else:
        error = result.error or "the agent reported a failure without detail"
        builder.emit(StepCompensationFailed, step=current.name, attempt_id=undo.attempt_id, error=error,
                     permanent=result.permanent, calls=charged, error_kind=result.error_kind,
                     failure_count=undo.failure_count + (0 if result.throttled else 1))
    alert_overspend(builder, current.name, undo.attempt_id, result.calls, undo.calls_allowed)
    if result.ok:
        _compensate_next(builder, workflow)
    elif result.permanent:
        _compensation_failed(builder, workflow, current.name,
                             f"permanent failure of the compensation of step {current.name!r}: {error}")
    else:
        _retry_compensation_or_fail(builder, workflow, index, result)


def _compensation_of(workflow: Workflow, index: int) -> Compensation:
    compensation = workflow.steps[index].compensation
    if compensation is None:
        raise ValueError(f"step {workflow.steps[index].name!r} has no compensation")
    return compensation


def on_compensation_timeout(builder: Builder, workflow: Workflow, recover: RecoverStep) -> None:
    """The compensation attempt's deadline passed: charged in full, like a forward attempt that never answered."""
    index, current = in_progress(builder.state)
    undo = current.compensation
    builder.emit(
        StepCompensationFailed,
        step=current.name,
        attempt_id=undo.attempt_id,
        error=expiry(undo.attempt_id, undo.lease, recover),
        permanent=False,
        timed_out=True,
        calls=undo.calls_allowed,
        failure_count=undo.failure_count + 1,
    )
    _retry_compensation_or_fail(builder, workflow, index)


def _retry_compensation_or_fail(builder: Builder, workflow: Workflow, index: int,
                                result: StepResult | None = None) -> None:
    """The workflow's failure threshold bounds a compensation's failed attempts as it bounds a step's; below
    it the next undo attempt waits out the compensation's back-off like a forward retry. Past it, an undo
    with long back-off rounds left (and budget) waits the long period for a fresh round instead of failing."""
    step = builder.state.steps[index]
    undo = step.compensation
    compensation = _compensation_of(workflow, index)
    if undo.failure_count >= workflow.failure_threshold:
        reason = (f"failure threshold reached: {undo.failure_count} failed attempts of the compensation "
                  f"of step {step.name!r} (threshold {workflow.failure_threshold})")
        if undo.rounds < compensation.backoff_rounds and compensation.attempt_budget - undo.calls_used > 0:
            schedule(builder, index, undo.attempt + 1, max(compensation.long_backoff_s, suggested_s(result)),
                     f"long back-off: {reason}; undo round {undo.rounds + 2} of {compensation.backoff_rounds + 1} "
                     f"after {compensation.long_backoff_s:g}s", compensation=True,
                     kind=result.error_kind if result is not None else "timeout", new_round=True)
            return
        _compensation_failed(builder, workflow, step.name, reason)
        return
    delay = wait_s(compensation.backoff, undo.failure_count, undo.attempt_id or step.name, result)
    if delay <= 0 or compensation.attempt_budget - undo.calls_used <= 0:
        start_compensation_attempt(builder, workflow, index)
        return
    schedule(builder, index, undo.attempt + 1, delay,
             wait_reason(result, undo.failure_count, f"undo attempt(s) of step {step.name!r}", undo.error),
             compensation=True, kind=result.error_kind if result is not None else "timeout")


def _compensation_failed(builder: Builder, workflow: Workflow, step: str, reason: str) -> None:
    """A step cannot be undone: stop (undoing earlier steps first could break their order) and tell a person
    exactly which steps may still hold something at their services."""
    not_undone = builder.state.not_undone(workflow)
    reason = f"{reason}; not undone, so possibly still held: {', '.join(not_undone)}"
    builder.emit(TaskCompensationFailed, step=step, reason=reason, not_undone=not_undone)
    builder.emit(OperatorAlert, step=step, reason=reason)
