"""Compensation end to end: every service a real process, the order service over HTTP, a real broker.

The scheduler runs ``tests.workflows:COMPENSATION_REGISTRY`` with an encryption key; the compensation
agents (inventory-release, payments-refund, shipping-cancel) run beside the forward ones. What the order
service applied (``OrdersAdmin``) is the ground truth for "undone" and "never twice".
"""

from __future__ import annotations

import base64
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from projections.store import SqliteStore
from scheduler.decider import fold
from schemas.messages import (
    CompensationStarted,
    Event,
    LateResultRecorded,
    MessageIgnored,
    OperatorAlert,
    OperatorCommandRefused,
    StepCompensated,
    StepCompensationFailed,
    StepCompensationStarted,
    StepFailed,
    StepResubmitted,
    StepStarted,
    StepSucceeded,
    TaskCompensationFailed,
)
from schemas.sealed import is_sealed
from tests.kafka_helpers import wait_for
from tests.system import System

pytestmark = pytest.mark.kafka

COMPENSATION_AGENTS = ("inventory-release", "payments-refund", "shipping-cancel")
KEY = base64.b64encode(bytes(range(7, 39))).decode()


@pytest.fixture
def saga(system: System) -> System:
    """The system on the compensation workflows, with a key to seal sensitive fields, nothing started.

    A stable scheduler instance name lets a restarted scheduler fence its killed predecessor at once,
    instead of every reader waiting out the predecessor's open transaction.
    """
    system.env.update({
        "STEPSTREAM_SCHEDULER_WORKFLOWS": "tests.workflows:COMPENSATION_REGISTRY",
        "STEPSTREAM_SCHEDULER_INSTANCE": "compensation-test",
        "STEPSTREAM_ENCRYPTION_KEYS": f"k1:{KEY}",
    })
    return system


def start(system: System) -> None:
    """Every service, the compensation agents included, started side by side."""
    for name in COMPENSATION_AGENTS:
        system.procs.service(name, "agent", name)
    system.start()
    for name in COMPENSATION_AGENTS:
        system.procs.wait_started(name)


@contextmanager
def dashboard(system: System) -> Iterator[SqliteStore]:
    """The state store the dashboards query."""
    store = SqliteStore(system.store_path)
    try:
        yield store
    finally:
        store.close()


def operator(system: System, *args: str) -> subprocess.CompletedProcess[str]:
    """``stepstream task ...`` as an operator runs it."""
    return subprocess.run([sys.executable, "-m", "stepstream", "task", *args], env=system.env, text=True,
                          capture_output=True, timeout=120, cwd=Path(__file__).parent.parent)


def of(events: list[Event], kind: type[Any]) -> list[Any]:
    return [e for e in events if isinstance(e, kind)]


def kinds_from(events: list[Event], first: type[Event]) -> list[str]:
    names = [type(e).__name__ for e in events]
    return names[names.index(first.__name__):]


def applied(system: System, operation: str, key: str) -> int:
    return system.admin.calls()["applied"].get(operation, {}).get(key, 0)


def test_a_permanent_failure_of_the_third_step_undoes_it_then_the_second_then_the_first(saga: System) -> None:
    saga.admin.set_faults("shipping/create", permanent_error_rate=1.0)
    start(saga)
    saga.submit("saga-1", workflow="orders-comp")
    assert saga.wait_terminal(["saga-1"]) == {"saga-1": "compensated"}

    events = saga.events("saga-1")
    assert kinds_from(events, CompensationStarted) == [
        "CompensationStarted",
        "StepCompensationStarted", "StepAccepted", "StepCompensated",
        "StepCompensationStarted", "StepAccepted", "StepCompensated",
        "StepCompensationStarted", "StepAccepted", "StepCompensated",
        "TaskCompensated",
    ]
    (started,) = of(events, CompensationStarted)
    assert (started.trigger, started.step, started.steps) == ("escalation", "ship", ["ship", "charge", "reserve"]), \
        "the refused step made a call: it may have been applied, so it is undone too (first)"
    assert [e.attempt_id for e in of(events, StepCompensationStarted)] == [
        "saga-1:ship:undo:1", "saga-1:charge:undo:1", "saga-1:reserve:undo:1"]
    assert [e.sequence for e in events] == list(range(1, len(events) + 1))

    records = saga.admin.records("saga-1")
    assert [e["operation"] for e in records["effects"]] == [
        "inventory/reserve", "payments/charge", "shipping/cancel", "payments/refund", "inventory/release"], \
        "undone in reverse order"
    assert [c["status"] for c in records["charges"].values()] == ["refunded"]
    assert [r["status"] for r in records["reservations"].values()] == ["released"]
    assert records["shipments"] == {}
    assert applied(saga, "payments/refund", "saga-1:charge:undo") == 1
    assert applied(saga, "inventory/release", "saga-1:reserve:undo") == 1


def test_a_compensation_refused_for_good_ends_compensation_failed_and_an_operator_retry_finishes_it(
    saga: System,
) -> None:
    saga.admin.set_faults("shipping/create", permanent_error_rate=1.0)
    saga.admin.set_faults("payments/refund", permanent_error_rate=1.0)
    start(saga)
    saga.submit("refund-refused", workflow="orders-comp")
    saga.submit("held", workflow="orders-hold")
    assert saga.wait_terminal(["refund-refused", "held"]) == {
        "refund-refused": "compensation_failed", "held": "error"}

    events = saga.events("refund-refused")
    (failed,) = of(events, StepCompensationFailed)
    assert failed.permanent and failed.step == "charge"
    (gave_up,) = of(events, TaskCompensationFailed)
    assert gave_up.step == "charge"
    assert [a.step for a in of(events, OperatorAlert)] == ["charge"]
    records = saga.admin.records("refund-refused")
    assert [r["status"] for r in records["reservations"].values()] == ["reserved"], \
        "nothing is undone out of order: the reservation waits for the refund"
    with dashboard(saga) as store:
        task = store.task("refund-refused")
        assert task is not None and task["error"].startswith("charge: permanent failure of the compensation")

    saga.admin.clear_faults("payments/refund")
    retried = operator(saga, "retry-compensation", "refund-refused", "--wait")
    assert retried.returncode == 0, retried.stdout + retried.stderr
    assert retried.stdout.strip() == "accepted: compensation of step 'charge' retried"
    assert saga.wait_terminal(["refund-refused"]) == {"refund-refused": "compensated"}
    records = saga.admin.records("refund-refused")
    assert [c["status"] for c in records["charges"].values()] == ["refunded"]
    assert [r["status"] for r in records["reservations"].values()] == ["released"]

    saga.admin.clear_faults("shipping/create")
    saga.submit("completed", workflow="orders-comp")
    assert saga.wait_terminal(["completed"]) == {"completed": "completed"}
    with dashboard(saga) as store:
        assert store.counts_by_status() == {"error": 1, "compensated": 1, "completed": 1}


def test_a_compensation_that_hangs_is_recovered_by_the_supervisor_and_past_its_threshold_fails_with_an_alert(
    saga: System,
) -> None:
    saga.admin.set_faults("shipping/create", permanent_error_rate=1.0)
    start(saga)
    # The refund agent hangs: it takes nothing (not even to acknowledge it), so each undo attempt stays queued
    # and is recovered by the supervisor at its start-by (2 s in this workflow).
    saga.procs.signal("payments-refund", signal.SIGSTOP)
    try:
        saga.submit("refund-hangs", workflow="orders-comp-quick-start")
        saga.submit("in-error", workflow="orders-hold")
        with dashboard(saga) as store:

            def compensating() -> bool:
                task = store.task("refund-hangs") or {"steps": []}
                charge: dict[str, Any] = next((s for s in task["steps"] if s["step"] == "charge"), {})
                return task.get("status") == "compensating" and charge.get("status") == "compensation_queued"

            assert wait_for(compensating, timeout_s=60), saga.logs_tail()
            charge = next(s for s in (store.task("refund-hangs") or {})["steps"] if s["step"] == "charge")
            assert charge["attempt_id"].startswith("refund-hangs:charge:undo:") and charge["complete_by"]
            assert store.counts_by_status().get("compensating") == 1
            assert saga.wait_terminal(["refund-hangs", "in-error"], timeout_s=60) == {
                "refund-hangs": "compensation_failed", "in-error": "error"}
            assert wait_for(lambda: any(a["task_id"] == "refund-hangs" for a in store.alerts()))
            assert store.counts_by_status() == {"compensation_failed": 1, "error": 1}
            alert = next(a for a in store.alerts() if a["task_id"] == "refund-hangs")
            assert alert["step"] == "charge" and "failure threshold reached" in alert["reason"]
    finally:
        saga.procs.signal("payments-refund", signal.SIGCONT)
    events = saga.events("refund-hangs")
    timeouts = of(events, StepCompensationFailed)
    assert [(e.attempt_id, e.timed_out, e.failure_count) for e in timeouts] == [
        ("refund-hangs:charge:undo:1", True, 1), ("refund-hangs:charge:undo:2", True, 2)], \
        "each attempt was timed out by the supervisor, up to the threshold of 2"
    assert all("not taken by an agent before its start-by" in e.error for e in timeouts)
    assert of(events, TaskCompensationFailed)[0].step == "charge"
    assert applied(saga, "payments/refund", "refund-hangs:charge:undo") == 0


def test_a_scheduler_killed_mid_compensation_is_replaced_and_no_compensating_action_is_applied_twice(
    saga: System,
) -> None:
    saga.admin.set_faults("shipping/create", permanent_error_rate=1.0)
    saga.admin.set_faults("payments/refund", latency_ms=400)
    saga.admin.set_faults("inventory/release", latency_ms=400)
    start(saga)
    ids = [f"kill-{i}" for i in range(6)]
    for task_id in ids:
        saga.submit(task_id, workflow="orders-comp")

    def mid_compensation() -> bool:
        refunds = saga.admin.calls()["applied"].get("payments/refund", {})
        return bool(refunds) and any((saga.task(t) or {}).get("status") == "compensating" for t in ids)

    assert wait_for(mid_compensation, timeout_s=60), saga.logs_tail()
    saga.procs.kill("scheduler")
    saga.restart("scheduler")
    assert set(saga.wait_terminal(ids, timeout_s=120).values()) == {"compensated"}

    for task_id in ids:
        assert applied(saga, "payments/refund", f"{task_id}:charge:undo") == 1, task_id
        assert applied(saga, "inventory/release", f"{task_id}:reserve:undo") == 1, task_id
        records = saga.admin.records(task_id)
        assert [c["status"] for c in records["charges"].values()] == ["refunded"]
        assert [r["status"] for r in records["reservations"].values()] == ["released"]
        events = saga.events(task_id)
        assert [e.sequence for e in events] == list(range(1, len(events) + 1)), "one history, no gaps or repeats"
        assert [e.step for e in of(events, StepCompensated)] == ["ship", "charge", "reserve"]


def test_an_operator_resubmits_a_failed_step_after_the_service_is_fixed_and_the_task_completes(saga: System) -> None:
    saga.admin.set_faults("shipping/create", permanent_error_rate=1.0)
    start(saga)
    saga.submit("fix-me", workflow="orders-hold")
    assert saga.wait_terminal(["fix-me"]) == {"fix-me": "error"}

    saga.admin.clear_faults()
    resubmitted = operator(saga, "resubmit", "fix-me", "--wait")
    assert resubmitted.returncode == 0, resubmitted.stdout + resubmitted.stderr
    assert resubmitted.stdout.strip() == "accepted: step 'ship' resubmitted"
    assert saga.wait_terminal(["fix-me"]) == {"fix-me": "completed"}
    events = saga.events("fix-me")
    assert kinds_from(events, StepResubmitted) == ["StepResubmitted", "StepStarted", "StepAccepted", "StepSucceeded",
                                                   "TaskCompleted"]
    assert [e.attempt_id for e in of(events, StepStarted) if e.step == "ship"] == ["fix-me:ship:1", "fix-me:ship:2"]
    assert applied(saga, "shipping/create", "fix-me:ship") == 1


def test_an_operator_cancels_a_running_task_and_commands_its_state_forbids_are_refused_changing_nothing(
    saga: System,
) -> None:
    saga.admin.set_faults("payments/charge", hang=True, hang_max_s=60)
    start(saga)
    saga.submit("busy", workflow="orders-patient")
    with dashboard(saga) as store:
        assert wait_for(lambda: any(s["step"] == "charge" and s["status"] == "processing"
                                    for s in (store.task("busy") or {"steps": []})["steps"]), timeout_s=60)

    refused = operator(saga, "resubmit", "busy", "--step", "charge", "--wait")
    assert refused.returncode == 6, refused.stdout + refused.stderr
    assert refused.stdout.startswith("refused: task is running (step 'charge' is processing"), refused.stdout
    events = saga.events("busy")
    (refusal,) = of(events, OperatorCommandRefused)
    before, after = fold(events[: refusal.sequence - 1]), fold(events[: refusal.sequence])
    assert before is not None and after is not None
    assert (after.status, after.steps, after.current_step) == (before.status, before.steps, before.current_step)

    cancelled = operator(saga, "cancel", "busy", "--command-id", "cancel-busy", "--wait")
    assert cancelled.returncode == 0, cancelled.stdout + cancelled.stderr
    assert cancelled.stdout.strip() == "accepted: compensating (cancel): charge, reserve"
    assert saga.wait_terminal(["busy"]) == {"busy": "compensated"}
    records = saga.admin.records("busy")
    assert [r["status"] for r in records["reservations"].values()] == ["released"]
    assert records["charges"] == {}, "the hung charge applied nothing"
    assert "busy:charge" in records["tombstones"]["payments/charge"], "the abandoned charge was undone (fenced)"
    abandoned = next(e for e in saga.events("busy") if isinstance(e, StepFailed) and "abandoned" in e.error)
    # The abandoned attempt answers late: a timeout (ignored), or, when its retry met the tombstone its undo
    # left, a permanent "already undone" (recorded as a late result). Either way nothing changes.
    assert wait_for(lambda: any(isinstance(e, MessageIgnored | LateResultRecorded)
                                and e.attempt_id == abandoned.attempt_id for e in saga.events("busy")),
                    timeout_s=30), "the late answer is recorded and changes nothing"

    again = operator(saga, "cancel", "busy", "--command-id", "cancel-busy", "--wait")
    assert again.returncode == 0 and again.stdout.strip() == "accepted: compensating (cancel): charge, reserve", \
        "the same command id reports its one outcome"
    compensate = operator(saga, "compensate", "busy", "--wait")  # answered after the repeat: same partition
    assert compensate.returncode == 6
    assert compensate.stdout.strip().startswith("refused: task is compensated: only a task in error can be compensated")
    events = saga.events("busy")
    assert len([e for e in events if getattr(e, "command_id", None) == "cancel-busy"]) == 1
    assert of(events, OperatorCommandRefused)[-1].action == "compensate"
    assert saga.task("busy") is not None and (saga.task("busy") or {})["status"] == "compensated"


def one_done_one_undone(system: System, done: str, undone: str) -> None:
    """Start everything; ``done`` completes, then shipping refuses for good and ``undone`` is undone."""
    start(system)
    system.submit(done, workflow="orders-comp")
    assert system.wait_terminal([done]) == {done: "completed"}
    system.admin.set_faults("shipping/create", permanent_error_rate=1.0)
    system.submit(undone, workflow="orders-comp")
    assert system.wait_terminal([undone]) == {undone: "compensated"}


def test_a_sensitive_field_never_appears_in_clear_on_the_events_topic(saga: System) -> None:
    one_done_one_undone(saga, "secret-done", "secret-undone")

    charges = {task: next(iter(saga.admin.records(task)["charges"])) for task in ("secret-done", "secret-undone")}
    assert all(charge_id.startswith("ch-") for charge_id in charges.values())
    assert saga.admin.records("secret-undone")["charges"][charges["secret-undone"]]["status"] == "refunded", \
        "the refund was given the charge id in clear: the scheduler opened the sealed output"

    from eventstore.replay import ReplayReader

    raw = [value or b"" for _p, _o, _k, value in ReplayReader(saga.bootstrap, saga.layout.events).raw()]
    assert raw and not [v for v in raw if any(c.encode() in v for c in charges.values())], \
        "no event on the topic holds a charge id in clear"
    succeeded = next(e for e in saga.events("secret-done") if isinstance(e, StepSucceeded) and e.step == "charge")
    assert is_sealed(succeeded.output["charge_id"]) and succeeded.output["order_id"] == "secret-done"
    refund = next(e for e in saga.events("secret-undone") if isinstance(e, StepCompensated) and e.step == "charge")
    assert all(is_sealed(v) for v in refund.output.values()), "the compensation inherits the marking"

    with dashboard(saga) as store:
        bodies = [row["body"] for task in charges for row in store.history(task)]
    shown = subprocess.run([sys.executable, "-m", "stepstream", "status", "secret-undone", "--json"], env=saga.env,
                           text=True, capture_output=True, timeout=60, cwd=Path(__file__).parent.parent)
    assert shown.returncode == 0, shown.stderr
    logs = "".join(saga.procs.log(name) for name in ("scheduler", "projector", "supervisor"))
    for charge_id in charges.values():
        assert not any(charge_id in body for body in bodies), "the projection holds it sealed"
        assert charge_id not in shown.stdout + shown.stderr, "the CLI never prints it"
        assert charge_id not in logs, "nor do the services' logs"
