"""The scheduler's decider, rule by rule: submissions, results, recoveries, budgets, and replay checks."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from scheduler.decider import (
    Command,
    Decision,
    InvalidTransition,
    Lease,
    Limits,
    StepState,
    TaskState,
    attempt_id,
    decide,
    evolve,
    fold,
    input_digest,
)
from scheduler.workflow import Step, Workflow, WorkflowRegistry
from schemas.codec import default_codec
from schemas.messages import (
    AttemptAccepted,
    CompensationStarted,
    Event,
    LateResultRecorded,
    MessageIgnored,
    OperatorAlert,
    OperatorCommandRefused,
    RecoverStep,
    StepAccepted,
    StepFailed,
    StepResult,
    StepStarted,
    StepSucceeded,
    SubmitTask,
    TaskAccepted,
    TaskCompensationFailed,
    TaskCompleted,
    TaskFailed,
    TaskRejected,
)
from schemas.states import FINAL, TERMINAL

NOW = datetime(2025, 1, 1, 12, 0, tzinfo=UTC)

ORDERS_V1 = Workflow(
    "orders",
    1,
    (
        Step("reserve", "inventory", timeout_s=10, attempt_budget=5, calls_per_attempt=3),
        Step("charge", "payments", timeout_s=30, attempt_budget=4, calls_per_attempt=2),
        Step("ship", "shipping", timeout_s=60, attempt_budget=1, calls_per_attempt=1),
    ),
    failure_threshold=3,
)
ORDERS_V2 = Workflow("orders", 2, (Step("reserve", "inventory"), Step("ship", "shipping")))
ONE_SHOT = Workflow("one-shot", 1, (Step("only", "agent", attempt_budget=2, calls_per_attempt=3),),
                    failure_threshold=5)
REGISTRY = WorkflowRegistry.of([ORDERS_V1, ORDERS_V2, ONE_SHOT])


def submit(task_id: str = "t1", workflow: str = "orders", version: int | None = 1,
           input: dict[str, Any] | None = None, **kwargs: Any) -> SubmitTask:
    return SubmitTask(task_id=task_id, workflow=workflow, workflow_version=version,
                      input={"order": 42} if input is None else input, **kwargs)


def ok(state: TaskState, output: dict[str, Any] | None = None, calls: int = 1) -> StepResult:
    """A success for the attempt in progress (forward or compensating)."""
    step = current(state)
    return StepResult(task_id=state.task_id, step=step.name, attempt_id=step.lock or "", ok=True,
                      output={"done": step.name} if output is None else output, calls=calls)


def failure(state: TaskState, *, permanent: bool = False, calls: int = 1, error: str | None = "boom") -> StepResult:
    """A failure for the attempt in progress (forward or compensating)."""
    step = current(state)
    return StepResult(task_id=state.task_id, step=step.name, attempt_id=step.lock or "", ok=False,
                      error=error, permanent=permanent, calls=calls)


def recover(state: TaskState, attempt: str | None = None) -> RecoverStep:
    return RecoverStep(task_id=state.task_id, attempt_id=attempt or current(state).lock or "",
                       reason="deadline passed")


def accept(state: TaskState, at: datetime = NOW) -> AttemptAccepted:
    """The agent's acknowledgement of the attempt in progress (forward or compensating), taken at ``at``."""
    step = current(state)
    return AttemptAccepted(task_id=state.task_id, step=step.name, attempt_id=step.lock or "",
                           compensation=step.status == "compensating", accepted_at=at)


def running(state: TaskState, at: datetime = NOW) -> TaskState:
    """``state`` after its agent took the attempt in progress at ``at``: its work deadline runs from then."""
    return apply(accept(state, at), state, now=at)


def current(state: TaskState) -> StepState:
    assert state.current_step is not None
    return state.steps[state.current_step]


def run(command: Command, state: TaskState | None, *, now: datetime = NOW,
        in_flight: int = 0, limits: Limits | None = None,
        registry: WorkflowRegistry = REGISTRY) -> tuple[Decision, TaskState | None]:
    """Decide, then apply the decision: what the scheduler service does with each command."""
    decision = decide(command, state, registry=registry, now=now, in_flight=in_flight, limits=limits or Limits())
    return decision, fold(decision.events, state)


def started(task_id: str = "t1", workflow: str = "orders", version: int | None = 1) -> TaskState:
    """A task accepted and running its first attempt."""
    _, state = run(submit(task_id, workflow, version), None)
    assert state is not None
    return state


def apply(command: Command, state: TaskState | None, **kwargs: Any) -> TaskState:
    _, after = run(command, state, **kwargs)
    assert after is not None
    return after


def types(decision: Decision) -> list[type[Event]]:
    return [type(event) for event in decision.events]


def reason(event: Event) -> str:
    assert isinstance(event, TaskFailed | OperatorAlert | MessageIgnored | TaskRejected | OperatorCommandRefused
                      | TaskCompensationFailed | CompensationStarted)
    return event.reason


# ---- helpers ------------------------------------------------------------------------------------


def test_input_digest_ignores_key_order_but_not_content_workflow_or_version() -> None:
    digest = input_digest("orders", 1, {"a": 1, "b": {"x": 1, "y": 2}})
    assert digest == input_digest("orders", 1, {"b": {"y": 2, "x": 1}, "a": 1})
    assert len({
        digest,
        input_digest("orders", 1, {"a": 2, "b": {"x": 1, "y": 2}}),
        input_digest("orders", 2, {"a": 1, "b": {"x": 1, "y": 2}}),
        input_digest("other", 1, {"a": 1, "b": {"x": 1, "y": 2}}),
        input_digest("orders", None, {"a": 1, "b": {"x": 1, "y": 2}}),
    }) == 5


def test_attempt_id_names_task_step_and_attempt() -> None:
    assert attempt_id("t1", "reserve", 3) == "t1:reserve:3"


def test_limits_refuse_a_negative_bound() -> None:
    with pytest.raises(ValueError, match="negative"):
        Limits(max_in_flight=-1)


# ---- submissions ----------------------------------------------------------------------------------


def test_a_new_submission_is_accepted_and_its_first_step_started() -> None:
    command = submit(submitter="shop", reply_topic="stepstream.status.shop")
    decision, state = run(command, None)
    assert types(decision) == [TaskAccepted, StepStarted]
    assert decision.dead_letter is None
    accepted, first = decision.events
    assert isinstance(accepted, TaskAccepted) and isinstance(first, StepStarted)
    assert accepted.input == {"order": 42}
    assert accepted.input_digest == input_digest("orders", 1, {"order": 42})
    assert (accepted.submitter, accepted.reply_topic) == ("shop", "stepstream.status.shop")
    assert (first.step, first.step_index, first.attempt, first.attempt_id) == ("reserve", 0, 1, "t1:reserve:1")
    assert state is not None and state.status == "running" and state.current_step == 0
    assert current(state).status == "processing" and current(state).attempt_id == "t1:reserve:1"


def test_the_first_attempt_is_queued_with_a_start_by_and_its_per_attempt_share_of_the_budget() -> None:
    decision, state = run(submit(), None)
    first = decision.events[1]
    assert isinstance(first, StepStarted)
    assert first.start_by == NOW + timedelta(seconds=300)  # the step's queue_timeout_s (default)
    assert first.complete_by == first.start_by + timedelta(seconds=10), "the latest its work may end"
    assert first.calls_allowed == 3  # min(calls_per_attempt 3, attempt_budget 5)
    assert state is not None and current(state).deadline == first.start_by, "queued: no work deadline running"


def test_an_attempt_is_never_granted_more_than_the_step_budget() -> None:
    decision, _ = run(submit(workflow="one-shot"), None)
    first = decision.events[1]
    assert isinstance(first, StepStarted)
    assert first.calls_allowed == 2  # min(calls_per_attempt 3, attempt_budget 2)


def test_every_event_carries_task_sequence_workflow_version_cause_and_time() -> None:
    command = submit()
    decision, _ = run(command, None)
    assert [e.sequence for e in decision.events] == [1, 2]
    for event in decision.events:
        assert event.task_id == "t1"
        assert (event.workflow, event.workflow_version) == ("orders", 1)
        assert event.causation_id == command.message_id
        assert event.occurred_at == NOW


def test_a_submission_without_a_version_is_pinned_to_the_latest_registered_version() -> None:
    decision, state = run(submit(version=None), None)
    assert all(event.workflow_version == 2 for event in decision.events)
    assert state is not None and state.workflow_version == 2


def test_a_task_runs_the_steps_of_its_pinned_version_while_a_newer_version_exists() -> None:
    state = started(version=1)
    state = apply(ok(state), state)
    assert current(state).name == "charge"  # v2 would have gone to "ship"
    assert all(e.workflow_version == 1 for e in run(ok(state), state)[0].events)


def test_admission_control_rejects_a_submission_at_the_in_flight_bound_visibly() -> None:
    command = submit(submitter="shop", reply_topic="stepstream.status.shop")
    decision, state = run(command, None, in_flight=5, limits=Limits(max_in_flight=5))
    assert types(decision) == [TaskRejected]
    assert decision.dead_letter is None
    rejected = decision.events[0]
    assert isinstance(rejected, TaskRejected)
    assert "admission control" in rejected.reason and rejected.cause == "admission_control"
    assert rejected.input_digest == input_digest("orders", 1, {"order": 42})
    assert (rejected.submitter, rejected.reply_topic) == ("shop", "stepstream.status.shop")
    assert state is not None and state.status == "rejected" and state.is_terminal
    assert state.input == {} and state.steps == () and state.reply_topic == "stepstream.status.shop"


def test_admission_control_admits_below_the_bound() -> None:
    decision, _ = run(submit(), None, in_flight=4, limits=Limits(max_in_flight=5))
    assert types(decision) == [TaskAccepted, StepStarted]


def test_a_repeated_submission_changes_nothing() -> None:
    state = started()
    assert run(submit(), state)[0] == Decision(())


def test_a_repeat_asking_for_the_latest_version_matches_the_version_the_task_was_pinned_to() -> None:
    state = started(version=1)  # v2 is the latest now
    assert run(submit(version=None), state)[0] == Decision(())
    pinned_to_latest = started("t2", version=None)
    assert run(submit("t2", version=2), pinned_to_latest)[0] == Decision(())


def test_a_repeat_of_a_rejected_submission_is_admitted_once_there_is_room() -> None:
    full = Limits(max_in_flight=1)
    _, rejected = run(submit(), None, in_flight=1, limits=full)
    decision, still_rejected = run(submit(), rejected, in_flight=1, limits=full)
    assert types(decision) == [TaskRejected] and decision.dead_letter is None
    assert still_rejected is not None and still_rejected.status == "rejected"
    assert still_rejected.sequence == 2
    decision, admitted = run(submit(), still_rejected, in_flight=0, limits=full)
    assert types(decision) == [TaskAccepted, StepStarted]
    assert [e.sequence for e in decision.events] == [3, 4]
    assert admitted is not None and admitted.status == "running" and admitted.input == {"order": 42}


def test_a_repeat_of_a_finished_submission_changes_nothing() -> None:
    completed = started(workflow="one-shot")
    completed = apply(ok(completed), completed)
    assert completed.status == "completed"
    assert run(submit(workflow="one-shot"), completed)[0] == Decision(())


@pytest.mark.parametrize(
    "contradiction",
    [
        submit(input={"order": 43}),
        submit(version=2),
        submit(workflow="one-shot"),
    ],
    ids=["other input", "other version", "other workflow"],
)
def test_a_contradictory_duplicate_goes_to_the_dlq_with_an_alert_and_overwrites_nothing(
    contradiction: SubmitTask,
) -> None:
    state = started()
    decision, after = run(contradiction, state)
    assert types(decision) == [OperatorAlert]
    alert = decision.events[0]
    assert isinstance(alert, OperatorAlert)
    assert alert.sequence == state.sequence + 1 and alert.step is None
    assert alert.reason.startswith("contradictory duplicate submission")
    assert decision.dead_letter is not None and decision.dead_letter.startswith("contradictory duplicate")
    assert after == replace(state, sequence=state.sequence + 1)


def test_a_contradiction_of_a_rejected_submission_is_still_a_contradiction() -> None:
    _, rejected = run(submit(), None, in_flight=1, limits=Limits(max_in_flight=1))
    decision, after = run(submit(input={"other": True}), rejected)
    assert types(decision) == [OperatorAlert] and decision.dead_letter is not None
    assert after is not None and after.status == "rejected"


# ---- results ------------------------------------------------------------------------------------


def test_a_success_records_output_and_calls_then_starts_the_next_step() -> None:
    state = started()
    result = ok(state, output={"reserved": 1}, calls=2)
    decision, after = run(result, state, now=NOW + timedelta(seconds=5))
    assert types(decision) == [StepSucceeded, StepStarted]
    succeeded, nxt = decision.events
    assert isinstance(succeeded, StepSucceeded) and isinstance(nxt, StepStarted)
    assert (succeeded.step, succeeded.attempt_id, succeeded.output, succeeded.calls) == (
        "reserve", "t1:reserve:1", {"reserved": 1}, 2)
    assert (nxt.step, nxt.step_index, nxt.attempt, nxt.attempt_id) == ("charge", 1, 1, "t1:charge:1")
    assert nxt.start_by == NOW + timedelta(seconds=5 + 300)
    assert nxt.complete_by == nxt.start_by + timedelta(seconds=30)
    assert nxt.calls_allowed == 2
    assert all(e.causation_id == result.message_id for e in decision.events)
    assert after is not None
    assert [(s.name, s.status, s.calls_used) for s in after.steps] == [
        ("reserve", "succeeded", 2), ("charge", "processing", 0)]


def test_the_next_step_gets_the_task_input_and_every_earlier_output() -> None:
    state = started()
    state = apply(ok(state, output={"reserved": 1}), state)
    assert state.step_input() == {"task": {"order": 42}, "steps": {"reserve": {"reserved": 1}}}


def test_the_last_success_completes_the_task_with_every_step_output() -> None:
    state = started()
    for name in ("reserve", "charge"):
        state = apply(ok(state, output={name: True}), state)
    decision, after = run(ok(state, output={"ship": True}), state)
    assert types(decision) == [StepSucceeded, TaskCompleted]
    completed = decision.events[-1]
    assert isinstance(completed, TaskCompleted)
    assert completed.output == {"reserve": {"reserve": True}, "charge": {"charge": True}, "ship": {"ship": True}}
    assert after is not None and after.status == "completed" and after.is_terminal
    assert after.current_step is None


def test_a_success_without_output_records_an_empty_output() -> None:
    state = started()
    result = StepResult(task_id="t1", step="reserve", attempt_id="t1:reserve:1", ok=True)
    succeeded = run(result, state)[0].events[0]
    assert isinstance(succeeded, StepSucceeded) and succeeded.output == {}


def test_a_transient_failure_below_the_threshold_retries_with_a_new_attempt_and_deadline() -> None:
    state = started()
    later = NOW + timedelta(seconds=3)
    decision, after = run(failure(state, calls=2), state, now=later)
    assert types(decision) == [StepFailed, StepStarted]
    failed, retry = decision.events
    assert isinstance(failed, StepFailed) and isinstance(retry, StepStarted)
    assert (failed.permanent, failed.timed_out, failed.failure_count, failed.calls, failed.error) == (
        False, False, 1, 2, "boom")
    assert (retry.attempt, retry.attempt_id, retry.step_index) == (2, "t1:reserve:2", 0)
    assert retry.start_by == later + timedelta(seconds=300)
    assert after is not None
    step = current(after)
    assert (step.status, step.failure_count, step.calls_used, step.error) == ("processing", 1, 2, "boom")


def test_a_retry_is_granted_only_what_is_left_of_the_step_budget() -> None:
    state = started()  # reserve: budget 5, 3 per attempt
    decision, _ = run(failure(state, calls=3), state)
    retry = decision.events[-1]
    assert isinstance(retry, StepStarted) and retry.calls_allowed == 2


def test_a_transient_failure_reaching_the_threshold_fails_the_task_with_an_operator_alert() -> None:
    state = started()
    state = apply(failure(state, calls=0), state)
    state = apply(failure(state, calls=0), state)
    decision, after = run(failure(state, calls=0), state)
    assert types(decision) == [StepFailed, TaskFailed, OperatorAlert]
    failed, task_failed, alert = decision.events
    assert isinstance(failed, StepFailed) and failed.failure_count == 3
    assert isinstance(task_failed, TaskFailed) and isinstance(alert, OperatorAlert)
    assert task_failed.step == alert.step == "reserve"
    assert task_failed.reason == alert.reason and "failure threshold" in alert.reason
    assert after is not None and after.status == "error" and after.current_step is None
    assert after.steps[0].status == "failed"


def test_a_permanent_failure_escalates_at_once() -> None:
    state = started()
    decision, after = run(failure(state, permanent=True, error="card declined"), state)
    assert types(decision) == [StepFailed, TaskFailed, OperatorAlert]
    failed, task_failed, _ = decision.events
    assert isinstance(failed, StepFailed) and failed.permanent and failed.failure_count == 1
    assert isinstance(task_failed, TaskFailed) and "permanent" in task_failed.reason
    assert "card declined" in task_failed.reason
    assert after is not None and after.status == "error"


def test_a_failure_that_leaves_no_budget_escalates_below_the_threshold() -> None:
    state = started(workflow="one-shot")  # budget 2, threshold 5
    decision, after = run(failure(state, calls=2), state)
    assert types(decision) == [StepFailed, TaskFailed, OperatorAlert]
    assert "attempt budget exhausted" in reason(decision.events[1])
    assert after is not None and after.status == "error" and after.steps[0].calls_used == 2


def test_a_failure_without_detail_is_recorded_with_a_generic_error() -> None:
    state = started()
    failed = run(failure(state, error=None), state)[0].events[0]
    assert isinstance(failed, StepFailed) and failed.error


def test_calls_reported_beyond_the_allowance_are_capped_and_raise_an_alert() -> None:
    state = started()  # 3 calls allowed
    decision, after = run(ok(state, calls=7), state)
    assert types(decision) == [StepSucceeded, OperatorAlert, StepStarted]
    succeeded, alert, _ = decision.events
    assert isinstance(succeeded, StepSucceeded) and succeeded.calls == 3
    assert isinstance(alert, OperatorAlert) and "overspent" in alert.reason and alert.step == "reserve"
    assert after is not None and after.steps[0].calls_used == 3


def test_a_late_transient_failure_of_a_previous_attempt_is_recorded_as_ignored_and_changes_nothing() -> None:
    state = started()
    late = failure(state)  # names attempt 1
    state = apply(failure(state), state)  # attempt 2 is current now
    decision, after = run(late, state)
    assert types(decision) == [MessageIgnored]
    ignored = decision.events[0]
    assert isinstance(ignored, MessageIgnored)
    assert (ignored.attempt_id, ignored.message_type) == ("t1:reserve:1", "StepResult")
    assert "not the current attempt" in ignored.reason
    assert after == replace(state, sequence=state.sequence + 1)


def test_a_late_permanent_failure_of_a_previous_attempt_is_recorded_and_changes_nothing() -> None:
    state = started()
    late = failure(state, permanent=True, error="refused")  # names attempt 1
    state = apply(failure(state), state)  # attempt 2 is current now
    decision, after = run(late, state)
    assert types(decision) == [LateResultRecorded]
    recorded = decision.events[0]
    assert isinstance(recorded, LateResultRecorded)
    assert (recorded.step, recorded.attempt_id, recorded.ok, recorded.permanent, recorded.compensation) == (
        "reserve", "t1:reserve:1", False, True, False)
    assert recorded.consequence == ("late answer for step 'reserve': that call was refused, earlier calls may have "
                                    "landed; attempt t1:reserve:2 in progress uses the same idempotency key and "
                                    "gets it replayed")
    assert after == replace(state, sequence=state.sequence + 1)


@pytest.mark.parametrize(
    ("step", "attempt"),
    [("reserve", "t1:reserve:9"), ("reserve", "bogus"), ("charge", "t1:reserve:1")],
    ids=["future attempt", "garbage id", "other step"],
)
def test_a_result_that_does_not_name_the_current_attempt_is_ignored(step: str, attempt: str) -> None:
    state = started()
    result = StepResult(task_id="t1", step=step, attempt_id=attempt, ok=True, output={})
    decision, after = run(result, state)
    assert types(decision) == [MessageIgnored]
    assert after == replace(state, sequence=state.sequence + 1)


def test_a_duplicate_success_for_a_finished_task_is_recorded_as_a_late_result_and_changes_nothing() -> None:
    state = started(workflow="one-shot")
    duplicate = ok(state)
    state = apply(duplicate, state)
    decision, after = run(duplicate, state)
    assert types(decision) == [LateResultRecorded]
    late = decision.events[0]
    assert isinstance(late, LateResultRecorded)
    assert (late.step, late.attempt_id, late.ok, late.permanent, late.compensation) == (
        "only", "t1:only:1", True, False, False)
    assert "the step already succeeded with the same idempotency key" in late.consequence
    assert after == replace(state, sequence=state.sequence + 1) and after.status == "completed"


def test_a_transient_failure_for_a_finished_task_is_ignored() -> None:
    state = started(workflow="one-shot")
    duplicate = failure(state)
    state = apply(ok(state), state)
    decision, after = run(duplicate, state)
    assert types(decision) == [MessageIgnored]
    assert "task is completed" in reason(decision.events[0])
    assert after == replace(state, sequence=state.sequence + 1) and after.status == "completed"


def test_a_result_or_recovery_for_an_unknown_task_goes_to_the_dlq() -> None:
    result = StepResult(task_id="ghost", step="reserve", attempt_id="ghost:reserve:1", ok=True)
    recovery = RecoverStep(task_id="ghost", attempt_id="ghost:reserve:1", reason="expired")
    for command in (result, recovery):
        decision = run(command, None)[0]
        assert decision.events == ()
        assert decision.dead_letter is not None and decision.dead_letter.startswith("unknown task")


def test_a_result_for_a_task_whose_workflow_is_no_longer_registered_goes_to_the_dlq() -> None:
    state = started()
    decision, after = run(ok(state), state, registry=WorkflowRegistry.of([ORDERS_V2]))
    assert decision.events == ()
    assert decision.dead_letter is not None and decision.dead_letter.startswith("unknown workflow")
    assert after == state


# ---- acknowledgements: queued, then running ------------------------------------------------------


def test_an_acknowledgement_starts_the_work_deadline_and_records_the_queue_wait() -> None:
    state = started()
    taken = NOW + timedelta(seconds=40)
    decision, after = run(accept(state, taken), state, now=taken + timedelta(milliseconds=3))
    assert types(decision) == [StepAccepted]
    accepted = decision.events[0]
    assert isinstance(accepted, StepAccepted)
    assert (accepted.step, accepted.attempt_id, accepted.compensation) == ("reserve", "t1:reserve:1", False)
    assert (accepted.accepted_at, accepted.complete_by, accepted.waited_ms) == (
        taken, taken + timedelta(seconds=10), 40_000)
    assert after is not None and current(after).status == "processing"
    assert current(after).deadline == taken + timedelta(seconds=10)


def test_a_queued_attempt_is_recovered_only_after_its_start_by_charged_its_whole_allowance() -> None:
    state = started()
    start_by = NOW + timedelta(seconds=300)
    decision, _ = run(recover(state), state, now=start_by - timedelta(milliseconds=1))
    assert types(decision) == [MessageIgnored]
    assert reason(decision.events[0]).startswith("start-by not passed")
    decision, after = run(recover(state), state, now=start_by)
    assert types(decision) == [StepFailed, StepStarted]
    failed = decision.events[0]
    assert isinstance(failed, StepFailed) and failed.timed_out and failed.calls == 3
    assert "not taken by an agent before its start-by" in failed.error
    assert after is not None and current(after).attempt == 2


def test_an_accepted_attempt_is_recovered_only_after_its_complete_by_not_its_start_by() -> None:
    taken = NOW + timedelta(seconds=100)
    state = running(started(), taken)
    decision, _ = run(recover(state), state, now=taken + timedelta(seconds=9))
    assert types(decision) == [MessageIgnored]
    assert reason(decision.events[0]).startswith("deadline not passed")
    decision, _ = run(recover(state), state, now=taken + timedelta(seconds=10))
    assert types(decision) == [StepFailed, StepStarted]
    failed = decision.events[0]
    assert isinstance(failed, StepFailed) and "timed out" in failed.error


def test_a_second_acknowledgement_of_the_same_attempt_changes_nothing() -> None:
    state = running(started(), NOW + timedelta(seconds=1))
    decision, after = run(accept(state, NOW + timedelta(seconds=8)), state)  # a redelivered request, taken again
    assert types(decision) == [MessageIgnored]
    assert "already accepted" in reason(decision.events[0])
    assert after == replace(state, sequence=state.sequence + 1)
    assert current(after).deadline == NOW + timedelta(seconds=11)


def test_an_acknowledgement_for_an_attempt_that_is_not_current_changes_nothing() -> None:
    state = started()
    stale = accept(state)
    state = apply(failure(state), state)
    decision, after = run(stale, state)
    assert types(decision) == [MessageIgnored]
    assert reason(decision.events[0]).startswith("not the current attempt")
    assert after == replace(state, sequence=state.sequence + 1)


def test_an_acknowledgement_after_the_start_by_cannot_extend_the_attempts_latest_end() -> None:
    state = started()
    taken = NOW + timedelta(seconds=305)  # the agent's clock runs ahead, or the supervisor has not acted yet
    accepted = run(accept(state, taken), state)[0].events[0]
    assert isinstance(accepted, StepAccepted)
    assert accepted.complete_by == NOW + timedelta(seconds=310), "start-by + timeout, not taken + timeout"


def test_a_result_without_an_acknowledgement_is_accepted_for_the_queued_attempt() -> None:
    state = started()
    decision, after = run(ok(state), state)  # the acknowledgement was lost, or the agent predates it
    assert types(decision) == [StepSucceeded, StepStarted]
    assert after is not None and [s.status for s in after.steps] == ["succeeded", "processing"]


# ---- recoveries ---------------------------------------------------------------------------------


def test_a_recovery_before_the_deadline_is_ignored() -> None:
    state = running(started())
    decision, after = run(recover(state), state, now=NOW + timedelta(seconds=9))
    assert types(decision) == [MessageIgnored]
    ignored = decision.events[0]
    assert isinstance(ignored, MessageIgnored)
    assert ignored.reason.startswith("deadline not passed") and ignored.message_type == "RecoverStep"
    assert after == replace(state, sequence=state.sequence + 1)


@pytest.mark.parametrize("late_by", [timedelta(0), timedelta(minutes=5)], ids=["at deadline", "after"])
def test_a_recovery_at_or_after_the_deadline_times_the_attempt_out_and_retries(late_by: timedelta) -> None:
    state = running(started())
    when = NOW + timedelta(seconds=10) + late_by
    decision, after = run(recover(state), state, now=when)
    assert types(decision) == [StepFailed, StepStarted]
    failed, retry = decision.events
    assert isinstance(failed, StepFailed) and isinstance(retry, StepStarted)
    assert failed.timed_out and not failed.permanent and failed.failure_count == 1
    assert failed.calls == 3  # the whole allowance of the dead attempt
    assert (retry.attempt, retry.start_by, retry.calls_allowed) == (2, when + timedelta(seconds=300), 2)
    assert after is not None and current(after).calls_used == 3


def test_a_timeout_that_reaches_the_threshold_escalates() -> None:
    state = started()
    for _ in range(2):
        state = apply(failure(state, calls=0), state)
    decision, after = run(recover(state), state, now=NOW + timedelta(hours=1))
    assert types(decision) == [StepFailed, TaskFailed, OperatorAlert]
    assert after is not None and after.status == "error"


def test_a_timeout_charging_the_whole_allowance_can_exhaust_the_budget() -> None:
    state = started(workflow="one-shot")  # budget 2, first attempt allowed 2
    decision, after = run(recover(state), state, now=NOW + timedelta(hours=1))
    assert types(decision) == [StepFailed, TaskFailed, OperatorAlert]
    assert "attempt budget exhausted" in reason(decision.events[1])
    assert after is not None and after.steps[0].calls_used == 2


def test_a_recovery_naming_an_attempt_that_is_no_longer_current_changes_nothing() -> None:
    state = started()
    stale = recover(state)
    state = apply(ok(state), state)
    decision, after = run(stale, state, now=NOW + timedelta(hours=1))
    assert types(decision) == [MessageIgnored]
    assert after == replace(state, sequence=state.sequence + 1)


def test_a_recovery_of_a_failed_task_is_ignored() -> None:
    state = started()
    stale = recover(state)
    state = apply(failure(state, permanent=True), state)
    decision, after = run(stale, state, now=NOW + timedelta(hours=1))
    assert types(decision) == [MessageIgnored]
    assert "task is error" in reason(decision.events[0])
    assert after is not None and after.status == "error"


# ---- determinism and the caller's contract -----------------------------------------------------------


def test_the_same_command_on_the_same_state_decides_the_same_events() -> None:
    state = started()
    result = failure(state)
    assert run(result, state)[0] == run(result, state)[0]
    assert run(submit(), None)[0].events[0].message_id != run(submit("t2"), None)[0].events[0].message_id


def test_event_ids_are_unique_within_a_task_history() -> None:
    state = started()
    history = list(run(submit(), None)[0].events)
    for _ in range(2):
        decision = run(failure(state), state)[0]
        history.extend(decision.events)
        state = apply(failure(state), state)
    assert len({e.message_id for e in history}) == len(history)


def test_decide_refuses_a_naive_clock_and_the_state_of_another_task() -> None:
    with pytest.raises(ValueError, match="time zone"):
        decide(submit(), None, registry=REGISTRY, now=NOW.replace(tzinfo=None), in_flight=0, limits=Limits())
    with pytest.raises(ValueError, match="state of task"):
        decide(submit("t2"), started(), registry=REGISTRY, now=NOW, in_flight=0, limits=Limits())


def test_terminal_statuses_and_the_final_ones_no_operator_can_leave() -> None:
    assert frozenset({"completed", "error", "rejected", "compensated", "compensation_failed"}) == TERMINAL
    assert frozenset({"completed", "compensated"}) == FINAL


# ---- evolve and fold ----------------------------------------------------------------------------


def history() -> list[Event]:
    """A complete history: accepted, a retried first step (each attempt acknowledged), two more steps whose
    results came without an acknowledgement, completed."""
    events: list[Event] = []
    state: TaskState | None = None
    commands: list[Any] = [submit()]
    for make in (accept, lambda s: failure(s), accept, ok, ok, ok):
        decision, state = run(commands[-1], state)
        events.extend(decision.events)
        assert state is not None
        commands.append(make(state))
    decision, state = run(commands[-1], state)
    events.extend(decision.events)
    assert state is not None and state.status == "completed"
    return events


def test_fold_of_nothing_is_no_task() -> None:
    assert fold([]) is None


def test_fold_continues_from_a_given_state() -> None:
    events = history()
    assert fold(events[3:], fold(events[:3])) == fold(events)


def test_replaying_the_history_through_the_avro_codec_gives_the_same_state() -> None:
    codec = default_codec()
    events = history()
    decoded = [codec.decode(codec.encode(event)) for event in events]
    assert decoded == events
    assert fold(e for e in decoded if isinstance(e, Event)) == fold(events)


def test_a_gap_in_the_sequence_is_an_invalid_transition() -> None:
    events = history()
    with pytest.raises(InvalidTransition, match="sequence"):
        fold(events[:2] + events[3:])


def test_an_event_applied_twice_is_an_invalid_transition() -> None:
    events = history()
    with pytest.raises(InvalidTransition):
        fold([*events[:3], events[2]])


def test_invalid_transitions_are_value_errors() -> None:
    assert issubclass(InvalidTransition, ValueError)


def event(kind: type[Event], sequence: int, **fields: Any) -> Event:
    base: dict[str, Any] = {"task_id": "t1", "sequence": sequence, "workflow": "orders", "workflow_version": 1,
                            "causation_id": "c", "occurred_at": NOW}
    return kind(**(base | fields))


def accepted() -> Event:
    return event(TaskAccepted, 1, input={}, input_digest="d")


def start(sequence: int, step: str = "reserve", index: int = 0, attempt: int = 1) -> Event:
    return event(StepStarted, sequence, step=step, step_index=index, attempt=attempt,
                 attempt_id=attempt_id("t1", step, attempt), complete_by=NOW, calls_allowed=1)


def queued(sequence: int, step: str = "reserve", index: int = 0, attempt: int = 1) -> Event:
    return event(StepStarted, sequence, step=step, step_index=index, attempt=attempt,
                 attempt_id=attempt_id("t1", step, attempt), start_by=NOW, complete_by=NOW, calls_allowed=1)


def taken(sequence: int, step: str = "reserve", attempt: int = 1, compensation: bool = False) -> Event:
    return event(StepAccepted, sequence, step=step, attempt_id=attempt_id("t1", step, attempt),
                 compensation=compensation, accepted_at=NOW, complete_by=NOW, waited_ms=0)


def succeed(sequence: int, step: str = "reserve", attempt: int = 1) -> Event:
    return event(StepSucceeded, sequence, step=step, attempt_id=attempt_id("t1", step, attempt), output={},
                 calls=1)


def fail(sequence: int, failure_count: int = 1, step: str = "reserve", attempt: int = 1) -> Event:
    return event(StepFailed, sequence, step=step, attempt_id=attempt_id("t1", step, attempt), error="e",
                 permanent=False, calls=1, failure_count=failure_count)


@pytest.mark.parametrize(
    "events",
    [
        [start(1)],
        [event(TaskAccepted, 2, input={}, input_digest="d")],
        [accepted(), event(TaskAccepted, 2, input={}, input_digest="d")],
        [accepted(), event(TaskRejected, 2, reason="r")],
        [accepted(), start(2, attempt=2)],
        [accepted(), start(2, step="charge", index=1)],
        [accepted(), start(2), fail(3), start(4, step="charge", index=0, attempt=2)],
        [accepted(), start(2), start(3, step="charge", index=1)],
        [accepted(), start(2), start(3, attempt=2)],
        [accepted(), start(2), succeed(3, attempt=2)],
        [accepted(), start(2), succeed(3, step="charge")],
        [accepted(), start(2), succeed(3), succeed(4)],
        [accepted(), start(2), fail(3, failure_count=2)],
        [accepted(), start(2), fail(3), start(4, step="reserve", attempt=1)],
        [accepted(), start(2), fail(3), start(4, step="charge", index=1)],
        [accepted(), start(2), event(TaskCompleted, 3, output={})],
        [accepted(), event(TaskCompleted, 2, output={})],
        [accepted(), start(2), event(TaskFailed, 3, step="reserve", reason="r")],
        [accepted(), start(2), fail(3), event(TaskFailed, 4, step="charge", reason="r")],
        [accepted(), start(2), succeed(3), event(TaskCompleted, 4, output={}), start(5, "charge", 1)],
        [event(TaskRejected, 1, reason="r"), start(2)],
        [accepted(), event(OperatorAlert, 2, reason="r", task_id="t2")],
        [accepted(), event(OperatorAlert, 2, reason="r", workflow_version=2)],
        [accepted(), event(MessageIgnored, 3, attempt_id="a", message_type="m", reason="r")],
        [accepted(), start(2), taken(3)],
        [accepted(), queued(2), taken(3), taken(4)],
        [accepted(), queued(2), taken(3, attempt=2)],
        [accepted(), queued(2), taken(3, compensation=True)],
        [accepted(), queued(2), succeed(3), taken(4)],
    ],
    ids=[
        "first event not an admission",
        "first event not at sequence 1",
        "accepted twice",
        "rejected after accepted",
        "first attempt numbered 2",
        "step skipped",
        "step index and name disagree",
        "second step while first in progress",
        "second attempt while first in progress",
        "outcome of another attempt",
        "outcome of another step",
        "outcome recorded twice",
        "failure count skipped",
        "retry reusing an attempt number",
        "next step after a failure",
        "completed with a step in progress",
        "completed before any step",
        "task failed on a step that did not fail",
        "task failed on another step",
        "step after completion",
        "step after rejection",
        "event of another task",
        "event of another workflow version",
        "ignored message with a gap",
        "accepted without a start-by",
        "accepted twice",
        "acceptance of another attempt",
        "forward attempt accepted as a compensation",
        "accepted after its outcome",
    ],
)
def test_impossible_histories_are_invalid_transitions(events: list[Event]) -> None:
    with pytest.raises(InvalidTransition):
        fold(events)


def test_ignored_messages_late_results_and_alerts_may_follow_a_terminal_state_and_only_advance_the_sequence() -> None:
    events = history()
    done = fold(events)
    assert done is not None and done.is_terminal
    more = [event(MessageIgnored, len(events) + 1, attempt_id="a", message_type="StepResult", reason="r"),
            event(LateResultRecorded, len(events) + 2, step="reserve", attempt_id="t1:reserve:1", ok=True,
                  consequence="c"),
            event(OperatorAlert, len(events) + 3, reason="r")]
    assert fold(more, done) == replace(done, sequence=len(events) + 3)


def test_evolve_builds_a_step_when_its_first_attempt_starts() -> None:
    state = evolve(evolve(None, accepted()), start(2))
    assert state.status == "running" and state.current_step == 0
    assert state.steps == (StepState("reserve", "processing", 1, "t1:reserve:1", Lease(NOW, NOW), calls_allowed=1,
                                     first_started_at=NOW),)
