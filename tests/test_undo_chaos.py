"""A few hundred orders through faults and SIGKILLs, each task's end checked against the order service's records.

The faults are the ones that made "compensated" a lie before: charges answered around the agent's call
timeout (so some land after the caller gave up: an unknown outcome), server errors and throttling on every
operation (the undos included), shipments refused for good (so tasks compensate), and SIGKILLs of the
scheduler and of forward and compensation agents mid-run. Then each task's end must agree with the service's
records (tests/agreement.py says what each end means): not one task may disagree, and the test fails naming
each task that does.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable

import pytest

from schemas.states import TERMINAL
from tests.agreement import disagreements
from tests.kafka_helpers import wait_for
from tests.kills import inject_faults
from tests.system import System
from tests.test_compensation_end_to_end import saga, start

__all__ = ["saga"]

pytestmark = pytest.mark.kafka

TASKS = int(os.environ.get("STEPSTREAM_CHAOS_TASKS", "100"))  # 240 and more for a soak run


def kill_and_restart(system: System, *names: str) -> None:
    for name in names:
        system.procs.kill(name)
    for name in names:
        system.restart(name)


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
    wrong = disagreements(saga, statuses, ids)
    outcomes = Counter(statuses.values())
    assert not wrong, f"{len(wrong)} of {TASKS} tasks disagree with the service ({dict(outcomes)}): {wrong}"
    assert outcomes["completed"] and outcomes["compensated"], f"the faults exercised both ends: {dict(outcomes)}"
