"""The decider's compensation and operator rules: undoing every step that may have been applied (last
started first, the failed or abandoned one included), its attempts, budgets and thresholds, late answers
recorded as facts, and the commands operators give, accepted or refused."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

import pytest

from scheduler.decider import (
    Command,
    Decision,
    InvalidTransition,
    Limits,
    StepState,
    TaskState,
    compensation_attempt_id,
    compensation_idempotency_key,
    decide,
    fold,
    idempotency_key,
)
from scheduler.workflow import Compensation, Step, Workflow, WorkflowRegistry
from schemas.codec import default_codec
from schemas.messages import (
    CompensationRetried,
    CompensationStarted,
    Event,
    LateResultRecorded,
    MessageIgnored,
    OperatorAction,
    OperatorAlert,
    OperatorCommand,
    OperatorCommandRefused,
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
    TaskAccepted,
    TaskCompensated,
    TaskCompensationFailed,
    TaskCompleted,
    TaskFailed,
)
from tests.test_decider import NOW, accept, current, event, failure, ok, reason, recover, submit, types

UNDO = Compensation("undoer", timeout_s=5, attempt_budget=3, calls_per_attempt=2)


def _steps() -> tuple[Step, ...]:
    """Four steps; ``notify`` has nothing to undo, ``ship`` has a budget of two single-call attempts."""
    return (
        Step("reserve", "inventory", compensation=replace(UNDO, agent="inventory-release")),
        Step("notify", "mailer"),
        Step("charge", "payments", compensation=replace(UNDO, agent="payments-refund")),
        Step("ship", "shipping", attempt_budget=2, calls_per_attempt=1,
             compensation=replace(UNDO, agent="shipping-cancel")),
    )


SAGA = Workflow("saga", 1, _steps(), failure_threshold=2, escalation="compensate")
HELD = Workflow("held", 1, _steps(), failure_threshold=2, escalation="error")
PATIENT = Workflow("patient", 1, _steps(), failure_threshold=5, escalation="compensate")
BRITTLE = Workflow("brittle", 1, _steps(), failure_threshold=1, escalation="compensate")
"""Gives a step up after its first failed attempt: a single timeout escalates."""
LEAN = Workflow("lean", 1, (Step("notify", "mailer"), Step("reserve", "inventory", compensation=UNDO)),
                failure_threshold=1, escalation="compensate")
"""Starts with a step that declares nothing to undo."""
UNFENCED = Workflow("unfenced", 1, (Step("charge", "payments", timeout_s=3, compensation=replace(
    UNDO, agent="payments-refund", forward_may_land_s=2)),), failure_threshold=1, escalation="compensate")
"""The payment service cannot refuse a late charge: its refund waits until no charge attempt can land."""
REGISTRY = WorkflowRegistry.of([SAGA, HELD, PATIENT, BRITTLE, LEAN, UNFENCED])


def run(command: Command, state: TaskState | None, *, now: datetime = NOW) -> tuple[Decision, TaskState | None]:
    decision = decide(command, state, registry=REGISTRY, now=now, in_flight=0, limits=Limits())
    return decision, fold(decision.events, state)


def apply(command: Command, state: TaskState | None, *, now: datetime = NOW) -> TaskState:
    after = run(command, state, now=now)[1]
    assert after is not None
    return after


def at_last_step(workflow: str = "saga") -> TaskState:
    """reserve, notify and charge done, ship in progress."""
    state = apply(submit(workflow=workflow), None)
    for name in ("reserve", "notify", "charge"):
        state = apply(ok(state, output={f"{name}_id": f"{name}-1"}), state)
    assert current(state).name == "ship"
    return state


def compensating() -> TaskState:
    """ship failed for good: ship's own compensation (its call may have landed) is in progress."""
    state = at_last_step()
    return apply(failure(state, permanent=True), state)


def in_error() -> TaskState:
    state = at_last_step("held")
    state = apply(failure(state, permanent=True), state)
    assert state.status == "error"
    return state


def compensation_failed() -> TaskState:
    state = compensating()
    state = apply(failure(state, permanent=True), state)
    assert state.status == "compensation_failed"
    return state


def command(state: TaskState, action: OperatorAction, step: str | None = None, command_id: str = "op-1",
            **kwargs: Any) -> OperatorCommand:
    return OperatorCommand(task_id=state.task_id, command_id=command_id, action=action, step=step,
                           operator="alice", **kwargs)


def step_named(state: TaskState, name: str) -> StepState:
    return next(s for s in state.steps if s.name == name)


def only(decision: Decision, kind: type[Event]) -> list[Any]:
    return [e for e in decision.events if isinstance(e, kind)]


def undo_all(state: TaskState) -> TaskState:
    """Every compensation attempt succeeds until the task is compensated."""
    while state.status == "compensating":
        state = apply(ok(state), state)
    assert state.status == "compensated"
    return state


# ---- compensating after a step gives up ---------------------------------------------------------


def test_a_permanent_failure_under_the_compensate_policy_undoes_the_failed_step_first_then_the_completed_ones() -> None:
    state = at_last_step()
    later = NOW + timedelta(seconds=7)
    decision, after = run(failure(state, permanent=True), state, now=later)
    assert types(decision) == [StepFailed, CompensationStarted, StepCompensationStarted]
    _, started, undo = decision.events
    assert isinstance(started, CompensationStarted) and isinstance(undo, StepCompensationStarted)
    assert (started.trigger, started.step, started.steps) == (
        "escalation", "ship", ["ship", "charge", "notify", "reserve"])
    assert "permanent failure of step 'ship'" in started.reason
    assert started.command_id is None
    assert (undo.step, undo.step_index, undo.attempt, undo.attempt_id) == ("ship", 3, 1, "t1:ship:undo:1")
    assert undo.start_by == later + timedelta(seconds=300) and undo.complete_by == undo.start_by + timedelta(seconds=5)
    assert undo.calls_allowed == 2
    assert after is not None and after.status == "compensating" and after.current_step == 3
    assert [s.status for s in after.steps] == ["succeeded", "succeeded", "succeeded", "compensating"]


def test_compensation_continues_in_reverse_order_and_a_step_without_one_is_recorded_as_nothing_to_undo() -> None:
    state = compensating()
    decision, state_after = run(ok(state, output={"cancel_id": "ca-1"}), state)
    assert types(decision) == [StepCompensated, StepCompensationStarted]
    done, undo = decision.events
    assert isinstance(done, StepCompensated) and (done.step, done.output) == ("ship", {"cancel_id": "ca-1"})
    assert isinstance(undo, StepCompensationStarted) and undo.step == "charge"
    assert state_after is not None
    decision, state_after = run(ok(state_after, output={"refund_id": "re-1"}, calls=2), state_after)
    assert types(decision) == [StepCompensated, StepCompensationSkipped, StepCompensationStarted]
    done, skipped, undo = decision.events
    assert isinstance(done, StepCompensated) and (done.step, done.output, done.calls) == (
        "charge", {"refund_id": "re-1"}, 2)
    assert isinstance(skipped, StepCompensationSkipped) and skipped.step == "notify"
    assert "nothing to undo" in skipped.reason
    assert isinstance(undo, StepCompensationStarted) and undo.step == "reserve"
    assert state_after is not None
    decision, final = run(ok(state_after, output={}), state_after)
    assert types(decision) == [StepCompensated, TaskCompensated]
    assert final is not None and final.status == "compensated" and final.current_step is None
    assert [s.status for s in final.steps] == ["compensated", "compensation_skipped", "compensated", "compensated"]
    assert final.steps[3].compensation.output == {"cancel_id": "ca-1"}
    assert final.steps[2].compensation.output == {"refund_id": "re-1"}
    assert final.steps[2].compensation.calls_used == 2


def test_a_first_step_that_fails_for_good_before_anything_completed_is_itself_undone() -> None:
    state = apply(submit(workflow="saga"), None)
    decision, after = run(failure(state, permanent=True), state)
    assert types(decision) == [StepFailed, CompensationStarted, StepCompensationStarted]
    assert only(decision, CompensationStarted)[0].steps == ["reserve"]
    assert only(decision, StepCompensationStarted)[0].attempt_id == "t1:reserve:undo:1"
    assert after is not None and after.status == "compensating"
    decision, final = run(ok(after), after)
    assert types(decision) == [StepCompensated, TaskCompensated]
    assert final is not None and [s.status for s in final.steps] == ["compensated"]


def test_compensating_a_task_whose_started_steps_have_nothing_to_undo_ends_compensated_at_once() -> None:
    state = apply(submit(workflow="lean"), None)
    decision, after = run(failure(state, permanent=True), state)
    assert types(decision) == [StepFailed, CompensationStarted, StepCompensationSkipped, TaskCompensated]
    assert only(decision, CompensationStarted)[0].steps == ["notify"]
    assert after is not None and after.status == "compensated"
    assert [s.status for s in after.steps] == ["compensation_skipped"]


def test_a_step_that_exhausts_its_budget_under_the_compensate_policy_is_compensated_for() -> None:
    state = at_last_step()  # ship: budget 2, one call an attempt, threshold 2
    state = apply(failure(state), state)
    decision, after = run(recover(state), state, now=NOW + timedelta(hours=1))
    assert types(decision) == [StepFailed, CompensationStarted, StepCompensationStarted]
    assert only(decision, StepFailed)[0].timed_out
    started = only(decision, CompensationStarted)[0]
    assert started.trigger == "escalation" and "threshold" in started.reason
    assert after is not None and after.status == "compensating"


def test_a_step_whose_only_attempt_timed_out_is_in_the_plan_and_is_undone() -> None:
    state = apply(submit(workflow="brittle"), None)  # reserve's first attempt is out, threshold 1
    state = apply(accept(state), state)
    decision, after = run(recover(state), state, now=NOW + timedelta(seconds=11))
    assert types(decision) == [StepFailed, CompensationStarted, StepCompensationStarted]
    timed_out, started, undo = decision.events
    assert isinstance(timed_out, StepFailed) and timed_out.timed_out and timed_out.attempt_id == "t1:reserve:1"
    assert isinstance(started, CompensationStarted) and started.steps == ["reserve"], \
        "a timed-out call may have landed: its step is undone"
    assert isinstance(undo, StepCompensationStarted) and (undo.step, undo.attempt_id) == (
        "reserve", "t1:reserve:undo:1")
    assert after is not None
    decision, final = run(ok(after), after)
    assert types(decision) == [StepCompensated, TaskCompensated]
    assert final is not None and final.status == "compensated"
    assert [s.status for s in final.steps] == ["compensated"]


def test_the_compensation_input_is_the_task_input_and_the_outputs_up_to_the_undone_step() -> None:
    state = compensating()
    assert state.compensation_input(2) == {
        "task": {"order": 42},
        "steps": {"reserve": {"reserve_id": "reserve-1"}, "notify": {"notify_id": "notify-1"},
                  "charge": {"charge_id": "charge-1"}},
    }
    assert state.compensation_input(0) == {"task": {"order": 42}, "steps": {"reserve": {"reserve_id": "reserve-1"}}}


@pytest.mark.parametrize("bad", [{"agent": ""}, {"timeout_s": 0}, {"attempt_budget": 0}, {"calls_per_attempt": 0}])
def test_a_compensation_needs_an_agent_a_deadline_and_a_budget(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="compensation"):
        Compensation(**({"agent": "undoer"} | bad))


def test_compensation_attempts_and_keys_are_distinct_from_the_forward_ones_and_stable_across_attempts() -> None:
    assert compensation_attempt_id("t1", "charge", 2) == "t1:charge:undo:2"
    assert compensation_idempotency_key("t1", "charge") == "t1:charge:undo"
    assert idempotency_key("t1", "charge") == "t1:charge"


# ---- compensation attempts: failures, timeouts, budgets ------------------------------------------


def test_a_transient_compensation_failure_below_the_threshold_retries_with_the_next_undo_attempt() -> None:
    state = compensating()
    later = NOW + timedelta(seconds=3)
    decision, after = run(failure(state, calls=1), state, now=later)
    assert types(decision) == [StepCompensationFailed, StepCompensationStarted]
    failed, retry = decision.events
    assert isinstance(failed, StepCompensationFailed) and isinstance(retry, StepCompensationStarted)
    assert (failed.attempt_id, failed.failure_count, failed.permanent, failed.timed_out) == (
        "t1:ship:undo:1", 1, False, False)
    assert (retry.attempt, retry.attempt_id, retry.start_by) == (2, "t1:ship:undo:2", later + timedelta(seconds=300))
    assert retry.calls_allowed == 2  # budget 3, one call used
    assert after is not None and current(after).compensation.failure_count == 1


def test_a_permanent_compensation_failure_stops_undoing_with_an_alert_naming_every_step_possibly_held() -> None:
    state = compensating()
    state = apply(ok(state), state)  # ship undone: charge's compensation is in progress
    decision, after = run(failure(state, permanent=True, error="refund refused"), state)
    assert types(decision) == [StepCompensationFailed, TaskCompensationFailed, OperatorAlert]
    task_failed, alert = decision.events[1:]
    assert isinstance(task_failed, TaskCompensationFailed) and task_failed.step == "charge"
    assert "refund refused" in task_failed.reason
    assert task_failed.not_undone == ["charge", "reserve"], "the refused undo, then the undoable step it did not reach"
    assert isinstance(alert, OperatorAlert) and alert.step == "charge"
    assert alert.reason.endswith("possibly still held: charge, reserve")
    assert after is not None and after.status == "compensation_failed" and after.is_terminal
    assert [s.status for s in after.steps] == ["succeeded", "succeeded", "compensation_failed", "compensated"], \
        "the earlier steps stay as they were: nothing is undone out of order"


def test_a_compensation_that_keeps_timing_out_ends_compensation_failed_at_the_threshold() -> None:
    state = compensating()
    state = apply(accept(state), state)
    first = recover(state)
    assert first.attempt_id == "t1:ship:undo:1"
    decision, state_after = run(first, state, now=NOW + timedelta(seconds=5))
    assert types(decision) == [StepCompensationFailed, StepCompensationStarted]
    timed_out = only(decision, StepCompensationFailed)[0]
    assert timed_out.timed_out and timed_out.calls == 2  # the whole allowance
    assert state_after is not None
    state_after = apply(accept(state_after, NOW + timedelta(seconds=6)), state_after)
    decision, after = run(recover(state_after), state_after, now=NOW + timedelta(minutes=1))
    assert types(decision) == [StepCompensationFailed, TaskCompensationFailed, OperatorAlert]
    assert "failure threshold reached" in reason(decision.events[1])
    assert after is not None and after.status == "compensation_failed"


def test_a_recovery_of_a_compensation_before_its_deadline_is_ignored() -> None:
    state = compensating()
    state = apply(accept(state), state)
    decision, after = run(recover(state), state, now=NOW + timedelta(seconds=4))
    assert types(decision) == [MessageIgnored]
    assert reason(decision.events[0]).startswith("deadline not passed")
    assert after == replace(state, sequence=state.sequence + 1)


def test_a_compensation_attempt_is_queued_and_acknowledged_like_a_forward_one() -> None:
    state = compensating()
    start_by = NOW + timedelta(seconds=300)
    assert current(state).deadline == start_by, "queued: only its start-by runs"
    decision, _ = run(recover(state), state, now=start_by - timedelta(seconds=1))
    assert reason(decision.events[0]).startswith("start-by not passed")
    taken = NOW + timedelta(seconds=20)
    decision, after = run(accept(state, taken), state, now=taken)
    (accepted,) = decision.events
    assert isinstance(accepted, StepAccepted)
    assert (accepted.attempt_id, accepted.compensation, accepted.waited_ms) == ("t1:ship:undo:1", True, 20_000)
    assert after is not None and current(after).deadline == taken + timedelta(seconds=5)
    assert current(after).compensation.lease is not None and current(after).lease is not None
    assert current(after).lease.accepted_at is None, "the forward attempt's record is kept apart"
    decision, _ = run(recover(after), after, now=taken + timedelta(seconds=5))
    timed_out = only(decision, StepCompensationFailed)[0]
    assert timed_out.timed_out and "timed out" in timed_out.error


def test_a_compensation_is_granted_only_what_is_left_of_its_budget_and_fails_when_it_is_spent() -> None:
    state = at_last_step("patient")  # compensations: budget 3, two calls an attempt; threshold 5
    state = apply(failure(state, permanent=True), state)
    decision, retried = run(failure(state, calls=2), state)
    assert only(decision, StepCompensationStarted)[0].calls_allowed == 1
    assert retried is not None
    decision, after = run(failure(retried, calls=5), retried)
    assert types(decision) == [StepCompensationFailed, OperatorAlert, TaskCompensationFailed, OperatorAlert]
    assert only(decision, StepCompensationFailed)[0].calls == 1, "overspent calls are capped at the allowance"
    assert "compensation budget exhausted" in reason(decision.events[2])
    assert after is not None and step_named(after, "ship").compensation.calls_used == 3


def test_a_late_success_of_the_failed_forward_attempt_is_recorded_while_its_undo_runs_and_changes_nothing() -> None:
    state = compensating()
    late = StepResult(task_id="t1", step="ship", attempt_id="t1:ship:1", ok=True, output={})
    decision, after = run(late, state)
    assert types(decision) == [LateResultRecorded]
    recorded = decision.events[0]
    assert isinstance(recorded, LateResultRecorded)
    assert (recorded.step, recorded.attempt_id, recorded.ok, recorded.compensation) == (
        "ship", "t1:ship:1", True, False)
    assert recorded.consequence == ("late answer for step 'ship': its effect exists at the service; "
                                    "its undo is in progress")
    assert after == replace(state, sequence=state.sequence + 1)


def test_a_repeated_undo_answer_for_a_compensated_task_is_recorded_as_a_late_result_and_changes_nothing() -> None:
    state = compensating()
    result = ok(state)  # ship's undo, attempt 1
    state = undo_all(apply(result, state))
    decision, after = run(result, state)
    assert types(decision) == [LateResultRecorded]
    recorded = decision.events[0]
    assert isinstance(recorded, LateResultRecorded)
    assert (recorded.step, recorded.attempt_id, recorded.ok, recorded.compensation) == (
        "ship", "t1:ship:undo:1", True, True)
    assert "the step is recorded as undone" in recorded.consequence
    assert after == replace(state, sequence=state.sequence + 1)


def test_a_transient_failure_for_a_compensated_task_is_ignored() -> None:
    state = compensating()
    stale = failure(state)  # ship's undo, attempt 1
    state = undo_all(state)
    decision, after = run(stale, state)
    assert types(decision) == [MessageIgnored]
    assert "task is compensated" in reason(decision.events[0])
    assert after == replace(state, sequence=state.sequence + 1)


# ---- late answers ---------------------------------------------------------------------------------


def test_a_late_success_after_the_task_is_compensated_is_recorded_as_released_by_the_fencing_undo() -> None:
    state = at_last_step()
    late = ok(state)  # ship's attempt 1, which is about to be reported failed
    state = undo_all(apply(failure(state, permanent=True), state))
    decision, after = run(late, state)
    assert types(decision) == [LateResultRecorded]
    recorded = decision.events[0]
    assert isinstance(recorded, LateResultRecorded)
    assert (recorded.step, recorded.attempt_id, recorded.ok, recorded.permanent, recorded.compensation) == (
        "ship", "t1:ship:1", True, False, False)
    assert "its effect exists at the service" in recorded.consequence
    assert "its undo fenced the key at the service" in recorded.consequence
    assert after == replace(state, sequence=state.sequence + 1)


def test_a_late_success_of_an_abandoned_attempt_while_its_undo_runs_says_the_undo_in_progress_covers_it() -> None:
    state = at_last_step("held")
    late = ok(state)  # ship's attempt 1, in flight when the task is cancelled
    state = apply(command(state, "cancel"), state)
    assert step_named(state, "ship").status == "compensating"
    decision, after = run(late, state)
    assert types(decision) == [LateResultRecorded]
    recorded = decision.events[0]
    assert isinstance(recorded, LateResultRecorded) and (recorded.step, recorded.ok) == ("ship", True)
    assert recorded.consequence.endswith("its undo is in progress")
    assert after == replace(state, sequence=state.sequence + 1)


def test_a_late_success_for_the_failed_step_of_a_task_in_error_says_compensating_the_task_undoes_it() -> None:
    state = at_last_step("held")
    late = ok(state)
    state = apply(failure(state, permanent=True), state)
    assert state.status == "error"
    decision, after = run(late, state)
    assert types(decision) == [LateResultRecorded]
    recorded = decision.events[0]
    assert isinstance(recorded, LateResultRecorded)
    assert "compensating the task undoes it" in recorded.consequence
    assert after == replace(state, sequence=state.sequence + 1)


def test_a_late_answer_of_an_earlier_undo_attempt_is_recorded_as_a_compensation_answer() -> None:
    state = compensating()
    late = ok(state)  # ship's undo, attempt 1
    state = apply(failure(state), state)  # attempt 2 of the undo is in progress
    decision, after = run(late, state)
    assert types(decision) == [LateResultRecorded]
    recorded = decision.events[0]
    assert isinstance(recorded, LateResultRecorded)
    assert (recorded.step, recorded.attempt_id, recorded.compensation) == ("ship", "t1:ship:undo:1", True)
    assert "an undo attempt with the same key is in progress" in recorded.consequence
    assert after == replace(state, sequence=state.sequence + 1)


def test_a_late_permanent_failure_is_recorded_as_a_refusal() -> None:
    state = compensating()
    late = StepResult(task_id="t1", step="ship", attempt_id="t1:ship:1", ok=False, error="refused", permanent=True)
    decision, after = run(late, state)
    assert types(decision) == [LateResultRecorded]
    recorded = decision.events[0]
    assert isinstance(recorded, LateResultRecorded) and (recorded.ok, recorded.permanent) == (False, True)
    assert "that call was refused" in recorded.consequence
    assert after == replace(state, sequence=state.sequence + 1)


def test_a_late_transient_failure_is_ignored_while_compensating() -> None:
    state = compensating()
    late = StepResult(task_id="t1", step="ship", attempt_id="t1:ship:1", ok=False, error="503")
    decision, after = run(late, state)
    assert types(decision) == [MessageIgnored]
    assert "not the current attempt" in reason(decision.events[0])
    assert after == replace(state, sequence=state.sequence + 1)


def _undone() -> TaskState:
    return undo_all(compensating())


@pytest.mark.parametrize(
    ("make", "step", "attempt"),
    [
        (compensating, "ship", "t1:ship:2"),
        (compensating, "ship", "t1:ship:undo:2"),
        (compensating, "charge", "t1:charge:undo:1"),
        (compensating, "pack", "t1:pack:1"),
        (_undone, "ship", "t1:ship:2"),
        (_undone, "reserve", "t1:reserve:undo:2"),
    ],
    ids=["forward attempt never started", "undo attempt never started", "undo of a step not undone yet",
         "step that never ran", "forward attempt never started, task compensated",
         "undo attempt never started, task compensated"],
)
def test_a_success_naming_an_attempt_that_never_started_is_ignored(make: Any, step: str, attempt: str) -> None:
    state = make()
    decision, after = run(StepResult(task_id="t1", step=step, attempt_id=attempt, ok=True, output={}), state)
    assert types(decision) == [MessageIgnored]
    assert after == replace(state, sequence=state.sequence + 1)


# ---- operator commands ----------------------------------------------------------------------------


def test_an_operator_resubmits_the_failed_step_of_a_task_in_error_with_a_fresh_budget() -> None:
    state = in_error()
    assert step_named(state, "ship").calls_used == 1
    later = NOW + timedelta(minutes=3)
    decision, after = run(command(state, "resubmit"), state, now=later)
    assert types(decision) == [StepResubmitted, StepStarted]
    resubmitted, restarted = decision.events
    assert isinstance(resubmitted, StepResubmitted) and isinstance(restarted, StepStarted)
    assert (resubmitted.step, resubmitted.command_id, resubmitted.operator) == ("ship", "op-1", "alice")
    assert (restarted.attempt, restarted.attempt_id, restarted.calls_allowed) == (2, "t1:ship:2", 1)
    assert restarted.start_by == later + timedelta(seconds=300)
    assert after is not None and after.status == "running" and "op-1" in after.commands
    ship = current(after)
    assert (ship.status, ship.failure_count, ship.calls_used) == ("processing", 0, 0)
    final = apply(ok(after), after)
    assert final.status == "completed"


def test_an_operator_compensates_a_task_in_error_undoing_its_failed_step_first() -> None:
    state = in_error()
    decision, after = run(command(state, "compensate"), state)
    assert types(decision) == [CompensationStarted, StepCompensationStarted]
    started = only(decision, CompensationStarted)[0]
    assert (started.trigger, started.command_id, started.operator, started.step) == ("operator", "op-1", "alice", None)
    assert started.steps == ["ship", "charge", "notify", "reserve"]
    assert only(decision, StepCompensationStarted)[0].step == "ship"
    assert after is not None and after.status == "compensating"


def test_cancelling_a_running_task_abandons_its_attempt_and_undoes_its_step_before_what_completed() -> None:
    state = apply(submit(workflow="held"), None)
    state = apply(ok(state, output={"reserve_id": "r"}), state)
    in_flight = ok(state)  # the answer of notify's attempt, which is in flight
    decision, after = run(command(state, "cancel"), state)
    assert types(decision) == [StepFailed, CompensationStarted, StepCompensationSkipped, StepCompensationStarted]
    abandoned, started, skipped, undo = decision.events
    assert isinstance(abandoned, StepFailed) and abandoned.attempt_id == "t1:notify:1"
    assert "cancelled" in abandoned.error and abandoned.calls == 3
    assert isinstance(started, CompensationStarted) and (started.trigger, started.steps) == (
        "cancel", ["notify", "reserve"])
    assert isinstance(skipped, StepCompensationSkipped) and skipped.step == "notify"
    assert isinstance(undo, StepCompensationStarted) and undo.step == "reserve"
    assert after is not None
    late, later = run(in_flight, after)
    assert types(late) == [LateResultRecorded], "the abandoned attempt's late success is recorded as a fact"
    recorded = late.events[0]
    assert isinstance(recorded, LateResultRecorded) and recorded.attempt_id == "t1:notify:1"
    assert "declares no compensating action: the effect stays" in recorded.consequence
    assert later == replace(after, sequence=after.sequence + 1), "and changes nothing"


def test_cancelling_a_running_task_puts_the_abandoned_in_flight_step_first_in_the_plan() -> None:
    state = at_last_step("held")  # ship's attempt is in flight
    decision, after = run(command(state, "cancel"), state)
    assert types(decision) == [StepFailed, CompensationStarted, StepCompensationStarted]
    abandoned, started, undo = decision.events
    assert isinstance(abandoned, StepFailed) and abandoned.attempt_id == "t1:ship:1"
    assert isinstance(started, CompensationStarted) and (started.trigger, started.steps) == (
        "cancel", ["ship", "charge", "notify", "reserve"])
    assert isinstance(undo, StepCompensationStarted) and (undo.step, undo.attempt_id) == ("ship", "t1:ship:undo:1")
    assert after is not None
    final = undo_all(after)
    assert [s.status for s in final.steps] == ["compensated", "compensation_skipped", "compensated", "compensated"]


def test_retrying_a_failed_compensation_runs_it_again_with_a_fresh_budget_then_carries_on() -> None:
    state = compensation_failed()
    decision, after = run(command(state, "retry-compensation"), state)
    assert types(decision) == [CompensationRetried, StepCompensationStarted]
    retried, undo = decision.events
    assert isinstance(retried, CompensationRetried) and retried.step == "ship"
    assert isinstance(undo, StepCompensationStarted) and (undo.attempt, undo.calls_allowed) == (2, 2)
    assert after is not None and after.status == "compensating"
    assert current(after).compensation.failure_count == 0
    after = apply(ok(after), after)
    assert current(after).name == "charge", "then carries on with the steps before it"
    after = apply(ok(after), after)
    assert current(after).name == "reserve"
    after = apply(ok(after), after)
    assert after.status == "compensated"


@pytest.mark.parametrize("action", ["resubmit", "compensate"])
def test_the_same_command_id_again_changes_nothing(action: OperatorAction) -> None:
    state = in_error()
    state = apply(command(state, action), state)
    assert run(command(state, action), state)[0] == Decision(())
    assert run(command(state, "cancel"), state)[0] == Decision(()), "an id is answered once, whatever it asks"


def test_a_refused_command_id_again_changes_nothing() -> None:
    state = at_last_step()
    refused = apply(command(state, "compensate"), state)
    assert run(command(refused, "compensate"), refused)[0] == Decision(())


def _running() -> TaskState:
    return at_last_step("held")


def _completed() -> TaskState:
    state = _running()
    return apply(ok(state), state)


def _compensated() -> TaskState:
    return undo_all(compensating())


@pytest.mark.parametrize(
    ("make", "action", "step", "why"),
    [
        (_running, "resubmit", "ship", "task is running (step 'ship' is processing, attempt t1:ship:1)"),
        (_running, "resubmit", None, "resubmit needs a task in error"),
        (_completed, "compensate", None, "task is completed: only a task in error can be compensated"),
        (_compensated, "compensate", None, "task is compensated: only a task in error can be compensated"),
        (_compensated, "cancel", None, "task is compensated: only a running task can be cancelled"),
        (in_error, "cancel", None, "task is error: only a running task can be cancelled"),
        (in_error, "resubmit", "charge", "step 'charge' is succeeded: resubmit needs a step in failed"),
        (in_error, "resubmit", "pack", "task has no step 'pack' that ran"),
        (in_error, "compensate", "ship", "compensate acts on the whole task: it takes no step"),
        (compensating, "retry-compensation", None, "retry-compensation needs a task in compensation_failed"),
        (compensating, "cancel", None, "task is compensating: only a running task can be cancelled"),
        (compensation_failed, "retry-compensation", "reserve",
         "step 'reserve' is succeeded: retry-compensation needs a step in compensation_failed"),
    ],
    ids=["resubmit a running step", "resubmit a running task", "compensate a completed task",
         "compensate a compensated task", "cancel a compensated task", "cancel a task in error",
         "resubmit a succeeded step", "resubmit an unknown step", "compensate one step",
         "retry a compensation in progress", "cancel a compensating task", "retry a compensation that did not fail"],
)
def test_a_command_the_state_forbids_is_refused_with_the_reason_and_changes_nothing(
    make: Any, action: OperatorAction, step: str | None, why: str
) -> None:
    state = make()
    decision, after = run(command(state, action, step), state)
    assert types(decision) == [OperatorCommandRefused]
    refused = decision.events[0]
    assert isinstance(refused, OperatorCommandRefused)
    assert (refused.command_id, refused.action, refused.step, refused.operator) == ("op-1", action, step, "alice")
    assert why in refused.reason
    assert after == replace(state, sequence=state.sequence + 1, commands=state.commands | {"op-1"})


def test_an_operator_command_for_an_unknown_task_goes_to_the_dlq() -> None:
    decision, _ = run(OperatorCommand(task_id="ghost", command_id="c", action="cancel"), None)
    assert decision.events == () and decision.dead_letter == "unknown task 'ghost'"


# ---- evolve: the compensation log is checked on replay -------------------------------------------


def _history() -> list[Event]:
    """Ship fails; its compensation fails once then succeeds; charge undone, notify skipped, reserve undone;
    then the failed ship attempt's success arrives late."""
    state = at_last_step()
    events = _events_of(state)
    late = ok(state)
    for make in (lambda s: failure(s, permanent=True), failure, ok, ok, ok):
        decision, after = run(make(state), state)
        events.extend(decision.events)
        assert after is not None
        state = after
    assert state.status == "compensated"
    events.extend(run(late, state)[0].events)
    return events


def _events_of(state: TaskState) -> list[Event]:
    """The history leading to ``state`` (``at_last_step``), decided again: decisions are deterministic."""
    events: list[Event] = []
    replay: TaskState | None = None
    decision, replay = run(submit(workflow="saga"), replay)
    events.extend(decision.events)
    for name in ("reserve", "notify", "charge"):
        assert replay is not None
        decision, replay = run(ok(replay, output={f"{name}_id": f"{name}-1"}), replay)
        events.extend(decision.events)
    assert replay == state
    return events


def test_a_compensation_history_replays_through_the_avro_codec_to_the_same_state() -> None:
    events = _history()
    codec = default_codec()
    decoded = [codec.decode(codec.encode(e)) for e in events]
    assert decoded == events
    state = fold(e for e in decoded if isinstance(e, Event))
    assert state is not None and state.status == "compensated"
    kinds = [type(e).__name__ for e in events]
    assert kinds[kinds.index("CompensationStarted"):] == [
        "CompensationStarted", "StepCompensationStarted", "StepCompensationFailed", "StepCompensationStarted",
        "StepCompensated", "StepCompensationStarted", "StepCompensated", "StepCompensationSkipped",
        "StepCompensationStarted", "StepCompensated", "TaskCompensated", "LateResultRecorded",
    ]
    assert [e.step for e in events if isinstance(e, StepCompensationStarted)] == ["ship", "ship", "charge", "reserve"]


def _accepted() -> Event:
    return event(TaskAccepted, 1, input={}, input_digest="d", workflow="saga")


def _saga(kind: type[Event], sequence: int, **fields: Any) -> Event:
    return event(kind, sequence, workflow="saga", **fields)


def _start(sequence: int, step: str, index: int) -> Event:
    return _saga(StepStarted, sequence, step=step, step_index=index, attempt=1, attempt_id=f"t1:{step}:1",
                 complete_by=NOW, calls_allowed=1)


def _done(sequence: int, step: str) -> Event:
    return _saga(StepSucceeded, sequence, step=step, attempt_id=f"t1:{step}:1", output={}, calls=1)


def _two_done() -> list[Event]:
    """reserve and notify done, charge failed for good (its call may have landed: it is undone first)."""
    return [_accepted(), _start(2, "reserve", 0), _done(3, "reserve"), _start(4, "notify", 1), _done(5, "notify"),
            _start(6, "charge", 2),
            _saga(StepFailed, 7, step="charge", attempt_id="t1:charge:1", error="e", permanent=True, calls=1,
                  failure_count=1)]


def _began(sequence: int = 8, steps: list[str] | None = None, **fields: Any) -> Event:
    """The compensation of ``_two_done``: every started step, the failed one first."""
    plan = ["charge", "notify", "reserve"] if steps is None else steps
    return _saga(CompensationStarted, sequence,
                 **({"trigger": "escalation", "reason": "r", "step": "charge", "steps": plan} | fields))


def _undo(sequence: int, step: str, index: int, attempt: int = 1) -> Event:
    return _saga(StepCompensationStarted, sequence, step=step, step_index=index, attempt=attempt,
                 attempt_id=compensation_attempt_id("t1", step, attempt), complete_by=NOW, calls_allowed=1)


def test_a_valid_hand_written_compensation_log_folds() -> None:
    state = fold([*_two_done(), _began(), _undo(9, "charge", 2),
                  _saga(StepCompensated, 10, step="charge", attempt_id="t1:charge:undo:1", output={}, calls=1),
                  _saga(StepCompensationSkipped, 11, step="notify", reason="r"),
                  _undo(12, "reserve", 0),
                  _saga(StepCompensated, 13, step="reserve", attempt_id="t1:reserve:undo:1", output={}, calls=1),
                  _saga(TaskCompensated, 14)])
    assert state is not None and state.status == "compensated"
    assert [s.status for s in state.steps] == ["compensated", "compensation_skipped", "compensated"]


@pytest.mark.parametrize(
    "events",
    [
        [*_two_done(), _began(steps=["reserve", "notify", "charge"])],
        [*_two_done(), _began(steps=["charge", "reserve"])],
        [*_two_done(), _began(steps=["notify", "reserve"])],
        [*_two_done(), _began(), _undo(9, "reserve", 0)],
        [*_two_done(), _began(), _undo(9, "notify", 1)],
        [*_two_done(), _began(), _undo(9, "charge", 2, attempt=2)],
        [*_two_done(), _began(), _saga(TaskCompensated, 9)],
        [*_two_done(), _began(), _undo(9, "charge", 2), _undo(10, "charge", 2, attempt=2)],
        [*_two_done(), _began(), _undo(9, "charge", 2),
         _saga(StepCompensated, 10, step="charge", attempt_id="t1:charge:1", output={}, calls=1)],
        [*_two_done(), _began(), _undo(9, "charge", 2),
         _saga(StepCompensationFailed, 10, step="charge", attempt_id="t1:charge:undo:1", error="e", permanent=True,
               calls=1, failure_count=2)],
        [*_two_done(), _began(), _saga(TaskCompensationFailed, 9, step="charge", reason="r")],
        [*_two_done(), _began(trigger="operator", command_id="c")],
        [*_two_done(), _began(trigger="cancel")],
        [*_two_done(), _saga(TaskFailed, 8, step="charge", reason="r"), _began(9)],
        [*_two_done(), _saga(StepResubmitted, 8, step="charge", command_id="c")],
        [*_two_done(), _saga(TaskFailed, 8, step="charge", reason="r"),
         _saga(StepResubmitted, 9, step="notify", command_id="c")],
        [*_two_done(), _saga(TaskFailed, 8, step="charge", reason="r"),
         _saga(OperatorCommandRefused, 9, command_id="c", action="cancel", reason="r"),
         _saga(StepResubmitted, 10, step="charge", command_id="c")],
        [*_two_done(), _began(), _saga(CompensationRetried, 9, step="charge", command_id="c")],
        [*_two_done(), _began(), _saga(StepStarted, 9, step="charge", step_index=2, attempt=2,
                                       attempt_id="t1:charge:2", complete_by=NOW, calls_allowed=1)],
        [*_two_done(), _began(), _saga(TaskCompleted, 9, output={})],
    ],
    ids=[
        "plan not in reverse order", "plan missing a completed step", "plan missing the failed step",
        "undoing out of order", "undoing a completed step before the failed one", "first undo attempt numbered 2",
        "compensated with steps left to undo", "undo attempt while one runs",
        "compensation outcome naming the forward attempt", "compensation failure count skipped",
        "compensation failed on a step whose compensation did not fail", "operator compensation of a running task",
        "cancel without a command id", "automatic compensation of a task in error", "resubmit of a running task",
        "resubmit of a step that did not fail", "command id answered twice",
        "retry of a compensation that did not fail", "forward attempt while compensating",
        "completed while compensating",
    ],
)
def test_impossible_compensation_histories_are_invalid_transitions(events: list[Event]) -> None:
    with pytest.raises(InvalidTransition):
        fold(events)


def test_a_result_naming_the_compensation_attempt_of_another_step_is_ignored() -> None:
    state = compensating()
    stray = StepResult(task_id="t1", step="reserve", attempt_id="t1:ship:undo:1", ok=True, output={})
    decision, after = run(stray, state)
    assert types(decision) == [MessageIgnored]
    assert after == replace(state, sequence=state.sequence + 1)


def test_an_undo_at_a_service_that_cannot_refuse_is_not_made_before_the_forward_attempt_can_no_longer_land() -> None:
    state = apply(submit(workflow="unfenced"), None)
    state = apply(accept(state, NOW + timedelta(seconds=1)), state)  # the charge runs until NOW + 4 s
    decision, undoing = run(failure(state), state, now=NOW + timedelta(seconds=2))
    (undo,) = only(decision, StepCompensationStarted)
    assert undo.not_before == NOW + timedelta(seconds=6), "the attempt's end (4 s) plus 2 s for a call to land"
    assert undo.start_by == undo.not_before + timedelta(seconds=UNDO.queue_timeout_s), "queued from then on"
    assert undoing is not None and current(undoing).status == "compensating"


def test_an_undo_at_a_service_that_fences_is_made_at_once() -> None:
    decision, _after = run(failure(at_last_step(), permanent=True), at_last_step())
    (undo,) = only(decision, StepCompensationStarted)
    assert undo.not_before is None
