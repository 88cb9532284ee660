"""Scaling while tasks run: schedulers 1 -> 2 -> 1 and the payments agents 1 -> 3 -> 1, partitions moving
each time, on the session's broker. The order service errs now and then, answers charges slowly and refuses
some shipments for good (those tasks compensate); tasks are submitted at a steady pace the whole time
instances are added and removed. Scaling down is a SIGTERM, as an orchestrator does it: the instance drains and
its partitions move back. Then every task is terminal, its end agrees with the service's records (nothing
applied twice: tests/agreement.py), and ``stepstream projections verify`` finds the store equal to the log.
"""

from __future__ import annotations

import threading
from collections import Counter

import pytest

from schemas.states import TERMINAL
from tests.agreement import disagreements
from tests.kafka_helpers import wait_for
from tests.system import System
from tests.test_compensation_end_to_end import saga, start
from tests.test_undo_chaos import inject_faults

__all__ = ["saga"]

pytestmark = pytest.mark.kafka

ADDED = ("scheduler#2", "payments#2", "payments#3")
PACE_S = 0.2
"""One task submitted every PACE_S for as long as instances come and go: a charge takes 0.6 s at least, so
the latest tasks are always still running when an instance joins or leaves, however fast the machine."""


class Submitter(threading.Thread):
    """Submits a task every PACE_S until stopped; ``ids`` holds every task it submitted."""

    def __init__(self, system: System) -> None:
        super().__init__(daemon=True)
        self.system = system
        self.ids: list[str] = []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            task_id = f"scale-{len(self.ids):04d}"
            self.system.submit(task_id, workflow="orders-chaos")
            self.ids.append(task_id)
            self.halt.wait(PACE_S)

    def stop(self) -> list[str]:
        self.halt.set()
        self.join(30)
        return list(self.ids)


@pytest.mark.timeout(600)
def test_schedulers_one_two_one_and_agents_one_three_one_during_a_run_lose_nothing_and_apply_nothing_twice(
    saga: System,
) -> None:
    inject_faults(saga)
    start(saga)
    submitter = Submitter(saga)
    submitter.start()

    def ended() -> int:
        statuses = saga.statuses()
        return sum(1 for t in list(submitter.ids) if statuses.get(t) in TERMINAL)

    def running() -> bool:
        return ended() < len(submitter.ids)

    try:
        assert wait_for(lambda: ended() >= 10, timeout_s=120, interval_s=0.2), saga.logs_tail()
        saga.start(*ADDED)
        saga.procs.wait_started("scheduler#2", "partition restored")  # a partition moved to the new scheduler
        for name in ("payments#2", "payments#3"):
            saga.procs.wait_started(name, "partitions assigned")
        assert running(), "scaled up while tasks ran"
        for name in ADDED:
            assert saga.procs.terminate(name) == 0, saga.procs.log(name)[-3000:]
        assert running(), "scaled down while tasks ran"
    finally:
        ids = submitter.stop()

    statuses = saga.wait_terminal(ids, timeout_s=300)  # fails naming every task not ended
    wrong = disagreements(saga, statuses, ids)
    outcomes = Counter(statuses.values())
    assert not wrong, f"{len(wrong)} of {len(ids)} tasks disagree with the service ({dict(outcomes)}): {wrong}"
    assert outcomes["completed"] and outcomes["compensated"], f"the faults exercised both ends: {dict(outcomes)}"
    verified = saga.cli("projections", "verify", "--no-progress")
    assert verified.returncode == 0, verified.stdout + verified.stderr
