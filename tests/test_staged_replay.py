"""A replay with partitions side by side (``projections.staged``) against a replay in order, on both backends,
over a real broker: the same rows, the same poison skipped, the same refusals; and back to the replay in
order when the partitions cannot be merged."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from eventstore.dlq import HEADER_PREFIX, REPLAY_OF, REPLAY_TIME, REPLAY_TO, dlq_headers
from eventstore.producer import EventProducer
from eventstore.topics import TopicLayout
from projections.rebuild import Replayer, verify_stores
from projections.replaying import ReplayStats, sources
from projections.settings import StoreSpec
from projections.store import SqliteStore, Store
from schemas.messages import OperatorCommand, TaskAccepted, TaskRejected
from tests.histories import histories, publish


@pytest.fixture
def stores(store_spec: StoreSpec) -> Iterator[tuple[Store, Store]]:
    """Two empty stores of the backend under test: one replayed in order, one side by side."""
    base = store_spec.open()
    in_order, side_by_side = base.sibling("in_order"), base.sibling("side_by_side")
    try:
        yield in_order, side_by_side
    finally:
        in_order.discard()
        side_by_side.discard()
        base.close()


def _replay_both(bootstrap: str, layout: TopicLayout, stores: tuple[Store, Store]) -> tuple[ReplayStats, ReplayStats]:
    in_order, side_by_side = stores
    ordered = Replayer(bootstrap, sources(layout), batch_size=300).replay(in_order)
    staged = Replayer(bootstrap, sources(layout), batch_size=300, workers=2, stage_from=0).replay(side_by_side)
    assert not ordered.staged
    comparison = verify_stores(in_order, side_by_side)
    assert comparison.equal, comparison.as_json()
    assert (staged.records, staged.applied, staged.rejected) == (ordered.records, ordered.applied, ordered.rejected)
    for topic in (layout.events, layout.dlq):
        assert side_by_side.offsets(topic) == in_order.offsets(topic)
    return ordered, staged


@pytest.mark.kafka
def test_partitions_replayed_side_by_side_give_the_rows_poison_and_refusals_of_a_replay_in_order(
    bootstrap: str, layout: TopicLayout, stores: tuple[Store, Store], store_spec: StoreSpec,
) -> None:
    events = list(histories(150, seed=31))
    publish(bootstrap, layout.events, events)
    producer = EventProducer(bootstrap)
    producer.send_raw(layout.events, "garbage", b"\x00not avro")  # undecodable: skipped
    producer.send(layout.events, OperatorCommand(task_id="cmd-1", command_id="c1", action="cancel"))  # no event
    accepted = next(e for e in events if isinstance(e, TaskAccepted))
    producer.send(layout.events, accepted.model_copy(update={"sequence": 99}))  # a second admission: refused
    # SQLite takes a NUL character, PostgreSQL refuses it: there the staged rows cannot be loaded.
    producer.send(layout.events, TaskRejected(task_id="nul-1", sequence=1, workflow="orders", workflow_version=1,
                                              causation_id="c", reason="bad\x00input", input_digest="d"))
    for i in range(4):  # dead letters on dlq partition 0, at offsets 0-3
        producer.send_raw(layout.dlq, f"poison-{i}", b"\x00not avro", dlq_headers(
            reason="corrupt", error_class="DecodeError", kind="corrupt", topic=layout.inbox, partition=0, offset=i,
            group=layout.scheduler_group), partition=0)
    producer.flush()
    # `dlq replay` marks the first one replayed, on the partition of the letter it names
    producer.send_raw(layout.dlq, "poison-0", None, [(HEADER_PREFIX + REPLAY_OF, b"0:0"),
                                                     (HEADER_PREFIX + REPLAY_TO, f"{layout.inbox}[0]@7".encode()),
                                                     (HEADER_PREFIX + REPLAY_TIME, b"2026-12-03T10:00:00+00:00")],
                      partition=0)
    producer.flush()

    ordered, staged = _replay_both(bootstrap, layout, stores)
    assert ordered.rejected == (2 if store_spec.kind == "postgresql" else 1)
    assert ordered.records == len(events) + 4 + 5
    assert staged.staged is (store_spec.kind == "sqlite"), "PostgreSQL refused the NUL: replayed in order"
    assert sum(stores[1].dlq_depth().values()) == 3, "one dead letter of four marked replayed"
    assert len(stores[1].projection_errors()) == ordered.rejected


@pytest.mark.kafka
@pytest.mark.parametrize("store_spec", ["sqlite"], indirect=True)  # the check precedes loading: any backend
def test_a_task_whose_events_span_partitions_is_replayed_in_order_instead(
    bootstrap: str, layout: TopicLayout, stores: tuple[Store, Store],
) -> None:
    events = list(histories(60, seed=32))
    publish(bootstrap, layout.events, events)
    producer = EventProducer(bootstrap)
    task = events[0].task_id
    for partition in range(layout.partitions):  # as a topic whose partitions were added to would have it
        producer.send(layout.events, events[0].model_copy(update={"sequence": 50 + partition}), partition=partition)
    producer.flush()

    _ordered, staged = _replay_both(bootstrap, layout, stores)
    assert not staged.staged
    assert stores[1].task(task) is not None


def test_a_staging_store_keeps_only_the_indexes_that_refuse_rows(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "staging.db", scratch=True)
    try:
        with store._write() as db:
            db.execute("create unique index alerts_once on alerts (task_id, occurred_at)")
        store.keys_only()
        with store._write() as db:
            left = {name for (name,) in db.execute("select name from sqlite_master where type = 'index'")}
            assert "alerts_once" in left and "tasks_by_created" not in left
            assert {"sqlite_autoindex_tasks_1", "sqlite_autoindex_task_history_1"} <= left
            db.execute("insert into alerts(task_id, reason, occurred_at) values ('t', 'r', 1)")
            with pytest.raises(sqlite3.IntegrityError):
                db.execute("insert into alerts(task_id, reason, occurred_at) values ('t', 'again', 1)")
    finally:
        store.close()
