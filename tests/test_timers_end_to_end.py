"""Waiting between attempts end to end: real broker, the order service over HTTP, every service a process.

What the order service saw (``/admin/arrivals``: when each call for a key arrived; ``/admin/records``: what
it applied) is the ground truth for "no call before its time" and "never twice"; the event log shows the
timers (``StepRetryScheduled``) and the attempts they started.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from datetime import UTC, datetime, timedelta

import pytest

from schemas.messages import (
    Event,
    OperatorCommandRefused,
    RetryBroughtForward,
    RetryDue,
    StepFailed,
    StepRetryScheduled,
    StepStarted,
)
from tests.agreement import inconsistency, records_per_order
from tests.kafka_helpers import wait_for
from tests.system import System
from tests.test_compensation_end_to_end import operator, saga, start

__all__ = ["saga"]

pytestmark = pytest.mark.kafka

WORKFLOW = "orders-waiting"  # tests/workflows.py: a 6 s back-off between attempts, one call an attempt
OUTAGE_S = 20.0


def timers_and_starts(events: list[Event]) -> list[tuple[StepRetryScheduled, list[StepStarted]]]:
    """Each timer of a history with the forward attempts started for it (its step, its attempt number)."""
    return [(timer, [e for e in events if isinstance(e, StepStarted) and (e.step, e.attempt) == (timer.step,
                                                                                                 timer.attempt)])
            for timer in events if isinstance(timer, StepRetryScheduled) and not timer.compensation]


def test_a_retry_after_of_10_s_holds_back_every_call_for_that_key_for_10_s_across_attempts(saga: System) -> None:
    saga.admin.set_faults("payments/charge", throttle_rate=1.0, retry_after_s=10)
    start(saga)
    saga.submit("throttled-1", workflow=WORKFLOW)
    key = "throttled-1:charge"

    def charge_calls() -> list[float]:
        return [a["at"] for a in saga.admin.arrivals().get("payments/charge", {}).get(key, [])]

    assert wait_for(lambda: len(charge_calls()) >= 1, timeout_s=60), saga.logs_tail()
    saga.admin.clear_faults("payments/charge")  # the next call succeeds, whenever it comes
    assert saga.wait_terminal(["throttled-1"], timeout_s=90) == {"throttled-1": "completed"}

    first, second = charge_calls()
    assert second - first >= 10.0, f"the second call came {second - first:.2f}s after a Retry-After of 10 s"
    events = saga.events("throttled-1")
    ((timer, starts),) = timers_and_starts(events)
    assert (timer.step, timer.attempt, timer.error_kind) == ("charge", 2, "throttled")
    assert timer.not_before >= datetime.fromtimestamp(first, UTC) + timedelta(seconds=9.9), \
        "the timer is set from what the agent learned, not the 6 s back-off"
    assert len(starts) == 1 and starts[0].occurred_at >= timer.not_before
    assert inconsistency("completed", records_per_order(saga.admin.records())["throttled-1"], events,
                         saga.admin.records()["tombstones"]) is None


def restored_at(scheduler_log: str) -> datetime:
    """When a scheduler, by its own log, had restored the last of its partitions: from then on it fires timers."""
    entries = [json.loads(line) for line in scheduler_log.splitlines() if line.startswith("{")]  # not librdkafka's
    stamps = [datetime.fromisoformat(entry["timestamp"]) for entry in entries
              if entry.get("event") == "partition restored"]
    assert stamps, "the restarted scheduler restored no partition"
    return max(stamps)


@pytest.mark.timeout(600)
def test_timers_pending_when_the_scheduler_is_sigkilled_fire_after_its_restart_and_none_twice(saga: System) -> None:
    ids = [f"wait-{i:02d}" for i in range(10)]
    saga.admin.set_faults("payments/charge", fail_next=len(ids))  # each order's first charge call fails: 503
    start(saga)
    for task_id in ids:
        saga.submit(task_id, workflow=WORKFLOW)

    def waiting() -> set[str]:
        return {e.task_id for e in saga.events() if isinstance(e, StepRetryScheduled)}

    assert wait_for(lambda: waiting() == set(ids), timeout_s=90, interval_s=0.5), saga.logs_tail()
    killed_at = datetime.now(UTC)
    saga.procs.kill("scheduler")
    saga.restart("scheduler")
    statuses = saga.wait_terminal(ids, timeout_s=120)
    restarted_at = restored_at(saga.procs.log("scheduler"))

    records, history = saga.admin.records(), saga.events()
    per_order = records_per_order(records)
    for task_id in ids:
        events = [e for e in history if e.task_id == task_id]
        assert inconsistency(statuses[task_id], per_order[task_id], events, records["tombstones"]) is None
        pairs = timers_and_starts(events)
        assert pairs, f"{task_id} never waited"
        for timer, starts in pairs:
            assert len(starts) == 1, f"{task_id}: the timer for attempt {timer.attempt} started {len(starts)}"
            started = starts[0].occurred_at
            assert started >= timer.not_before, f"{task_id}: attempt {timer.attempt} started early"
            # Late by at most the restart: a timer due before the successor had restored its partitions fires
            # once it has (a start of several seconds on a busy machine is the restart, not the timer).
            assert started <= max(timer.not_before, restarted_at) + timedelta(seconds=5), \
                f"{task_id}: attempt {timer.attempt} started {(started - timer.not_before).total_seconds():.1f}s late"
        attempts = Counter((e.step, e.attempt) for e in events if isinstance(e, StepStarted))
        assert all(n == 1 for n in attempts.values()), f"{task_id}: an attempt started twice: {attempts}"
    assert Counter(statuses.values()) == {"completed": len(ids)}
    pending_at_kill = [t for t in history if isinstance(t, StepRetryScheduled) and t.not_before > killed_at]
    assert pending_at_kill, "the scheduler was killed while timers were pending"


@pytest.mark.timeout(600)
def test_every_task_waits_out_a_20_s_outage_and_completes_with_calls_held_to_the_breakers_probes(
        saga: System) -> None:
    ids = [f"outage-{i:02d}" for i in range(20)]
    start(saga)
    saga.admin.set_faults(error_rate=1.0)  # every call of every operation: 503
    outage_began = time.time()
    for task_id in ids:
        saga.submit(task_id, workflow="orders-outage")
    time.sleep(OUTAGE_S)  # the outage itself: what the test is about, not a wait for something to happen
    saga.admin.clear_faults()
    outage_ended = time.time()
    statuses = saga.wait_terminal(ids, timeout_s=120)

    records, history = saga.admin.records(), saga.events()
    per_order = records_per_order(records)
    for task_id in ids:
        events = [e for e in history if e.task_id == task_id]
        assert inconsistency(statuses[task_id], per_order[task_id], events, records["tombstones"]) is None
    assert Counter(statuses.values()) == {"completed": len(ids)}, "every task waited the outage out"

    reserve = saga.admin.arrivals().get("inventory/reserve", {})
    during = sorted(a["at"] for calls in reserve.values() for a in calls if outage_began <= a["at"] < outage_ended)
    # Before the inventory agent's breaker opens (20 failures, its default) each first attempt may make both
    # its calls; once open only a probe now and then reaches the service (one per open period of 5 s).
    bound = 2 * len(ids) + math.ceil(OUTAGE_S / 5.0) + 1
    assert len(during) <= bound, f"{len(during)} calls during the outage, more than the breaker lets through"
    assert all(len(calls) <= 8 for calls in reserve.values()), "each step's budget of 8 calls held"
    deferrals = [e for e in history if isinstance(e, StepRetryScheduled) and e.deferred_attempt_id]
    assert deferrals, "attempts the open breaker refused were deferred"
    failures = Counter(e.task_id for e in history if isinstance(e, StepFailed))
    assert max(failures.values(), default=0) < 5, f"deferrals spent no failed attempts: {failures}"


def test_an_operators_try_now_starts_the_waiting_attempt_at_once_and_the_old_timer_then_changes_nothing(
        saga: System) -> None:
    saga.admin.set_faults("payments/charge", throttle_rate=1.0, retry_after_s=600)
    start(saga)
    saga.submit("impatient", workflow=WORKFLOW)
    assert wait_for(lambda: saga.statuses().get("impatient") == "waiting", timeout_s=60), saga.logs_tail()
    listed = saga.cli("tasks", "--state", "waiting", "--json")
    assert listed.returncode == 0 and '"impatient"' in listed.stdout, listed.stderr
    (step,) = [s for s in saga.steps("impatient") if s["status"] == "waiting"]
    assert step["step"] == "charge" and step["retry_at"] / 1000 - time.time() > 500, "ten minutes away"

    saga.admin.clear_faults("payments/charge")
    asked = time.time()
    answer = operator(saga, "try-now", "impatient", "--wait")
    assert answer.returncode == 0 and "tries now" in answer.stdout, answer.stdout + answer.stderr
    assert saga.wait_terminal(["impatient"], timeout_s=60) == {"impatient": "completed"}
    calls = [a["at"] for a in saga.admin.arrivals()["payments/charge"]["impatient:charge"]]
    assert len(calls) == 2 and calls[1] - asked < 30, "the attempt started at once, not in ten minutes"

    events = saga.events("impatient")
    (timer,) = [e for e in events if isinstance(e, StepRetryScheduled)]
    # The old timer's firing, sent again by hand: it names a timer the task has moved past (its time has not
    # come either; tests/test_decider_timers.py fires a stale one after its time). An operator command sent
    # after it on the same partition shows when it has been handled.
    saga.producer.send(saga.layout.inbox, RetryDue(task_id="impatient", step=timer.step, attempt=timer.attempt,
                                                   not_before=timer.not_before))
    saga.producer.flush()
    assert operator(saga, "try-now", "impatient", "--wait").returncode != 0, "nothing waits any more: refused"
    after = saga.events("impatient")
    assert [type(e) for e in after[len(events):]] == [OperatorCommandRefused], "the old timer changed nothing"
    assert [type(e) for e in events].count(RetryBroughtForward) == 1
    assert inconsistency("completed", records_per_order(saga.admin.records())["impatient"], after,
                         saga.admin.records()["tombstones"]) is None


def test_past_the_threshold_a_backoff_escalation_waits_the_long_period_then_the_step_succeeds(saga: System) -> None:
    saga.admin.set_faults("payments/charge", fail_next=3)  # two attempts fail (the threshold), then one more
    start(saga)
    saga.submit("patient", workflow="orders-backoff")
    assert saga.wait_terminal(["patient"], timeout_s=90) == {"patient": "completed"}

    events = saga.events("patient")
    timers = [e for e in events if isinstance(e, StepRetryScheduled)]
    assert [t.new_round for t in timers] == [False, True, False], "back-off, the long one, back-off again"
    long = timers[1]
    assert long.not_before - long.occurred_at == timedelta(seconds=8)
    ((_, starts),) = [(t, s) for t, s in timers_and_starts(events) if t.new_round]
    assert len(starts) == 1 and starts[0].occurred_at >= long.not_before
    calls = [a["at"] for a in saga.admin.arrivals()["payments/charge"]["patient:charge"]]
    assert len(calls) == 4 and calls[2] - calls[1] >= 8.0, "no call while the long back-off ran"
    assert inconsistency("completed", records_per_order(saga.admin.records())["patient"], events,
                         saga.admin.records()["tombstones"]) is None


def test_an_undo_that_keeps_failing_waits_the_long_period_for_a_fresh_round_and_then_undoes(saga: System) -> None:
    saga.admin.set_faults("shipping/create", permanent_error_rate=1.0)  # the shipment refused: undo the rest
    saga.admin.set_faults("payments/refund", fail_next=2)  # the refund's first round fails (the threshold)
    start(saga)
    saga.submit("undo-waits", workflow="orders-undo-waits")
    assert saga.wait_terminal(["undo-waits"], timeout_s=90) == {"undo-waits": "compensated"}, \
        "the undo waited instead of leaving the task compensation_failed"

    events = saga.events("undo-waits")
    undo_timers = [e for e in events if isinstance(e, StepRetryScheduled) and e.compensation]
    assert [(t.step, t.new_round) for t in undo_timers] == [("charge", False), ("charge", True)]
    long = undo_timers[1]
    assert long.not_before - long.occurred_at == timedelta(seconds=5)
    (calls,) = saga.admin.arrivals()["payments/refund"].values()  # the one refund's key
    refunds = [a["at"] for a in calls]
    assert len(refunds) == 3 and refunds[2] - refunds[1] >= 5.0, "no refund call while the long back-off ran"
    assert inconsistency("compensated", records_per_order(saga.admin.records())["undo-waits"], events,
                         saga.admin.records()["tombstones"]) is None
