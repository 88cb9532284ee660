"""Orders run through the order service's faults, optionally while services are SIGKILLed and restarted every
few seconds and the broker is SIGKILLed and restarted once: the load of tests/test_waiting_out_kills.py and
benchmarks/waiting_out_kills.py, so that the test's verdict and the benchmark's shares come from one run.

A run's result says how each task ended, whether each end agrees with the order service's records
(tests/agreement.py), and which tasks *gave up*: undone (or left for an operator) although no step was
refused for good, i.e. because a step ran out of attempts or patience. Waiting out faults means those are
the ones that should disappear; a shipment refused for good must still be undone.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from eventstore.broker import LocalBroker
from schemas.messages import CompensationStarted, Event, StepFailed
from tests.agreement import disagreements
from tests.system import System
from tests.test_compensation_end_to_end import start

ROTATION = ("payments", "inventory-release", "scheduler", "shipping", "projector", "payments-refund", "inventory",
            "supervisor", "shipping-cancel")
"""The order services are killed in. The broker is restarted after the first two kills, so the scheduler
comes next: every service is killed at least once after the broker's restart, which cures a process left
stuck in a transaction commit by the broker's death (the open hang of issue 15) within the run."""
BROKER_AFTER = 2
"""Kills before the broker's restart."""


def inject_faults(system: System) -> None:
    """Every operation errs or throttles now and then; charges answer around the agents' 1.5 s call timeout
    (0.6-1.8 s, a quarter of them after the caller gave up); a shipment in seven is refused for good."""
    system.admin.set_faults(error_rate=0.05, throttle_rate=0.05, retry_after_s=1)
    system.admin.set_faults("payments/charge", latency_ms=600, latency_jitter_ms=1200, error_rate=0.05)
    system.admin.set_faults("shipping/create", error_rate=0.05, throttle_rate=0.05, permanent_error_rate=0.15)


class Kills(threading.Thread):
    """Every ``every_s`` SIGKILLs the next service of ``ROTATION`` and starts it again; after the first
    ``BROKER_AFTER`` kills, SIGKILLs the broker and starts it on the same address. Goes on for ``for_s``, and
    at least one whole rotation past the broker's restart; ends once every service restarted runs.
    ``error`` holds what stopped it early."""

    def __init__(self, system: System, broker: LocalBroker, every_s: float, for_s: float) -> None:
        super().__init__(name="kills", daemon=True)
        self.system, self.broker, self.every_s = system, broker, every_s
        self.planned = max(BROKER_AFTER + len(ROTATION), int(for_s / every_s))
        self.killed: list[str] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            began = time.monotonic()
            for turn in range(self.planned):
                time.sleep(max(0.0, began + (turn + 1) * self.every_s - time.monotonic()))
                name = ROTATION[turn % len(ROTATION)]
                self.system.procs.kill(name)
                self.system.restart(name, wait=False)  # a rotation later it is killed again: it had time to start
                self.killed.append(name)
                if len(self.killed) == BROKER_AFTER:
                    self.broker.kill()
                    self.broker.start()
                    self.killed.append("broker")
            for name in ROTATION:
                self.system.procs.wait_started(name)
        except BaseException as exc:  # reported by the caller, which owns the run
            self.error = exc


@dataclass
class Run:
    """How one run's tasks ended, and what that means against the service's records."""

    statuses: dict[str, str]
    wrong: dict[str, str]
    """Tasks whose end disagrees with the order service's records, and why."""
    gave_up: dict[str, str]
    """Tasks undone or left for an operator without a step refused for good, and what they gave up on."""
    killed: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def outcomes(self) -> Counter[str]:
        return Counter(self.statuses.values())

    def share(self, status: str) -> float:
        return self.outcomes[status] / len(self.statuses)


def gave_up(statuses: dict[str, str], history: list[Event]) -> dict[str, str]:
    """Each task that stopped trying while its faults were passing ones: why it stopped.

    A step refused for good (``StepFailed.permanent``) must be undone whatever the policy, so ``compensated``
    after one is no giving up; ``compensated`` without one, or ``compensation_failed`` (an undo that stopped
    trying), is.
    """
    per_task: dict[str, list[Event]] = defaultdict(list)
    for event in history:
        per_task[event.task_id].append(event)
    why: dict[str, str] = {}
    for task_id, status in statuses.items():
        events = per_task[task_id]
        refused = any(isinstance(e, StepFailed) and e.permanent for e in events)
        if status == "completed" or (status == "compensated" and refused):
            continue
        started = [e.reason for e in events if isinstance(e, CompensationStarted)]
        why[task_id] = f"{status}: {started[0] if started else 'no compensation started'}"
    return why


def run_orders(system: System, broker: LocalBroker, *, workflow: str, tasks: int, window_s: float,
               kills_every_s: float | None, patience_s: float) -> Run:
    """Start every service, submit ``tasks`` orders of ``workflow`` evenly over ``window_s`` under the faults
    of ``inject_faults`` (with kills every ``kills_every_s`` while they are submitted, or none), wait until every
    task ended, and judge.

    Without kills the submissions are paced the same, so the two runs carry the same load.
    """
    inject_faults(system)
    start(system)
    began = time.monotonic()
    kills = Kills(system, broker, kills_every_s, window_s) if kills_every_s is not None else None
    if kills is not None:
        kills.start()
    ids = [f"{workflow}-{i:04d}" for i in range(tasks)]
    for n, task_id in enumerate(ids):
        time.sleep(max(0.0, began + n * window_s / tasks - time.monotonic()))
        system.submit(task_id, workflow=workflow)
    if kills is not None:
        kills.join(timeout=patience_s)
        if kills.error is not None or kills.is_alive():
            raise AssertionError(f"the kills did not run their course ({kills.killed}): {kills.error!r}\n"
                                 f"{system.logs_tail()}")
    statuses = system.wait_terminal(ids, timeout_s=patience_s)  # fails naming every task not yet ended
    seconds = time.monotonic() - began
    time.sleep(2.0)  # longer than a call timeout: every call still on its way has landed or been refused
    return Run(statuses=statuses, wrong=disagreements(system, statuses, ids),
               gave_up=gave_up(statuses, system.events()), killed=kills.killed if kills else [], seconds=seconds)
