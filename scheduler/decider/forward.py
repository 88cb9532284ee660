"""Forward steps: start attempts within the step's budget, move on, retry, or escalate by the workflow's policy.

``_escalate`` is the one place that decides what giving up on a step does to its task. A retry that must
wait (the step's back-off, the agent's suggested delay) is a timer (``scheduler.decider.timers``); an
attempt the agent refused without calling (open breaker, spent retry budget) is deferred by one, and is
not a failed attempt; nor is a throttled one (the service asked to slow down): its calls are charged, its
wait is the service's, but it does not count toward the failure threshold. No retry starts past the
workflow's total time for a step (``step_total_s``): the step escalates instead, a deferral that would end
past it included.
"""

from __future__ import annotations

from datetime import timedelta

from scheduler.decider.attempts import alert_overspend, expiry, in_progress
from scheduler.decider.compensation import begin_compensation
from scheduler.decider.decision import Builder
from scheduler.decider.ids import attempt_id
from scheduler.decider.state import StepState
from scheduler.decider.timers import defer_s, not_before, past_total, schedule, suggested_s, wait_reason, wait_s
from scheduler.workflow import Workflow
from schemas.messages import (
    OperatorAlert,
    RecoverStep,
    StepFailed,
    StepResult,
    StepStarted,
    StepSucceeded,
    TaskCompleted,
    TaskFailed,
)


def on_result(builder: Builder, workflow: Workflow, result: StepResult) -> None:
    """The current attempt's agent answered: move on to the next step, retry, or escalate."""
    index, current = in_progress(builder.state)
    if result.deferred:
        delay = defer_s(workflow.steps[index].backoff, current.failure_count, f"{current.attempt_id}/deferred", result)
        if (late := past_total(workflow, current, not_before(builder.now, delay))) is not None:
            # The attempt made no call, but the step gives up: it ends failed (charging nothing) so that
            # escalating finds it ended, as after any other last failure.
            builder.emit(StepFailed, step=current.name, attempt_id=current.attempt_id,
                         error=f"deferred without a call ({result.error}); {late}", permanent=False, calls=0,
                         failure_count=current.failure_count + 1, error_kind=result.error_kind)
            _escalate(builder, workflow, current.name, late)
            return
        schedule(builder, index, current.attempt + 1, delay,
                 f"attempt {current.attempt_id} deferred without a call: {result.error}", compensation=False,
                 kind=result.error_kind, deferred_attempt_id=current.attempt_id)
        return
    charged = min(result.calls, current.calls_allowed)
    if result.ok:
        builder.emit(StepSucceeded, step=current.name, attempt_id=current.attempt_id,
                     output=result.output or {}, calls=charged)
    else:
        error = result.error or "the agent reported a failure without detail"
        builder.emit(StepFailed, step=current.name, attempt_id=current.attempt_id, error=error,
                     permanent=result.permanent, calls=charged, error_kind=result.error_kind,
                     failure_count=current.failure_count + (0 if result.throttled else 1))
    alert_overspend(builder, current.name, current.attempt_id, result.calls, current.calls_allowed)
    if result.ok:
        if index + 1 < len(workflow.steps):
            start_attempt(builder, workflow, index + 1)
        else:
            outputs = {step.name: step.output for step in builder.state.steps}
            builder.emit(TaskCompleted, output=outputs)
    elif result.permanent:
        _escalate(builder, workflow, current.name, f"permanent failure of step {current.name!r}: {error}")
    else:
        _retry_or_escalate(builder, workflow, index, result)


def on_timeout(builder: Builder, workflow: Workflow, recover: RecoverStep) -> None:
    """The current attempt's deadline passed: it failed transiently, having spent its whole allowance.

    Charging the full allowance is the only safe assumption about an attempt that never answered: it may
    have made every call it was allowed, and the step's end-to-end budget must hold regardless.
    """
    index, current = in_progress(builder.state)
    builder.emit(
        StepFailed,
        step=current.name,
        attempt_id=current.attempt_id,
        error=expiry(current.attempt_id, current.lease, recover),
        permanent=False,
        timed_out=True,
        calls=current.calls_allowed,
        failure_count=current.failure_count + 1,
    )
    _retry_or_escalate(builder, workflow, index)


def _retry_or_escalate(builder: Builder, workflow: Workflow, index: int, result: StepResult | None = None) -> None:
    """Below the workflow's failure threshold, a transiently failed step gets another attempt: after its
    back-off (and the agent's suggested delay), or at once when there is none to wait.

    A step with no budget left escalates now rather than after a wait that could only end in escalating;
    so does one whose next attempt would start past the workflow's total time for a step.
    """
    step = builder.state.steps[index]
    spec = workflow.steps[index]
    kind = result.error_kind if result is not None else "timeout"
    if step.failure_count >= workflow.failure_threshold:
        reason = (f"failure threshold reached: {step.failure_count} failed attempts of step {step.name!r} "
                  f"(threshold {workflow.failure_threshold})")
        if (workflow.escalation == "backoff" and step.rounds < workflow.backoff_rounds
                and spec.attempt_budget - step.calls_used > 0):
            long_s = max(workflow.long_backoff_s, suggested_s(result))
            late = past_total(workflow, step, not_before(builder.now, long_s))
            if late is None:
                schedule(builder, index, step.attempt + 1, long_s,
                         f"long back-off: {reason}; round {step.rounds + 2} of {workflow.backoff_rounds + 1} after "
                         f"{workflow.long_backoff_s:g}s", compensation=False, kind=kind, new_round=True)
                return
            reason = f"{reason}; {late}"
        _escalate(builder, workflow, step.name, reason)
        return
    delay = wait_s(spec.backoff, step.failure_count, step.attempt_id or step.name, result)
    if (late := past_total(workflow, step, not_before(builder.now, delay))) is not None:
        _escalate(builder, workflow, step.name, late)
        return
    if delay <= 0 or spec.attempt_budget - step.calls_used <= 0:
        start_attempt(builder, workflow, index)
        return
    schedule(builder, index, step.attempt + 1, delay,
             wait_reason(result, step.failure_count, f"attempt(s) of step {step.name!r}", step.error),
             compensation=False, kind=kind)


def start_attempt(builder: Builder, workflow: Workflow, index: int) -> None:
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


def _escalate(builder: Builder, workflow: Workflow, step: str, reason: str) -> None:
    """Give up on a step: the one place that decides what that does to its task.

    Every path that stops retrying comes here. The workflow's policy chooses: ``error`` stops the task
    with an operator alert (an operator may resubmit the step or order compensation); ``compensate``
    undoes the completed steps at once, and alerts only if that fails; ``backoff``, once its rounds are
    spent (or waiting cannot help), does what ``after_backoff`` says.
    """
    policy = workflow.after_backoff if workflow.escalation == "backoff" else workflow.escalation
    if policy == "compensate":
        begin_compensation(builder, workflow, "escalation", reason, step=step)
        return
    builder.emit(TaskFailed, step=step, reason=reason)
    builder.emit(OperatorAlert, step=step, reason=reason)
