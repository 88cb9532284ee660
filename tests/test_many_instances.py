"""Two instances of every service on a three-broker cluster lose nothing and apply nothing twice through a
SIGKILL of the broker coordinating a scheduler's transactions, and every task ends soon after it.

Topics have three replicas (``min.insync.replicas`` 2); two schedulers, two of each forward and compensation
agent, two projectors writing one PostgreSQL store and two supervisors share the partitions. The order service
errs now and then and refuses some shipments for good (those tasks compensate). Once a random share of the tasks
ended, the transaction coordinator of one of the schedulers is SIGKILLed (tests/broker_kill.py) and stays down
for the rest of the run. Every task must be terminal within a minute of the kill, its end agreeing with the
service's records (nothing applied twice: tests/agreement.py), no service may have died for good, and
``stepstream projections verify`` must find the store equal to a replay of the log.

``STEPSTREAM_SOAK_TASKS`` sets the number of tasks (default 24); ``benchmarks/broker_kill_loop.py`` runs the
same through many kills and reports the times.
"""

from __future__ import annotations

import os
import random
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient

from eventstore.cluster import LocalCluster
from eventstore.topics import TopicLayout, ensure_topics
from tests.broker_kill import run_through_kill
from tests.system import AGENTS, System
from tests.test_compensation_end_to_end import COMPENSATION_AGENTS, saga

__all__ = ["saga"]

pytestmark = pytest.mark.kafka

TASKS = int(os.environ.get("STEPSTREAM_SOAK_TASKS", "24"))
RECOVERY_S = 60
"""Every task ends within this long of the broker's SIGKILL."""
PATIENCE_S = 120 + TASKS
"""How long each phase may take before the run gives up: a task a second at worst, beyond two minutes."""


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    cluster = LocalCluster(tmp_path / "cluster", nodes=3)
    cluster.start()
    try:
        yield cluster
    finally:
        for node in cluster.nodes:  # a throwaway cluster: SIGKILL spares the test the brokers' controlled shutdown
            node.kill()


@pytest.fixture
def bootstrap(cluster: LocalCluster) -> str:
    """This module's tests run on their own three-broker cluster, not the session's single broker."""
    return cluster.bootstrap_servers


@pytest.fixture
def layout(bootstrap: str) -> TopicLayout:
    """Four partitions (two per instance), three replicas of each; the agents' topics made up front so no
    agent waits for the scheduler to create its topic."""
    layout = TopicLayout(prefix=f"t{uuid.uuid4().hex[:10]}.", partitions=4, replication_factor=3)
    specs = [*layout.core_specs(), *(layout.agent_spec(a) for a in (*AGENTS, *COMPENSATION_AGENTS))]
    ensure_topics(AdminClient({"bootstrap.servers": bootstrap}), specs, replication_factor=3)
    return layout


@pytest.mark.timeout(300 + 3 * PATIENCE_S)
def test_two_of_every_service_on_three_brokers_end_every_task_once_within_a_minute_of_a_coordinator_sigkill(
    saga: System, cluster: LocalCluster, postgres_url: str,
) -> None:
    saga.env.update({"STEPSTREAM_STORE_URL": postgres_url, "STEPSTREAM_REPLICATION_FACTOR": "3"})
    seed = random.randrange(1 << 32)
    # Killed early in the run (a twentieth to a quarter of the tasks ended), so most tasks are still in flight
    # and the test stays short; benchmarks/broker_kill_loop.py draws from a tenth to a half.
    run = run_through_kill(saga, cluster, tasks=TASKS, rng=random.Random(seed), patience_s=PATIENCE_S,
                           kill_between=(0.05, 0.25))
    print(f"seed {seed}: {run.figures()}", file=sys.stderr)

    assert not run.wrong, f"{len(run.wrong)} of {TASKS} tasks disagree with the service " \
                          f"({dict(run.outcomes)}): {run.wrong}\n{saga.logs_tail()}"
    assert run.outcomes["completed"] and run.outcomes["compensated"], f"both ends exercised: {dict(run.outcomes)}"
    assert run.ended_after_kill_s is not None and run.ended_after_kill_s <= RECOVERY_S, \
        f"tasks unfinished {run.ended_after_kill_s} s after the kill ({run.figures()})\n{saga.logs_tail()}"
    assert not run.exits, f"services ended for good: {run.exits}\n{saga.logs_tail()}"
    assert run.verified == "equal", run.verified
