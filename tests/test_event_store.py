"""Appending, replaying and transactions against the real broker."""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections import defaultdict

import pytest
from confluent_kafka import TopicPartition
from prometheus_client import REGISTRY

from eventstore.errors import RestartRequired
from eventstore.producer import EventProducer
from eventstore.replay import ReplayReader
from eventstore.runtime import ConsumerRuntime, Record
from eventstore.topics import TopicLayout
from schemas.messages import OperatorAlert
from tests.kafka_helpers import read_all, wait_for
from tests.runtime_harness import FAST, running

pytestmark = pytest.mark.kafka


def _event(task_id: str, sequence: int) -> OperatorAlert:
    return OperatorAlert(task_id=task_id, sequence=sequence, workflow="w", workflow_version=1,
                         causation_id="c", reason=f"{task_id}#{sequence}")


def test_replay_returns_each_keys_events_in_append_order(bootstrap: str, layout: TopicLayout) -> None:
    producer = EventProducer(bootstrap)
    keys = [f"task-{i}" for i in range(40)]
    for sequence in range(1, 26):
        for key in keys:
            producer.send(layout.events, _event(key, sequence))
    producer.flush()

    reader = ReplayReader(bootstrap, layout.events)
    per_key: dict[str, list[int]] = defaultdict(list)
    for record in reader:
        assert isinstance(record.message, OperatorAlert)
        per_key[record.message.task_id].append(record.message.sequence)
    assert reader.stats.records == 40 * 25 == reader.stats.total
    assert set(per_key) == set(keys)
    for key in keys:
        assert per_key[key] == list(range(1, 26)), key


def test_replay_stops_at_the_end_seen_at_start(bootstrap: str, layout: TopicLayout) -> None:
    producer = EventProducer(bootstrap)
    producer.send(layout.events, _event("a", 1))
    producer.flush()
    reader = ReplayReader(bootstrap, layout.events)
    producer.send(layout.events, _event("a", 2))
    producer.flush()
    assert [r.message.sequence for r in reader] == [1]  # type: ignore[attr-defined]


def test_aborted_transaction_is_never_seen_by_read_committed_consumers(bootstrap: str, layout: TopicLayout) -> None:
    producer = EventProducer(bootstrap, transactional_id=f"tx-{uuid.uuid4().hex}")
    producer.init_transactions()
    producer.begin()
    producer.send(layout.events, _event("aborted", 1))
    producer.raw.flush()
    producer.abort()
    producer.begin()
    producer.send(layout.events, _event("committed", 1))
    producer.commit()

    seen = read_all(bootstrap, layout.events, expect=2, timeout_s=5)
    assert [m.key() for m in seen] == [b"committed"]
    assert [r.message.task_id for r in ReplayReader(bootstrap, layout.events)] == ["committed"]


def test_exactly_once_runtime_commits_output_and_offsets_together(bootstrap: str, layout: TopicLayout) -> None:
    producer = EventProducer(bootstrap)
    for i in range(1, 31):
        producer.send(layout.inbox, _event(f"t{i % 4}", i))
    producer.flush()

    def copy(record: Record, out: EventProducer) -> None:
        out.send(layout.events, record.message)

    with running(bootstrap, layout, layout.inbox, copy, transactional_id=f"tx-{uuid.uuid4().hex}") as runtime:
        assert wait_for(lambda: len(read_all(bootstrap, layout.events, expect=30, timeout_s=2)) == 30)
        group = runtime.group_id
        consumer = runtime._consumer
        committed = consumer.committed([TopicPartition(layout.inbox, p) for p in range(layout.partitions)], timeout=10)
    assert sum(max(tp.offset, 0) for tp in committed) == 30, f"offsets of {group} committed in the transactions"


def test_consumer_lag_per_partition_is_exported(bootstrap: str, layout: TopicLayout) -> None:
    producer = EventProducer(bootstrap)
    for i in range(1, 21):
        producer.send(layout.inbox, _event("one-key", i))
    producer.flush()
    handled: list[int] = []

    def slow(record: Record, _out: EventProducer) -> None:
        handled.append(record.offset)
        wait_for(lambda: False, timeout_s=0.1)

    with running(bootstrap, layout, layout.inbox, slow) as runtime:
        def lag() -> float | None:
            values = [REGISTRY.get_sample_value("stepstream_consumer_lag",
                                                {"group": runtime.group_id, "topic": layout.inbox,
                                                 "partition": str(p)}) for p in range(layout.partitions)]
            present = [v for v in values if v is not None]
            return max(present) if present else None

        assert wait_for(lambda: (lag() or 0) > 0, timeout_s=10), "lag shown while behind"
        assert wait_for(lambda: len(handled) == 20 and lag() == 0, timeout_s=20), "lag drops to 0"



def test_a_fenced_runtime_ends_for_a_restart_instead_of_retrying_its_record(
    bootstrap: str, layout: TopicLayout,
) -> None:
    """A producer that takes the runtime's transactional id fences it: whichever call learns it first (a produce
    answers ``_FATAL``, a transactional call a fatal error), retrying cannot help, so the runtime ends with
    RestartRequired (exit 75 for its supervisor) and the record stays uncommitted for its restart."""
    transactional_id = f"tx-{uuid.uuid4().hex}"

    def copy_twice(record: Record, out: EventProducer) -> None:
        """Two records a second apart, as a handler writes several per command: the first one's partition is
        added to the transaction meanwhile, the broker answers it fenced, and the second produce is refused."""
        out.send(layout.events, record.message)
        time.sleep(1)
        out.send(layout.events, record.message)

    runtime = ConsumerRuntime(bootstrap=bootstrap, group_id=f"g-{uuid.uuid4().hex}", topics=[layout.inbox],
                              handler=copy_twice, dlq_topic=layout.dlq, settings=FAST,
                              transactional_id=transactional_id)
    ended: list[BaseException | None] = []

    def run() -> None:
        try:
            runtime.run()
            ended.append(None)
        except BaseException as exc:
            ended.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    producer = EventProducer(bootstrap)
    try:
        producer.send(layout.inbox, _event("before", 1))
        producer.flush()
        assert wait_for(lambda: len(read_all(bootstrap, layout.events, expect=2, timeout_s=1)) == 2, timeout_s=30)
        EventProducer(bootstrap, transactional_id=transactional_id).init_transactions()
        producer.send(layout.inbox, _event("after", 2))
        producer.flush()
        thread.join(timeout=60)
        assert ended and isinstance(ended[0], RestartRequired), f"ended with {ended} (still running: {not ended})"
    finally:
        runtime.stop()
        thread.join(timeout=30)
    assert [m.key() for m in read_all(bootstrap, layout.events, expect=3, timeout_s=3)] == [b"before", b"before"]


def test_a_shared_producer_reports_a_lost_send_to_its_sender_only(bootstrap: str, layout: TopicLayout) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    from eventstore.errors import InfrastructureError

    small = f"{layout.prefix}small-messages"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(small, 1, 1, config={"max.message.bytes": "1024"})])[small].result(30)
    base = EventProducer(bootstrap)
    losing, keeping = base.share(), base.share()
    losing.send_raw(small, "k", os.urandom(8192))  # refused by the broker: the topic takes at most 1 KB
    keeping.send(layout.events, _event("t-kept", 1))

    keeping.flush()  # waits for both sends; the refusal is not its own, so its offsets may be stored
    with pytest.raises(InfrastructureError, match="delivery failed"):
        losing.flush()
    assert [m.key() for m in read_all(bootstrap, layout.events, expect=1)] == [b"t-kept"]
    with pytest.raises(ValueError, match="transaction cannot be shared"):
        EventProducer(bootstrap, transactional_id=f"{layout.prefix}tx").share()
