"""A few hundred orders through faults and SIGKILLs, each task's end checked against the order service's records.

The faults are the ones that made "compensated" a lie before: charges answered around the agent's call
timeout (so some land after the caller gave up: an unknown outcome), server errors and throttling on every
operation (the undos included), shipments refused for good (so tasks compensate), and SIGKILLs of the
scheduler and of forward and compensation agents mid-run. Then, for every task:

- ``completed``: each step applied exactly once, and all three still held (nothing undone by mistake);
- ``compensated``: nothing held (every reservation released, charge refunded, shipment cancelled), and
  every forward key the task ever started is tombstoned, so no call still on its way can apply anything;
- ``compensation_failed``: whatever the service still holds belongs to a step the alert names.

Not one task may be inconsistent: the test fails naming each task that is.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

import pytest

from demo.orders_client import Records
from schemas.messages import Event, OperatorAlert, StepStarted, TaskCompensationFailed
from schemas.states import TERMINAL
from tests.kafka_helpers import wait_for
from tests.system import System
from tests.test_compensation_end_to_end import saga, start

__all__ = ["saga"]

pytestmark = pytest.mark.kafka

TASKS = 240
FORWARD = {"reserve": "inventory/reserve", "charge": "payments/charge", "ship": "shipping/create"}
RECORDS = {"reserve": ("reservations", "reserved"), "charge": ("charges", "captured"),
           "ship": ("shipments", "created")}
"""Per step: where the service records its effect, and the status of an effect still held."""


def inject_faults(system: System) -> None:
    """Every operation errs or throttles now and then; charges answer around the agents' 1.5 s call timeout
    (0.6-1.8 s, a quarter of them after the caller gave up); a shipment in seven is refused for good."""
    system.admin.set_faults(error_rate=0.05, throttle_rate=0.05, retry_after_s=1)
    system.admin.set_faults("payments/charge", latency_ms=600, latency_jitter_ms=1200, error_rate=0.05)
    system.admin.set_faults("shipping/create", error_rate=0.05, throttle_rate=0.05, permanent_error_rate=0.15)


def kill_and_restart(system: System, *names: str) -> None:
    for name in names:
        system.procs.kill(name)
    for name in names:
        system.restart(name)


def held_by_step(records: dict[str, Any]) -> dict[str, list[str]]:
    """What the service still holds for one order, per step: the ids of its live effects."""
    return {step: [rid for rid, r in records[kind].items() if r["status"] == live]
            for step, (kind, live) in RECORDS.items()}


def records_per_order(all_records: Records) -> dict[str, dict[str, Any]]:
    per_order: dict[str, dict[str, Any]] = defaultdict(
        lambda: {"effects": [], "reservations": {}, "charges": {}, "shipments": {}})
    for effect in all_records["effects"]:
        per_order[effect["order_id"]]["effects"].append(effect)
    for kind in ("reservations", "charges", "shipments"):
        for rid, record in all_records[kind].items():
            per_order[record["order_id"]][kind][rid] = record
    return per_order


def inconsistency(status: str, records: dict[str, Any], events: list[Event],
                  tombstones: dict[str, dict[str, Any]]) -> str | None:
    """Why this task's final state and the service's records disagree, or None when they agree."""
    held = held_by_step(records)
    applied = Counter(e["operation"] for e in records["effects"])
    task_id = events[0].task_id
    if any(n > 1 for n in applied.values()):
        return f"an operation applied twice: {applied}"
    if status == "completed":
        if any(applied[op] != 1 for op in FORWARD.values()) or any(len(ids) != 1 for ids in held.values()):
            return f"completed, but applied {dict(applied)} and holds {held}"
        return None
    if status == "compensated":
        if any(held.values()):
            return f"compensated, but the service still holds {held}"
        started = {e.step for e in events if isinstance(e, StepStarted)}
        open_keys = [step for step in started if f"{task_id}:{step}" not in tombstones.get(FORWARD[step], {})]
        return f"compensated, but forward keys of {open_keys} are not fenced" if open_keys else None
    if status == "compensation_failed":
        failed = [e for e in events if isinstance(e, TaskCompensationFailed)][-1]
        alerts = [e for e in events if isinstance(e, OperatorAlert) and e.step == failed.step]
        unnamed = {step for step, ids in held.items() if ids} - set(failed.not_undone)
        if unnamed or not alerts or not all(step in alerts[-1].reason for step in failed.not_undone):
            return f"compensation_failed naming {failed.not_undone}, but the service holds {held}"
        return None
    return f"ended {status!r}: this workflow either completes or undoes"


@pytest.mark.timeout(600)  # 40 s alone on two idle cores; several times that beside the rest of the suite
def test_every_task_through_faults_and_sigkills_ends_as_the_service_records_say(saga: System) -> None:
    saga.env["STEPSTREAM_CONSUMER_SESSION_TIMEOUT_MS"] = "6000"  # a killed agent's partitions move on sooner
    inject_faults(saga)
    start(saga)
    ids = [f"chaos-{i:03d}" for i in range(TASKS)]
    for task_id in ids:
        saga.submit(task_id, workflow="orders-chaos")

    def ended() -> int:
        return sum(1 for s in saga.statuses().values() if s in TERMINAL)

    def undos_applied() -> int:
        applied = saga.admin.calls()["applied"]
        return len(applied.get("payments/refund", {})) + len(applied.get("inventory/release", {}))

    kills: list[tuple[Callable[[], bool], tuple[str, ...]]] = [
        (lambda: ended() >= 20, ("payments", "scheduler")),
        (lambda: undos_applied() >= 10, ("payments-refund", "inventory-release")),
        (lambda: ended() >= TASKS // 2, ("inventory", "shipping", "shipping-cancel", "scheduler")),
    ]
    for reached, names in kills:
        assert wait_for(reached, timeout_s=120, interval_s=0.5), saga.logs_tail()
        kill_and_restart(saga, *names)

    statuses = saga.wait_terminal(ids, timeout_s=200)  # fails naming every task not yet ended
    time.sleep(2.0)  # longer than a call timeout: every call still on its way has landed or been refused
    records = saga.admin.records()
    per_order, tombstones = records_per_order(records), records["tombstones"]
    history: dict[str, list[Event]] = defaultdict(list)
    for event in saga.events():
        history[event.task_id].append(event)

    wrong = {task_id: why for task_id in ids
             if (why := inconsistency(statuses[task_id], per_order[task_id], history[task_id], tombstones))}
    outcomes = Counter(statuses.values())
    assert not wrong, f"{len(wrong)} of {TASKS} tasks disagree with the service ({dict(outcomes)}): {wrong}"
    assert outcomes["completed"] and outcomes["compensated"], f"the faults exercised both ends: {dict(outcomes)}"
