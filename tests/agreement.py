"""Does each task's end agree with what the order service itself recorded? The ground truth of the
chaos, many-instances and scaling runs (tests/test_undo_chaos.py says what each end must mean):

- ``completed``: each step applied exactly once, and all three still held (nothing undone by mistake);
- ``compensated``: nothing held (every reservation released, charge refunded, shipment cancelled), and
  every forward key the task ever started is tombstoned, so no call still on its way can apply anything;
- ``compensation_failed``: whatever the service still holds belongs to a step the alert names.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from typing import Any

from demo.orders_client import Records
from schemas.messages import Event, OperatorAlert, StepStarted, TaskCompensationFailed
from tests.system import System

FORWARD = {"reserve": "inventory/reserve", "charge": "payments/charge", "ship": "shipping/create"}
RECORDS = {"reserve": ("reservations", "reserved"), "charge": ("charges", "captured"),
           "ship": ("shipments", "created")}
"""Per step: where the service records its effect, and the status of an effect still held."""


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


def disagreements(system: System, statuses: dict[str, str], task_ids: Iterable[str]) -> dict[str, str]:
    """Each of these ended tasks whose end disagrees with the service's records, and why."""
    records = system.admin.records()
    per_order, tombstones = records_per_order(records), records["tombstones"]
    history: dict[str, list[Event]] = defaultdict(list)
    for event in system.events():
        history[event.task_id].append(event)
    return {task_id: why for task_id in task_ids
            if (why := inconsistency(statuses[task_id], per_order[task_id], history[task_id], tombstones))}
