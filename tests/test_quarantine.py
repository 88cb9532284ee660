"""A task whose history does not fold is quarantined; every other task of its partition goes on.

The first tests fold partitions record by record without a broker (``scheduler.quarantine``); the last runs
the whole system over a poisoned history, then a "fixed" scheduler that folds it and releases the task.
"""

from __future__ import annotations

import json
import random
import subprocess
from contextlib import closing
from datetime import UTC, datetime

import pytest

from eventstore.replay import ReplayReader
from projections.store import SqliteStore
from scheduler.decider import fold
from scheduler.quarantine import PartitionFold
from schemas.codec import MAGIC, default_codec
from schemas.messages import Event, OperatorAlert, TaskCompleted, TaskQuarantined, TaskReleased
from tests.histories import history
from tests.kafka_helpers import wait_for
from tests.system import System

START = datetime(2026, 12, 1, tzinfo=UTC)
NEWER_VERSION = MAGIC + bytes(8) + b"\x02written by a release this one predates"


def completed(task_id: str) -> list[Event]:
    rng = random.Random(task_id)
    while True:  # the generator's shapes vary: take the first completed one
        events = history(task_id, rng, START)
        if isinstance(events[-1], TaskCompleted):
            return events


def again(event: Event, sequence: int) -> Event:
    """``event`` once more, next in its task's sequence: a duplicate a buggy release could write."""
    return event.model_copy(update={"sequence": sequence, "message_id": f"dup-{sequence}"})


def folded(records: list[tuple[str, bytes]]) -> PartitionFold:
    partition = PartitionFold(default_codec(), lambda event: event)
    for offset, (key, value) in enumerate(records):
        partition.add(key.encode(), value, f"0:{offset}")
    return partition


def encoded(*histories: list[Event]) -> list[tuple[str, bytes]]:
    """The histories interleaved record by record, as tasks share a partition."""
    codec = default_codec()
    out: list[tuple[str, bytes]] = []
    for i in range(max(len(h) for h in histories)):
        out.extend((h[i].task_id, codec.encode(h[i])) for h in histories if i < len(h))
    return out


def test_an_event_the_decider_refuses_quarantines_its_task_and_the_others_fold() -> None:
    victim, other = completed("victim"), completed("other")
    poisoned = [*victim, again(victim[-1], len(victim) + 1), again(victim[-1], len(victim) + 2)]
    partition = folded(encoded(poisoned, other))

    assert set(partition.tasks) == {"other"}
    folded_other = fold(other)
    assert folded_other is not None and partition.tasks["other"] == folded_other.settled()
    quarantine = partition.quarantined["victim"]
    assert not quarantine.foldable and not quarantine.recorded
    assert quarantine.unfolded_sequence == len(victim) + 1
    assert quarantine.next_sequence == len(victim) + 3, "records about it continue after the last event on the log"
    assert "TaskCompleted" in quarantine.reason and "cannot follow" in quarantine.reason


def test_an_event_of_a_newer_version_quarantines_its_task_instead_of_stopping_the_partition() -> None:
    victim, other = completed("victim"), completed("other")
    records = [*encoded(victim, other), ("victim", NEWER_VERSION)]
    partition = folded(records)

    assert set(partition.tasks) == {"other"}
    quarantine = partition.quarantined["victim"]
    assert "unknown_schema" in quarantine.reason and quarantine.unfolded_sequence is None
    assert quarantine.next_sequence == len(victim) + 2


def test_a_quarantine_already_on_the_log_is_not_recorded_again() -> None:
    victim = completed("victim")
    n = len(victim)
    common = {"task_id": "victim", "workflow": victim[0].workflow, "workflow_version": 1, "causation_id": "c"}
    recorded = [*victim, again(victim[-1], n + 1), OperatorAlert(**common, sequence=n + 2, reason="quarantined"),
                TaskQuarantined(**common, sequence=n + 3, reason="does not fold", unfolded_sequence=n + 1)]
    quarantine = folded(encoded(recorded)).quarantined["victim"]
    assert quarantine.recorded and quarantine.next_sequence == n + 4


def test_a_version_that_folds_the_history_keeps_the_task_quarantined_until_its_release() -> None:
    victim = completed("victim")
    n = len(victim)
    common = {"task_id": "victim", "workflow": victim[0].workflow, "workflow_version": 1, "causation_id": "c"}
    quarantined = [*victim, OperatorAlert(**common, sequence=n + 1, reason="quarantined"),
                   TaskQuarantined(**common, sequence=n + 2, reason="does not fold", unfolded_sequence=n)]
    partition = folded(encoded(quarantined))
    assert partition.quarantined["victim"].foldable
    assert partition.tasks["victim"].status == "completed"

    released = [*quarantined, TaskReleased(**common, sequence=n + 3, status="completed", command_id="free")]
    partition = folded(encoded(released))
    assert partition.quarantined == {} and partition.tasks["victim"].sequence == n + 3


# ---- the whole system ------------------------------------------------------------------------------------


@pytest.mark.kafka
def test_a_poisoned_history_is_quarantined_the_partition_goes_on_and_a_fixed_version_releases_it(
    system: System,
) -> None:
    system.start()
    system.submit("victim", version=1)
    system.submit("newer", version=1)
    assert system.wait_terminal(["victim", "newer"], timeout_s=90) == {"victim": "completed", "newer": "completed"}

    # Stopped, the scheduler misses nothing; its successor restores from a log it cannot fully fold.
    assert system.procs.terminate("scheduler") == 0
    victim = system.events("victim")
    partition = _partition_of(system, "victim")
    system.producer.send(system.layout.events, again(victim[-1], len(victim) + 1), partition=partition)
    system.producer.send_raw(system.layout.events, "newer", NEWER_VERSION, partition=_partition_of(system, "newer"))
    system.producer.flush()
    system.restart("scheduler")

    others = [f"after-{i}" for i in range(6)]  # 3 partitions: some share the victim's
    for task_id in others:
        system.submit(task_id, version=1)
    assert set(system.wait_terminal(others, timeout_s=90).values()) == {"completed"}
    assert any(_partition_of(system, t) == partition for t in others), "a neighbour on the victim's partition"

    with closing(SqliteStore(system.store_path)) as store:
        assert wait_for(lambda: (store.task("victim") or {}).get("status") == "quarantined", timeout_s=30)
        assert wait_for(lambda: (store.task("newer") or {}).get("status") == "quarantined", timeout_s=30)
        assert "TaskCompleted" in (store.task("victim") or {})["quarantine_reason"]
        assert "unknown_schema" in (store.task("newer") or {})["quarantine_reason"]
        assert {a["task_id"] for a in store.alerts() if a["reason"].startswith("task quarantined")} == \
            {"victim", "newer"}

        # Its commands are dead-lettered with the reason; so is a release this version cannot honour.
        assert _operator(system, "resubmit", "victim").returncode == 0
        assert _operator(system, "release", "victim").returncode == 0
        assert wait_for(lambda: len(_dead_letters(store, "victim")) == 2, timeout_s=30)
        reasons = sorted(_dead_letters(store, "victim"))
        assert reasons[0].startswith("task quarantined: TaskCompleted") and \
            reasons[1].startswith("task quarantined: this version cannot fold its history either")
        listed = system.cli("tasks", "--state", "quarantined", "--json")
        assert listed.returncode == 0, listed.stderr
        assert {json.loads(line)["task_id"] for line in listed.stdout.splitlines()} == {"victim", "newer"}

        # A release that folds the history: the task is still quarantined (the log says so) until released.
        assert system.procs.terminate("scheduler") == 0
        system.procs.start("scheduler", "tests.workers.fixed_scheduler")
        system.procs.wait_started("scheduler")
        released = _operator(system, "release", "victim", "--wait")
        assert released.returncode == 0, released.stdout + released.stderr + system.logs_tail()
        assert released.stdout.strip() == "accepted: released from quarantine (completed)"
        assert wait_for(lambda: (store.task("victim") or {}).get("status") == "completed", timeout_s=30)
        assert (store.task("victim") or {})["quarantine_reason"] is None
        assert (store.task("newer") or {})["status"] == "quarantined", "still unreadable to the fixed release"


def _partition_of(system: System, task_id: str) -> int:
    for record in ReplayReader(system.bootstrap, system.layout.events):
        if record.key == task_id:
            return record.partition
    raise AssertionError(f"{task_id} has no events")


def _operator(system: System, action: str, task_id: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return system.cli("task", action, task_id, *extra, timeout_s=120)


def _dead_letters(store: SqliteStore, task_id: str) -> list[str]:
    return [d["reason"] for d in store.dlq_entries() if d["message_key"] == task_id]
