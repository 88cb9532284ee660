"""A scheduler restores a partition from its changelog (``scheduler-state``), not from the partition's whole
history, and the changelog always agrees with ``events``: real broker, real order service, real processes.

Sizes are lean by default; ``STEPSTREAM_RESTORE_FINISHED`` / ``STEPSTREAM_RESTORE_LIVE`` run the issue's
100,000 finished and 100 live tasks, ``STEPSTREAM_RESTORE_KILLS`` more kills.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import pytest

from eventstore.replay import LogRange, ReplayReader
from scheduler.quarantine import PartitionFold
from scheduler.restore import restore_partition
from scheduler.sealing import EventSealer
from schemas.codec import default_codec
from schemas.messages import Event
from tests.agreement import disagreements
from tests.histories import histories, publish
from tests.kafka_helpers import wait_for
from tests.system import AGENTS, System
from tests.workflows import REGISTRY

FINISHED = int(os.environ.get("STEPSTREAM_RESTORE_FINISHED", "1000"))
LIVE = int(os.environ.get("STEPSTREAM_RESTORE_LIVE", "10"))
KILLS = int(os.environ.get("STEPSTREAM_RESTORE_KILLS", "2"))
PATIENCE_S = 60 + FINISHED / 100
"""Longer waits for a bigger history: the first start folds it whole, the projector catches up with it."""


def finished_orders(count: int) -> Iterator[Event]:
    """Histories of finished tasks (completed, failed, rejected) of the scheduler's ``orders`` v1."""
    for event in histories(count, prefix="done"):
        yield event.model_copy(update={"workflow": "orders"})


def restores(system: System) -> list[dict[str, int]]:
    """What each "partition restored" the running scheduler logged says it read."""
    lines = (json.loads(line) for line in system.procs.log("scheduler").splitlines() if line.startswith("{"))
    return [line for line in lines if line.get("event") == "partition restored"]


def requests_sent(system: System, agent: str) -> int:
    return sum(1 for _ in LogRange(system.bootstrap, system.layout.agent(agent)))


def assert_restore_agrees_with_a_fresh_fold(system: System) -> None:
    """For every partition, the state a restore reaches from the changelog (and the events past its
    checkpoint) is exactly the state a fold of the partition's whole ``events`` reaches."""
    sealer = EventSealer(REGISTRY, None)
    for partition in range(system.layout.partitions):
        restored = restore_partition(system.bootstrap, system.layout, partition, sealer, {})
        fresh = PartitionFold(default_codec(), lambda event: event)
        for _p, offset, key, value in ReplayReader(system.bootstrap, system.layout.events,
                                                   partitions=[partition]).raw():
            fresh.add(key, value, f"{partition}:{offset}")
        assert restored.tasks == fresh.tasks, f"partition {partition}: the changelog disagrees with events"
        assert set(restored.quarantined) == set(fresh.quarantined) == set()


@pytest.mark.kafka
def test_a_restart_reads_one_record_per_task_not_the_history_and_its_live_tasks_complete(system: System) -> None:
    written = publish(system.bootstrap, system.layout.events, finished_orders(FINISHED))
    system.start("scheduler")  # a deployment without a changelog yet: this first restore folds events whole
    system.procs.wait_started("scheduler", "partition restored", count=system.layout.partitions,
                              timeout_s=PATIENCE_S)
    assert sum(r["events"] for r in restores(system)) == written
    assert sum(r["changelog_records"] for r in restores(system)) == 0
    live = [f"live-{i}" for i in range(LIVE)]
    for task_id in live:
        system.submit(task_id, version=1)
    assert wait_for(lambda: requests_sent(system, "inventory") >= LIVE, timeout_s=PATIENCE_S), system.logs_tail()

    system.procs.kill("scheduler")  # SIGKILL, its live tasks waiting on their first step
    system.restart("scheduler")
    system.procs.wait_started("scheduler", "partition restored", count=system.layout.partitions)
    read = restores(system)
    from_changelog, from_events = sum(r["changelog_records"] for r in read), sum(r["events"] for r in read)
    tasks = sum(r["tasks"] for r in read)
    print(f"restore after {written:,} events of {FINISHED:,} finished and {LIVE} live tasks: "
          f"{from_changelog:,} changelog records + {from_events:,} events read, {tasks:,} tasks")
    assert tasks == FINISHED + LIVE and sum(r["in_flight"] for r in read) == LIVE
    assert tasks <= from_changelog <= tasks + 10 * LIVE, "one record per task, and a few not compacted yet"
    assert from_events <= 4 * LIVE, "only the events past the changelog's checkpoint"

    system.start("projector", *AGENTS, "supervisor")
    statuses = system.wait_terminal(live, timeout_s=120 + PATIENCE_S)
    assert set(statuses.values()) == {"completed"}
    assert disagreements(system, statuses, live) == {}
    assert_restore_agrees_with_a_fresh_fold(system)


@pytest.mark.kafka
def test_a_scheduler_killed_between_events_and_commit_again_and_again_restores_what_a_fresh_fold_gives(
    system: System,
) -> None:
    # A stable transactional id: each successor fences the transaction its predecessor left open at once.
    system.env["STEPSTREAM_SCHEDULER_INSTANCE"] = "crashing"
    system.start("projector", *AGENTS, "supervisor")
    tasks: list[str] = []
    for round_ in range(KILLS):
        system.procs.start("scheduler", "tests.workers.crashing_scheduler",
                           env={"STEPSTREAM_TEST_DIE_AFTER_BATCHES": str(1 + round_ % 3)})
        system.procs.wait_started("scheduler", "partition restored", count=system.layout.partitions)
        wave = [f"kill-{round_}-{i}" for i in range(6)]  # fresh work, so that each life reaches its kill
        for task_id in wave:
            system.submit(task_id, version=1)
        tasks += wave
        assert wait_for(lambda: not system.procs.alive("scheduler"), timeout_s=90), \
            f"round {round_}: it did not reach its kill\n{system.logs_tail()}"
        assert system.procs.procs["scheduler"].returncode == -9, system.procs.log("scheduler")[-3000:]
        assert_restore_agrees_with_a_fresh_fold(system)

    system.restart("scheduler")
    statuses = system.wait_terminal(tasks, timeout_s=180)
    assert set(statuses.values()) == {"completed"}
    assert disagreements(system, statuses, tasks) == {}
    assert_restore_agrees_with_a_fresh_fold(system)
