""""Cleanly undone" checked against the order service's own records: every step that may have been applied
is undone, an undo fences its step's key, and a late answer is recorded as the fact it is.

Every service is a real process, the order service real HTTP, the broker real. A log that agrees with
itself proves nothing here: each test reads what the service holds for the task.
"""

from __future__ import annotations

from datetime import timedelta

import pytest

from schemas.messages import (
    CompensationStarted,
    LateResultRecorded,
    StepAccepted,
    StepCompensationStarted,
    StepFailed,
    StepResult,
)
from tests.kafka_helpers import wait_for
from tests.system import System
from tests.test_compensation_end_to_end import dashboard, of, saga, start

__all__ = ["saga"]  # the compensation tests' fixture: the system on their workflows, with a sealing key

pytestmark = pytest.mark.kafka


def held(system: System, task_id: str) -> dict[str, list[str]]:
    """What the service still holds for the task: live reservations, captured charges, created shipments."""
    records = system.admin.records(task_id)
    return {
        "reservations": [r for r, v in records["reservations"].items() if v["status"] == "reserved"],
        "charges": [c for c, v in records["charges"].items() if v["status"] == "captured"],
        "shipments": [s for s, v in records["shipments"].items() if v["status"] == "created"],
    }


NOTHING = {"reservations": [], "charges": [], "shipments": []}


def test_a_step_whose_attempt_timed_out_after_the_service_applied_it_is_undone(saga: System) -> None:
    """The charge lands at the service after the agent's calls timed out: the step failed with an unknown
    outcome, and the compensation must refund it (before, only succeeded steps were undone)."""
    # The agent's calls time out at 1.5 s; the first lands at 2 s, a second (retry, same key) is still on its
    # way when the attempt gives up at its 3 s deadline, so the refund arrives after the charge landed.
    saga.admin.set_faults("payments/charge", latency_ms=2000)
    start(saga)
    saga.submit("unknown-charge", workflow="orders-once")
    assert saga.wait_terminal(["unknown-charge"], timeout_s=90) == {"unknown-charge": "compensated"}

    events = saga.events("unknown-charge")
    (failed,) = of(events, StepFailed)
    assert failed.step == "charge" and not failed.permanent
    (plan,) = of(events, CompensationStarted)
    assert plan.steps == ["charge", "reserve"], "the failed step may have been applied: it is undone first"
    records = saga.admin.records("unknown-charge")
    assert [c["status"] for c in records["charges"].values()] == ["refunded"], "the charge landed, then was refunded"
    assert held(saga, "unknown-charge") == NOTHING
    assert "payments/charge" in records["tombstones"] and "unknown-charge:charge" in \
        records["tombstones"]["payments/charge"]


def test_an_undo_at_a_service_that_cannot_refuse_waits_until_the_forward_call_can_no_longer_land(
    saga: System,
) -> None:
    """The charge lands 4.5 s after it was sent, long after its attempt gave up at 3 s; the payment service
    here keeps no tombstone for the refund (the workflow says it cannot refuse a late charge). The refund
    waits until the last charge attempt's latest end plus the 2 s a call may take to land: it then finds
    the charge and refunds it. Called at once, it would have found nothing, and the charge would stay."""
    saga.admin.set_faults("payments/charge", latency_ms=4500)
    start(saga)
    saga.submit("unfenced", workflow="orders-unfenced")
    assert saga.wait_terminal(["unfenced"], timeout_s=90) == {"unfenced": "compensated"}

    records = saga.admin.records("unfenced")
    (charge,) = records["charges"].values()
    assert charge["status"] == "refunded", "the charge landed before the refund, which then released it"
    assert held(saga, "unfenced") == NOTHING
    assert "unfenced:charge" not in records["tombstones"].get("payments/charge", {}), "no fence was claimed"

    events = saga.events("unfenced")
    undo = next(e for e in of(events, StepCompensationStarted) if e.step == "charge")
    (taken,) = [e for e in of(events, StepAccepted) if e.step == "charge" and not e.compensation]
    assert undo.not_before == taken.complete_by + timedelta(seconds=2), "the attempt's end plus the landing time"
    refund = next(e for e in of(events, StepAccepted) if e.step == "charge" and e.compensation)
    assert refund.accepted_at >= undo.not_before, "the refund agent waited before taking it"


def test_a_late_success_after_the_task_is_compensated_is_recorded_and_nothing_stays_held(saga: System) -> None:
    """A success for an attempt that is long over arrives after ``TaskCompensated``: the timeline says
    what it means, and the service (whose key for that step is tombstoned) holds nothing."""
    saga.admin.set_faults("shipping/create", permanent_error_rate=1.0)
    start(saga)
    saga.submit("late", workflow="orders-comp")
    assert saga.wait_terminal(["late"]) == {"late": "compensated"}
    assert held(saga, "late") == NOTHING

    saga.admin.clear_faults("shipping/create")
    saga.producer.send(saga.layout.inbox, StepResult(task_id="late", step="ship", attempt_id="late:ship:1", ok=True,
                                                     output={"shipment_id": "shp-late"}, calls=1))
    saga.producer.flush()

    assert wait_for(lambda: bool(of(saga.events("late"), LateResultRecorded)), timeout_s=30), saga.logs_tail()
    (late,) = of(saga.events("late"), LateResultRecorded)
    assert (late.step, late.attempt_id, late.ok) == ("ship", "late:ship:1", True)
    assert "fenced the key" in late.consequence
    with dashboard(saga) as store:
        assert wait_for(lambda: any(h["event_type"] == "LateResultRecorded" for h in store.history("late")),
                        timeout_s=30), "the task's timeline shows why"
    assert (saga.task("late") or {})["status"] == "compensated"

    # The agent that answered late retries its forward call: the service refuses it, nothing is applied.
    retry = saga.admin.call("shipping/create", {"order_id": "late"}, idempotency_key="late:ship", attempt=1)
    assert retry.status_code == 410
    assert held(saga, "late") == NOTHING
