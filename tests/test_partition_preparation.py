"""A newly assigned partition is prepared (the scheduler's restore) off the rebalance callback, paused."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
from confluent_kafka import TopicPartition

from eventstore.health import HEALTH
from eventstore.producer import EventProducer
from eventstore.topics import TopicLayout
from schemas.messages import OperatorAlert
from tests.kafka_helpers import wait_for
from tests.runtime_harness import running

pytestmark = pytest.mark.kafka


def test_a_partition_is_prepared_off_the_rebalance_callback_while_paused_and_its_records_wait_for_it(
    bootstrap: str, layout: TopicLayout,
) -> None:
    """A long preparation neither keeps the loop from polling (max.poll.interval.ms) nor lets a record in early."""
    preparing, release = threading.Event(), threading.Event()
    prepared_on: list[str] = []
    handled: list[bool] = []

    def prepare(_partitions: list[TopicPartition], _current: Callable[[TopicPartition], bool]) -> None:
        prepared_on.append(threading.current_thread().name)
        preparing.set()
        assert release.wait(60)

    producer = EventProducer(bootstrap)
    for i in range(1, 10):
        producer.send(layout.inbox, OperatorAlert(task_id=f"task-{i}", sequence=1, workflow="w", workflow_version=1,
                                                  causation_id="c", reason="a record"))
    producer.flush()
    with running(bootstrap, layout, layout.inbox, lambda _r, _o: handled.append(release.is_set()),
                 on_assign_paused=prepare):
        assert preparing.wait(30)
        turns = HEALTH.turns
        assert wait_for(lambda: HEALTH.turns >= turns + 20, timeout_s=30), "the loop keeps polling meanwhile"
        assert handled == [], "nothing of a partition being prepared is handled"
        release.set()
        assert wait_for(lambda: len(handled) == 9, timeout_s=30)
    assert all(handled), "every record was handled after its partition was ready"
    assert prepared_on == ["prepare-partitions"], "prepared on a thread of its own, not in the rebalance callback"


def test_a_preparation_that_outlives_its_assignment_is_told_its_partitions_are_no_longer_its_own(
    bootstrap: str, layout: TopicLayout,
) -> None:
    """A second member joins while the first one's preparation of every partition still runs: the rebalance
    revokes them all and gives some back to the first member, whose new preparation owns those. The old
    preparation, released afterwards, must see none of its partitions as its own (the scheduler installed an
    empty fold over a live one when a stale restore could not tell: tasks' commands were then "unknown")."""
    started: list[threading.Event] = [threading.Event(), threading.Event()]
    release = threading.Event()
    seen: list[dict[int, bool]] = []

    def prepare(partitions: list[TopicPartition], current: Callable[[TopicPartition], bool]) -> None:
        turn = len(seen)
        seen.append({})
        if turn < len(started):
            started[turn].set()
        if turn == 0:
            assert release.wait(60)
        seen[turn].update({tp.partition: current(tp) for tp in partitions})

    def nothing(_partitions: list[TopicPartition], _current: Callable[[TopicPartition], bool]) -> None:
        return None

    with running(bootstrap, layout, layout.inbox, lambda _r, _o: None, on_assign_paused=prepare) as first:
        assert started[0].wait(30)
        with running(bootstrap, layout, layout.inbox, lambda _r, _o: None, on_assign_paused=nothing,
                     group_id=first.group_id):
            assert started[1].wait(30), "the first member got some partitions back, prepared anew"
            assert wait_for(lambda: len(seen[1]) > 0, timeout_s=30)
            release.set()
            assert wait_for(lambda: len(seen[0]) == layout.partitions, timeout_s=30)
    assert seen[0] == {p: False for p in range(layout.partitions)}, seen
    assert seen[1] and all(seen[1].values()), f"the new preparation owns what it was given: {seen}"
