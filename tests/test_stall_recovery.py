"""Recovery by restart, end to end. A scheduler stuck for good in its transaction's commit (the librdkafka hang
after a broker SIGKILL, confluentinc/librdkafka#5456) ends itself with ``EXIT_STALLED``, and so does one whose
transactional producer was fenced; each is started again as ``stepstream up`` would, its successor fences the open
transaction and reads the batch again, and every task ends as the order service's own records say."""

from __future__ import annotations

from pathlib import Path

import pytest

from eventstore.producer import EventProducer
from eventstore.stall import EXIT_STALLED
from scheduler.service import scheduler_transactional_id
from tests.agreement import disagreements
from tests.system import AGENTS, System

pytestmark = pytest.mark.kafka


@pytest.mark.timeout(180)
def test_a_scheduler_hung_in_its_commit_exits_stalled_and_its_restart_ends_every_task_once(
    system: System, tmp_path: Path,
) -> None:
    marker = tmp_path / "hung-once"
    system.env.update({
        "STEPSTREAM_SCHEDULER_INSTANCE": "stall-test",  # the restart's transactional id fences the stuck one
        "STEPSTREAM_CONSUMER_COMMIT_STALL_S": "3",
    })
    system.start("projector", *AGENTS, "supervisor")
    system.procs.start("scheduler", "tests.workers.hanging_commit", "run", "scheduler",
                       env={"STEPSTREAM_TEST_HANG_MARKER": str(marker)})
    system.procs.wait_started("scheduler")
    ids = [f"stall-{i}" for i in range(6)]
    for task_id in ids:
        system.submit(task_id, version=1)  # reserve, charge and ship: what tests/agreement.py checks

    statuses = system.wait_terminal(ids, timeout_s=90)
    assert marker.exists(), "a commit hung"
    [(name, said)] = system.stall_restarts
    assert name == "scheduler", system.logs_tail()
    assert "stalled: ending the process for a restart" in said and '"what": "send_offsets_to_transaction"' in said
    assert f'"exit_code": {EXIT_STALLED}' in said
    assert set(statuses.values()) == {"completed"}, statuses
    assert not disagreements(system, statuses, ids)


@pytest.mark.timeout(180)
def test_a_fenced_scheduler_exits_for_a_restart_and_its_restart_ends_every_task_once(system: System) -> None:
    """A producer that takes the scheduler's transactional id fences it, as a zombie is fenced: the broker answers
    the scheduler's next transaction PRODUCER_FENCED, a fatal error. The scheduler exits 75 for a restart (it
    crashed with 69 before, and nothing started it again), the harness starts it again, its restart fences the
    intruder in turn, and every task ends once, as the order service's records say."""
    system.env["STEPSTREAM_SCHEDULER_INSTANCE"] = "fence-test"
    system.start("projector", "scheduler", *AGENTS)
    system.submit("fence-0", version=1)
    system.wait_terminal(["fence-0"], timeout_s=60)  # the scheduler's own init_transactions is behind it
    intruder = EventProducer(system.bootstrap, transactional_id=scheduler_transactional_id(system.layout, "fence-test"))
    intruder.init_transactions()
    ids = [f"fence-{i}" for i in range(1, 4)]
    for task_id in ids:
        system.submit(task_id, version=1)

    statuses = system.wait_terminal(ids, timeout_s=90)
    [(name, said)] = system.stall_restarts
    assert name == "scheduler", system.logs_tail()
    assert "ending the process for a restart" in said and "fenced or broken" in said, said
    assert set(statuses.values()) == {"completed"}, statuses
    assert not disagreements(system, statuses, ids)
