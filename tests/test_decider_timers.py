"""Timers in the decider, rule by rule: back-off, the agent's suggested delay, deferrals, and firing.

The property tests (test_decider_properties.py) check the same rules on random histories; these name each
rule once with its numbers, so a failure says which one broke.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

import demo.workflows as demo
from scheduler.decider import Limits, TaskState, decide, fold, pending
from scheduler.decider.decision import Command
from scheduler.workflow import Backoff, Compensation, Step, Workflow, WorkflowRegistry
from schemas.messages import (
    ErrorKind,
    Event,
    OperatorCommand,
    RetryBroughtForward,
    StepCompensationFailed,
    StepFailed,
    StepResult,
    StepRetryScheduled,
    StepStarted,
    SubmitTask,
    TaskFailed,
)
from schemas.messages import RetryDue as Fire

NOW = datetime(2025, 1, 1, 12, 0, tzinfo=UTC)
BACKOFF = Backoff(initial_s=2, multiplier=3, max_s=10, jitter=0)
FLOW = Workflow("flow", 1, (Step("pay", "payments", attempt_budget=4, calls_per_attempt=2, backoff=BACKOFF,
                                 compensation=Compensation("refund", backoff=BACKOFF)),),
                failure_threshold=3, escalation="compensate")
PATIENT = Workflow("patient", 1, (Step("pay", "payments", attempt_budget=5, calls_per_attempt=1, backoff=BACKOFF),),
                   failure_threshold=2, escalation="backoff", long_backoff_s=600, backoff_rounds=1)
# Rounds enough for ten minutes, but a step may only be retried for a minute from its first attempt.
BOUNDED = Workflow("bounded", 1, (Step("pay", "payments", attempt_budget=50, calls_per_attempt=1, backoff=BACKOFF),),
                   failure_threshold=2, escalation="backoff", long_backoff_s=30, backoff_rounds=10, step_total_s=60)
# An undo that waits two minutes for a fresh round of attempts, once, before it gives up.
UNDO_WAITS = Workflow("undo-waits", 1, (Step("pay", "payments", backoff=BACKOFF, compensation=Compensation(
    "refund", attempt_budget=20, calls_per_attempt=1, backoff=BACKOFF, long_backoff_s=120, backoff_rounds=1)),),
    failure_threshold=2, escalation="compensate")
REGISTRY = WorkflowRegistry.of([FLOW, PATIENT, BOUNDED, UNDO_WAITS])


def run(state: TaskState | None, command: Command, now: datetime = NOW) -> tuple[TaskState, tuple[Event, ...]]:
    return decide_in(REGISTRY, state, command, now)


def started() -> TaskState:
    state, _ = run(None, SubmitTask(task_id="t", workflow="flow", input={}))
    return state


def failure(state: TaskState, *, calls: int = 1, kind: ErrorKind = "server_error",
            retry_after_s: float | None = None) -> StepResult:
    assert state.current_step is not None
    step = state.steps[state.current_step]
    return StepResult(task_id="t", step=step.name, attempt_id=step.lock or "", ok=False, error="503", calls=calls,
                      error_kind=kind, retry_after_s=retry_after_s)


def fire_for(event: StepRetryScheduled) -> Fire:
    return Fire(task_id="t", step=event.step, attempt=event.attempt, not_before=event.not_before,
                compensation=event.compensation)


def test_backoff_grows_exponentially_to_its_cap_and_its_jitter_is_deterministic_and_bounded() -> None:
    assert [BACKOFF.delay_s(n, "seed") for n in (1, 2, 3, 4)] == [2, 6, 10, 10]
    jittered = Backoff(initial_s=10, jitter=0.5)
    delays = {jittered.delay_s(1, f"attempt-{n}") for n in range(200)}
    assert all(5 <= d <= 15 for d in delays) and len(delays) > 100
    assert jittered.delay_s(1, "same") == jittered.delay_s(1, "same")
    assert Backoff().delay_s(3, "x") == 0, "the default retries at once, as before timers existed"


def test_a_failed_attempt_waits_out_its_backoff_and_starts_only_when_its_timer_fires() -> None:
    state, events = run(started(), failure(started()))
    assert [type(e) for e in events] == [StepFailed, StepRetryScheduled]
    timer = events[1]
    assert isinstance(timer, StepRetryScheduled)
    assert (timer.attempt, timer.not_before, timer.error_kind) == (2, NOW + timedelta(seconds=2), "server_error")
    assert state.steps[0].status == "waiting" and state.current_step is None

    early, nothing = run(state, fire_for(timer), NOW + timedelta(seconds=1.999))
    assert nothing == () and early == state, "a timer fired early changes nothing"
    state, events = run(state, fire_for(timer), timer.not_before)
    assert [type(e) for e in events] == [StepStarted]
    assert state.steps[0].status == "processing" and state.steps[0].attempt == 2

    again, twice = run(state, fire_for(timer), timer.not_before + timedelta(seconds=5))
    assert twice == () and again == state, "a timer fired twice starts nothing the second time"


def test_retry_after_longer_than_the_backoff_is_a_floor_for_the_next_attempt() -> None:
    _, events = run(started(), failure(started(), kind="throttled", retry_after_s=10))
    timer = events[-1]
    assert isinstance(timer, StepRetryScheduled)
    assert timer.not_before == NOW + timedelta(seconds=10) and timer.error_kind == "throttled"


def test_a_throttled_attempt_charges_its_calls_but_counts_no_failure_of_the_step() -> None:
    state, events = run(started(), failure(started(), calls=2, kind="throttled", retry_after_s=2))
    failed, timer = events
    assert isinstance(failed, StepFailed) and failed.failure_count == 0 and failed.calls == 2
    assert failed.error_kind == "throttled"
    assert isinstance(timer, StepRetryScheduled) and timer.not_before == NOW + timedelta(seconds=2)
    assert timer.reason.startswith("throttled, not failed: the service asked to wait 2.0s")
    step = state.steps[0]
    assert (step.status, step.failure_count, step.calls_used) == ("waiting", 0, 2)


def test_a_throttled_undo_charges_its_calls_but_counts_no_failure_of_the_compensation() -> None:
    state = started()
    for _ in range(3):  # three failures reach the threshold: the task is undone
        state, events = run(state, failure(state))
        if isinstance(events[-1], StepRetryScheduled):
            state, _ = run(state, fire_for(events[-1]), events[-1].not_before)
    assert state.status == "compensating"
    state, events = run(state, failure(state, calls=1, kind="throttled", retry_after_s=3))
    failed, timer_event = events
    assert isinstance(failed, StepCompensationFailed) and failed.failure_count == 0 and failed.calls == 1
    assert failed.error_kind == "throttled"
    assert isinstance(timer_event, StepRetryScheduled) and timer_event.compensation
    assert timer_event.not_before == NOW + timedelta(seconds=3)


def test_a_step_throttled_on_every_attempt_still_ends_when_its_call_budget_is_spent() -> None:
    state, attempts = started(), 0
    while state.status == "running" and state.steps[0].status == "processing":
        attempts += 1
        state, events = run(state, failure(state, calls=1, kind="throttled", retry_after_s=0))
    step = state.steps[0]
    assert attempts == 4 and (step.calls_used, step.failure_count) == (4, 0), "the budget ends it, not failures"
    assert state.status != "running", f"escalated: {state.status}"
    last = events[0]
    assert isinstance(last, StepFailed) and last.error_kind == "throttled", \
        "the last attempt, with no timer after it, still records that it was throttled"
    assert not any(isinstance(e, StepRetryScheduled) for e in events)


@pytest.mark.parametrize("kind", ["breaker_open", "budget_spent"])
def test_an_attempt_refused_without_a_call_is_deferred_and_counts_no_failure_and_no_call(kind: ErrorKind) -> None:
    state, events = run(started(), failure(started(), calls=0, kind=kind, retry_after_s=7.5))
    assert [type(e) for e in events] == [StepRetryScheduled]
    timer = events[0]
    assert isinstance(timer, StepRetryScheduled)
    assert timer.deferred_attempt_id == "t:pay:1" and timer.not_before == NOW + timedelta(seconds=7.5)
    step = state.steps[0]
    assert (step.status, step.failure_count, step.calls_used) == ("waiting", 0, 0)


def test_a_deferral_waits_at_least_a_second_even_when_the_agent_suggests_nothing() -> None:
    _, events = run(started(), failure(started(), calls=0, kind="budget_spent"))
    timer = events[0]
    assert isinstance(timer, StepRetryScheduled) and timer.not_before == NOW + timedelta(seconds=1)


def test_a_failed_undo_waits_out_the_compensations_backoff() -> None:
    state = started()
    for _ in range(3):  # three failures reach the threshold; the first two wait for their timers
        state, events = run(state, failure(state))
        if isinstance(events[-1], StepRetryScheduled):
            state, _ = run(state, fire_for(events[-1]), events[-1].not_before)
    assert state.status == "compensating" and state.steps[0].status == "compensating"
    state, events = run(state, failure(state), NOW + timedelta(minutes=1))
    timer = events[-1]
    assert isinstance(timer, StepRetryScheduled) and timer.compensation
    assert state.steps[0].status == "waiting"
    _, nothing = run(state, fire_for(timer), timer.not_before - timedelta(milliseconds=1))
    assert nothing == ()
    state, _ = run(state, fire_for(timer), timer.not_before)
    assert state.steps[0].status == "compensating" and state.steps[0].compensation.attempt == timer.attempt


def test_an_operators_try_now_starts_the_waiting_attempt_at_once_and_the_old_timer_then_changes_nothing() -> None:
    state, events = run(started(), failure(started(), retry_after_s=60))
    timer = events[-1]
    assert isinstance(timer, StepRetryScheduled)
    soon = NOW + timedelta(seconds=3)
    state, events = run(state, OperatorCommand(task_id="t", command_id="c1", action="try-now", operator="ann"), soon)
    assert [type(e) for e in events] == [RetryBroughtForward, StepStarted]
    assert state.steps[0].status == "processing" and state.steps[0].attempt == 2
    after, nothing = run(state, fire_for(timer), timer.not_before)
    assert nothing == () and after == state


def test_try_now_without_a_waiting_step_is_refused() -> None:
    _, events = run(started(), OperatorCommand(task_id="t", command_id="c1", action="try-now"))
    assert [type(e).__name__ for e in events] == ["OperatorCommandRefused"]


def last_timer(events: tuple[Event, ...]) -> StepRetryScheduled:
    timer = events[-1]
    assert isinstance(timer, StepRetryScheduled)
    return timer


def test_past_the_threshold_a_backoff_escalation_waits_the_long_period_then_starts_a_fresh_round_then_escalates(
) -> None:
    state, _ = run(None, SubmitTask(task_id="t", workflow="patient", input={}))
    state, events = run(state, failure(state))
    short = last_timer(events)
    state, _ = run(state, fire_for(short), short.not_before)
    state, events = run(state, failure(state), short.not_before)  # the second failure: the threshold
    long = last_timer(events)
    assert long.new_round and long.not_before == short.not_before + timedelta(seconds=600)
    assert "long back-off" in long.reason and "round 2 of 2" in long.reason
    assert (state.steps[0].status, state.steps[0].failure_count, state.steps[0].rounds) == ("waiting", 0, 1)
    assert state.steps[0].calls_used == 2, "a new round starts the failure count again, never the budget"

    state, _ = run(state, fire_for(long), long.not_before)
    state, events = run(state, failure(state), long.not_before)
    again = last_timer(events)
    assert not again.new_round, "the fresh round backs off between its attempts as the first did"
    state, _ = run(state, fire_for(again), again.not_before)
    state, events = run(state, failure(state), again.not_before)  # no rounds left: after_backoff (error)
    assert state.status == "error" and [type(e).__name__ for e in events][-2:] == ["TaskFailed", "OperatorAlert"]


def bounded() -> TaskState:
    state, _ = run(None, SubmitTask(task_id="t", workflow="bounded", input={}))
    return state


def test_deferrals_count_against_a_steps_total_time_and_one_that_would_end_past_it_escalates_instead() -> None:
    state, now = bounded(), NOW
    for _ in range(2):  # an open breaker for 25 s, twice: each deferral waits, neither is a failure
        state, events = run(state, failure(state, calls=0, kind="breaker_open", retry_after_s=25), now)
        timer = last_timer(events)
        assert timer.deferred_attempt_id and state.steps[0].failure_count == 0
        now = timer.not_before
        state, _ = run(state, fire_for(timer), now)
    assert now == NOW + timedelta(seconds=50)
    state, events = run(state, failure(state, calls=0, kind="breaker_open", retry_after_s=25), now)
    assert [type(e).__name__ for e in events] == ["StepFailed", "TaskFailed", "OperatorAlert"], \
        "a third deferral would end 75 s after the first attempt, past the minute: the step gives up instead"
    gave_up = events[0]
    assert isinstance(gave_up, StepFailed) and gave_up.calls == 0 and "total time" in gave_up.error
    assert gave_up.error_kind == "breaker_open", "the attempt that gave up says why it made no call"
    assert state.status == "error" and state.steps[0].calls_used == 0, "giving up charged no call"


def test_a_steps_back_off_rounds_end_at_its_total_time_although_rounds_are_left() -> None:
    state, now = bounded(), NOW
    state, events = run(state, failure(state), now)  # back-off 2 s
    now = last_timer(events).not_before
    state, _ = run(state, fire_for(last_timer(events)), now)
    state, events = run(state, failure(state), now)  # the threshold: a long back-off of 30 s, within the minute
    long = last_timer(events)
    assert long.new_round and long.not_before == NOW + timedelta(seconds=32)
    state, _ = run(state, fire_for(long), long.not_before)
    state, events = run(state, failure(state), long.not_before)  # back-off 2 s: 34 s
    now = last_timer(events).not_before
    state, _ = run(state, fire_for(last_timer(events)), now)
    state, events = run(state, failure(state), now)  # the threshold again: another long one would end at 64 s
    assert [type(e).__name__ for e in events] == ["StepFailed", "TaskFailed", "OperatorAlert"]
    assert state.status == "error" and state.steps[0].rounds == 1, "nine rounds were left; the minute was not"
    failed = events[1]
    assert isinstance(failed, TaskFailed) and "failure threshold" in failed.reason and "total time" in failed.reason

    resubmitted, events = run(state, OperatorCommand(task_id="t", command_id="c1", action="resubmit"),
                              now + timedelta(minutes=5))
    assert [type(e).__name__ for e in events][-1] == "StepStarted"
    _, events = run(resubmitted, failure(resubmitted), now + timedelta(minutes=5))
    assert isinstance(events[-1], StepRetryScheduled), "an operator's resubmit starts the step's total time again"


def test_a_total_time_for_a_step_must_be_positive() -> None:
    with pytest.raises(ValueError, match="step_total_s"):
        Workflow("w", 1, (Step("s", "a"),), step_total_s=0)


def failing_undo(rounds: int) -> tuple[TaskState, datetime, list[StepRetryScheduled]]:
    """A task of ``undo-waits`` whose step was refused for good, then whose undo failed ``rounds`` full rounds
    (two failed attempts each, every timer fired when due): its state, the clock, and the undo's timers."""
    state, _ = run(None, SubmitTask(task_id="t", workflow="undo-waits", input={}))
    state, _ = run(state, failure(state).model_copy(update={"permanent": True}))
    assert state.status == "compensating"
    now, timers = NOW, []
    for _ in range(2 * rounds):
        state, events = run(state, failure(state), now)
        if isinstance(events[-1], StepRetryScheduled):
            timers.append(events[-1])
            now = events[-1].not_before
            state, _ = run(state, fire_for(events[-1]), now)
    return state, now, timers


def test_an_undo_past_the_threshold_waits_the_long_period_for_a_fresh_round_instead_of_failing() -> None:
    state, now, timers = failing_undo(rounds=1)
    assert [(t.compensation, t.new_round) for t in timers] == [(True, False), (True, True)]
    long = timers[-1]
    assert long.not_before - timers[0].not_before == timedelta(seconds=120) and "undo round 2 of 2" in long.reason
    undo = state.steps[0].compensation
    assert (state.status, undo.failure_count, undo.rounds, undo.calls_used) == ("compensating", 0, 1, 2), \
        "the fresh round starts the undo's failure count again, never its budget"
    state, events = run(state, StepResult(task_id="t", step="pay", attempt_id=undo.attempt_id or "", ok=True,
                                          output={}, calls=1), now)
    assert state.status == "compensated" and [type(e).__name__ for e in events][-1] == "TaskCompensated"


def test_an_undo_whose_long_back_off_rounds_are_spent_fails_for_an_operator() -> None:
    state, _, timers = failing_undo(rounds=2)
    assert [t.new_round for t in timers] == [False, True, False]
    assert state.status == "compensation_failed" and state.steps[0].compensation.rounds == 1


def test_an_undo_without_long_back_off_rounds_fails_at_its_threshold_as_before() -> None:
    state = started()  # flow: its refund declares no rounds
    state, _ = run(state, failure(state).model_copy(update={"permanent": True}))
    for _ in range(3):
        state, events = run(state, failure(state), NOW + timedelta(hours=1))
        if isinstance(events[-1], StepRetryScheduled):
            assert not events[-1].new_round
            state, _ = run(state, fire_for(events[-1]), events[-1].not_before)
    assert state.status == "compensation_failed"


def test_the_demos_orders_workflow_waits_out_a_one_minute_outage_without_failing_or_compensating() -> None:
    """Every attempt fails at once while the outage lasts (the worst case: only back-off spends time)."""
    registry = demo.REGISTRY
    state, _ = decide_in(registry, None, SubmitTask(task_id="o", workflow="orders", input={
        "order_id": "o", "sku": "A-1", "qty": 1, "amount": 10, "card_token": "tok_4242"}), NOW)
    outage_ends = NOW + timedelta(seconds=demo.OUTAGE_RIDDEN_S)
    now = NOW
    while not state.is_terminal:
        now += timedelta(milliseconds=100)
        due = pending(state)
        if due is not None:
            now = max(now, due.not_before)
            state, _ = decide_in(registry, state, due, now)
            continue
        assert state.current_step is not None
        step = state.steps[state.current_step]
        answer = StepResult(task_id="o", step=step.name, attempt_id=step.lock or "", ok=now >= outage_ends,
                            output={}, error="503", calls=step.calls_allowed, error_kind="server_error")
        state, _ = decide_in(registry, state, answer, now)
    assert state.status == "completed" and state.workflow_version == demo.ORDERS_V4.version, "the latest version"
    assert all(step.calls_used <= 30 for step in state.steps)


def decide_in(registry: WorkflowRegistry, state: TaskState | None, command: Command,
              now: datetime) -> tuple[TaskState, tuple[Event, ...]]:
    decision = decide(command, state, registry=registry, now=now, in_flight=0, limits=Limits())
    after = fold(decision.events, state)
    assert after is not None
    return after, decision.events
