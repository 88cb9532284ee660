"""Scaling while tasks run: schedulers 1 -> 2 -> 1 and the payments agents 1 -> 3 -> 1, partitions moving
each time, on the session's broker. The order service errs now and then, answers charges slowly and refuses
some shipments for good (those tasks compensate); a first wave of tasks runs while instances are added, a
second while they are removed. Scaling down is a SIGTERM, as an orchestrator does it: the instance drains and
its partitions move back. Then every task is terminal, its end agrees with the service's records (nothing
applied twice: tests/agreement.py), and ``stepstream projections verify`` finds the store equal to the log.
"""

from __future__ import annotations

from collections import Counter

import pytest

from scheduler.decider import TERMINAL
from tests.agreement import disagreements
from tests.kafka_helpers import wait_for
from tests.system import System
from tests.test_compensation_end_to_end import saga, start
from tests.test_undo_chaos import inject_faults

__all__ = ["saga"]

pytestmark = pytest.mark.kafka

WAVE = 100
"""Tasks submitted before scaling up, and again before scaling down."""
ADDED = ("scheduler#2", "payments#2", "payments#3")


@pytest.mark.timeout(600)
def test_schedulers_one_two_one_and_agents_one_three_one_during_a_run_lose_nothing_and_apply_nothing_twice(
    saga: System,
) -> None:
    inject_faults(saga)  # charges answer slowly (0.6-1.8 s): tasks are still running while instances come and go
    start(saga)
    first, second = [f"scale-{i:03d}" for i in range(WAVE)], [f"scale-{i:03d}" for i in range(WAVE, 2 * WAVE)]
    for task_id in first:
        saga.submit(task_id, workflow="orders-chaos")

    def ended(ids: list[str]) -> int:
        statuses = saga.statuses()
        return sum(1 for t in ids if statuses.get(t) in TERMINAL)

    assert wait_for(lambda: ended(first) >= 10, timeout_s=120, interval_s=0.2), saga.logs_tail()
    saga.start(*ADDED)
    saga.procs.wait_started("scheduler#2", "partition restored")  # a partition moved to the new scheduler
    for name in ("payments#2", "payments#3"):
        saga.procs.wait_started(name, "partitions assigned")
    assert ended(first) < WAVE, "scaled up while the first tasks still ran"
    for task_id in second:
        saga.submit(task_id, workflow="orders-chaos")
    for name in ADDED:
        assert saga.procs.terminate(name) == 0, saga.procs.log(name)[-3000:]
    assert ended(second) < WAVE, "scaled down while the later tasks still ran"

    ids = first + second
    statuses = saga.wait_terminal(ids, timeout_s=300)  # fails naming every task not ended
    wrong = disagreements(saga, statuses, ids)
    outcomes = Counter(statuses.values())
    assert not wrong, f"{len(wrong)} of {len(ids)} tasks disagree with the service ({dict(outcomes)}): {wrong}"
    assert outcomes["completed"] and outcomes["compensated"], f"the faults exercised both ends: {dict(outcomes)}"
    verified = saga.cli("projections", "verify", "--no-progress")
    assert verified.returncode == 0, verified.stdout + verified.stderr
