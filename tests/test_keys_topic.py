"""The ``keys`` topic on a real broker: proposals land beside their task's inbox records, and an erased key's
record is physically gone from the topic once the compaction window has passed."""

from __future__ import annotations

import time
import uuid

import confluent_kafka
import pytest
from confluent_kafka.admin import AdminClient

from eventstore import keys as keys_module
from eventstore.keys import (
    ERASED,
    PROPOSED,
    DataKeys,
    Proposals,
    StrayProposals,
    key_report,
    proposal_record,
    read_key_records,
    roll,
)
from eventstore.partitioning import partition_of
from eventstore.producer import EventProducer
from eventstore.replay import LogRange
from eventstore.topics import TopicLayout, ensure_topics
from tests.kafka_helpers import wait_for

pytestmark = pytest.mark.kafka

WINDOW_MS = 1500


def raw_values(bootstrap: str, topic: str) -> list[bytes | None]:
    """Every record still on the topic, read from its beginning."""
    return [msg.value() for msg in LogRange(bootstrap, topic)]


def test_a_record_keyed_by_task_id_lands_on_the_partition_partition_of_names(bootstrap: str,
                                                                             layout: TopicLayout) -> None:
    producer = EventProducer(bootstrap)
    tasks = [f"order-{i}-{uuid.uuid4().hex[:6]}" for i in range(40)]
    for task in tasks:
        producer.send_raw(layout.inbox, task, b"x")
    producer.flush()
    placed = {msg.key().decode(): msg.partition() for msg in LogRange(bootstrap, layout.inbox)}
    assert placed == {task: partition_of(task, layout.partitions) for task in tasks}
    assert len(set(placed.values())) == layout.partitions, "the sample spreads over every partition"


def test_a_proposal_written_behind_the_schedulers_open_transaction_is_found(bootstrap: str,
                                                                            layout: TopicLayout) -> None:
    """The scheduler's transaction stays open over several polls of inbox: once it wrote to a keys partition,
    a submission polled later in the same batch has its proposal behind that open transaction."""
    proposals = Proposals(bootstrap, layout.keys, 0, {}, {})
    assert proposals.wrapped(proposal_record("none-yet", "r")) is None  # read to the end once, as a scheduler has
    scheduler = EventProducer(bootstrap, transactional_id=f"test-{uuid.uuid4().hex[:8]}")
    scheduler.init_transactions()
    scheduler.begin()
    scheduler.send_raw(layout.keys, "accepted-earlier", b"k1:own", partition=0)
    scheduler.send_raw(layout.keys, proposal_record("accepted-earlier", "r0"), None, [PROPOSED], partition=0)
    scheduler.raw.flush(10)
    submitter = EventProducer(bootstrap)
    submitter.send_raw(layout.keys, proposal_record("polled-later", "r1"), b"k1:later", [PROPOSED], partition=0)
    submitter.flush()

    assert proposals.wrapped(proposal_record("polled-later", "r1")) == "k1:later"
    assert proposals.wrapped(proposal_record("accepted-earlier", "r0")) is None
    scheduler.commit()
    proposals.taken(proposal_record("polled-later", "r1"))
    assert len(proposals) == 0


def tombstone_in_a_transaction(bootstrap: str, topic: str, record: str, partition: int, *, erasure: bool,
                               commit: bool) -> None:
    """A scheduler's tombstone of a proposal (a taking's, or an erasure's), in a transaction it commits or aborts."""
    scheduler = confluent_kafka.Producer({"bootstrap.servers": bootstrap,
                                          "transactional.id": f"test-{uuid.uuid4().hex[:8]}"})
    scheduler.init_transactions(30)
    scheduler.begin_transaction()
    scheduler.produce(topic, key=record, value=None, partition=partition,
                      headers=[PROPOSED, ERASED] if erasure else [PROPOSED])
    scheduler.flush(10)
    (scheduler.commit_transaction if commit else scheduler.abort_transaction)(30)


def propose(bootstrap: str, topic: str, proposals: dict[str, bytes], partition: int) -> None:
    submitter = EventProducer(bootstrap)
    for record, wrapped in proposals.items():
        submitter.send_raw(topic, record, wrapped, [PROPOSED], partition=partition)
    submitter.flush()


def test_a_fresh_stray_follower_finds_a_proposal_whose_taking_was_aborted(bootstrap: str,
                                                                          layout: TopicLayout) -> None:
    """A scheduler made after a crash mid-batch (or a rebalance) reads keys from the beginning, uncommitted: the
    tombstone of a taking whose transaction was aborted must not hide the proposal its submission comes back for."""
    aborted, committed = proposal_record("again", "r0"), proposal_record("accepted", "r1")
    propose(bootstrap, layout.keys, {aborted: b"k1:again", committed: b"k1:accepted"}, partition=1)
    tombstone_in_a_transaction(bootstrap, layout.keys, aborted, 1, erasure=False, commit=False)
    tombstone_in_a_transaction(bootstrap, layout.keys, committed, 1, erasure=False, commit=True)

    strays = StrayProposals(bootstrap, layout.keys)
    try:
        assert strays.find(aborted) == (1, "k1:again")
    finally:
        strays.close()


def test_an_erasures_tombstone_hides_a_kept_proposal_from_every_follower_and_an_aborted_one_is_named_for_the_redo(
    bootstrap: str, layout: TopicLayout
) -> None:
    """After an erasure no follower opens the task's kept proposal (a dead letter's replay must not open the data);
    an erasure aborted is decided again, so its proposals stay named by ``of_task`` for the tombstone to be
    written again, while the aborted tombstone is invisible to a committed reader (``dlq``, a restore)."""
    erased, redone = proposal_record("erased", "r0"), proposal_record("redone", "r1")
    propose(bootstrap, layout.keys, {erased: b"k1:erased", redone: b"k1:redone"}, partition=0)
    strays = StrayProposals(bootstrap, layout.keys)
    try:
        assert strays.find(erased) == (0, "k1:erased"), "found before the erasure, by a long-lived follower"
        tombstone_in_a_transaction(bootstrap, layout.keys, erased, 0, erasure=True, commit=True)
        tombstone_in_a_transaction(bootstrap, layout.keys, redone, 0, erasure=True, commit=False)
        assert strays.find(erased) is None
        assert strays.find(redone) is None, "an aborted erasure is redone: its proposal opens nothing meanwhile"
        assert strays.of_task("redone") == [(0, redone)], "named, so the redo tombstones it again"
    finally:
        strays.close()
    own = Proposals(bootstrap, layout.keys, 0, {}, {})
    try:
        assert own.wrapped(redone) is None and own.wrapped(erased) is None
        assert own.of_task("redone") == [redone]
    finally:
        own.close()
    assert read_key_records(bootstrap, layout.keys, {}).proposals == {erased: None, redone: "k1:redone"}


def test_the_key_report_counts_the_data_keys_each_master_key_wraps_tasks_and_proposals_apart(
    bootstrap: str, layout: TopicLayout
) -> None:
    producer = EventProducer(bootstrap)
    for task, wrapped in [("a", b"k1:aa"), ("b", b"k1:bb"), ("c", b"k1:cc"), ("b", b"k2:bb"), ("d", b"k2:dd")]:
        producer.send_raw(layout.keys, task, wrapped, partition=partition_of(task, layout.partitions))
    producer.send_raw(layout.keys, "c", None, partition=partition_of("c", layout.partitions))  # erased
    for name, wrapped in [(proposal_record("e", "r1"), b"k1:ee"), (proposal_record("a", "r2"), b"k2:a2"),
                          (proposal_record("a", "r2"), None)]:  # the last one taken by the scheduler
        producer.send_raw(layout.keys, name, wrapped, [PROPOSED], partition=partition_of(name[0], layout.partitions))
    roll(producer, layout.keys, layout.partitions)
    producer.flush()

    report = key_report(bootstrap, layout.keys)
    assert (report.data_keys, report.proposed, report.erased) == ({"k1": 1, "k2": 2}, {"k1": 1}, 1)
    assert report.wraps("k1") == 2 and report.wraps("k2") == 2 and report.wraps("k0") == 0


def test_an_erased_key_is_physically_gone_from_keys_once_the_compaction_window_passed(bootstrap: str) -> None:
    layout = TopicLayout(prefix=f"t{uuid.uuid4().hex[:10]}.", partitions=1)
    ensure_topics(AdminClient({"bootstrap.servers": bootstrap}), [layout.keys_spec(segment_ms=WINDOW_MS)])
    producer = EventProducer(bootstrap)
    producer.send_raw(layout.keys, "erased", b"k1:wrapped-erased-key", partition=0)
    producer.send_raw(layout.keys, "kept", b"k1:wrapped-kept-key", partition=0)
    producer.send_raw(layout.keys, "erased", None, partition=0)  # the erasure's tombstone, as the scheduler writes it
    producer.flush()
    assert b"k1:wrapped-erased-key" in raw_values(bootstrap, layout.keys)
    assert read_key_records(bootstrap, layout.keys, {}).tasks == {"erased": None, "kept": "k1:wrapped-kept-key"}

    # Kafka rolls a segment only on an append: the supervisor's marker, every half window, is that append.
    def rolled_and_gone() -> bool:
        roll(producer, layout.keys, layout.partitions)
        producer.flush()
        return b"k1:wrapped-erased-key" not in raw_values(bootstrap, layout.keys)

    began = time.monotonic()
    assert wait_for(rolled_and_gone, timeout_s=60, interval_s=WINDOW_MS / 2000), "the superseded record is gone"
    print(f"gone after {time.monotonic() - began:.1f} s")
    assert b"k1:wrapped-kept-key" in raw_values(bootstrap, layout.keys), "a live key stays"
    assert read_key_records(bootstrap, layout.keys, {}).tasks == {"erased": None, "kept": "k1:wrapped-kept-key"}, \
        "the tombstone (no key in it) stays a day, so a late reader learns of the erasure; a marker is no task's key"


def test_looking_up_each_new_tasks_key_reads_on_with_the_same_consumers(bootstrap: str, layout: TopicLayout,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Counted, not timed: a lookup per new task (an agent opening each task's sealed input, the scheduler
    taking each submission's proposal) reads on with the consumers made at the first one, however many
    tasks came before; a consumer made per lookup cost about 550 ms each."""
    made: list[object] = []
    real = confluent_kafka.Consumer

    def counting(config: dict[str, object]) -> object:
        made.append(config["group.id"])
        return real(config)

    monkeypatch.setattr(keys_module, "Consumer", counting)
    keys, proposals = DataKeys(bootstrap, layout.keys), Proposals(bootstrap, layout.keys, 0, {}, {})
    writer = EventProducer(bootstrap)
    for i in range(30):
        task = f"task-{i}-{uuid.uuid4().hex[:6]}"
        writer.send_raw(layout.keys, task, f"k1:{i}".encode(), partition=partition_of(task, layout.partitions))
        writer.send_raw(layout.keys, proposal_record(task, "r"), f"k1:p{i}".encode(), [PROPOSED], partition=0)
        writer.flush()
        assert keys.wrapped(task) == f"k1:{i}"
        assert proposals.wrapped(proposal_record(task, "r")) == f"k1:p{i}"
    assert keys.wrapped("never-written") is None

    assert len(made) == 4, made  # per reader: the follower and the one asking where partitions end
    keys.close()
    proposals.close()
