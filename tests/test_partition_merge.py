"""Several partitions read as one sequence: the order is the log's, whatever order the fetches arrive in."""

from __future__ import annotations

import heapq
import uuid

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient
from hypothesis import given
from hypothesis import strategies as st

from eventstore.kafka_config import connection_config
from eventstore.merge import OrderKey, PartitionMerge
from eventstore.replay import LogRange
from eventstore.topics import TopicSpec, ensure_topics

Record = tuple[int, int, int]  # (timestamp, partition, offset), its own key


def _key(record: Record) -> OrderKey:
    return record


@st.composite
def logs_and_arrivals(draw: st.DrawFn) -> tuple[list[list[Record]], list[int]]:
    """Partitions of records with timestamps in any order (several producers' clocks), and an arrival
    schedule: which partition's next record arrives at each step, partitions interleaved at random."""
    partitions = draw(st.integers(1, 4))
    log = [[(draw(st.integers(0, 20)), p, offset) for offset in range(draw(st.integers(0, 12)))]
           for p in range(partitions)]
    arrivals = draw(st.permutations([p for p in range(partitions) for _ in log[p]]))
    return log, arrivals


@given(logs_and_arrivals(), st.data())
def test_the_merged_order_is_the_logs_whatever_order_the_records_arrive_in(
    drawn: tuple[list[list[Record]], list[int]], data: st.DataObject,
) -> None:
    log, arrivals = drawn
    merge: PartitionMerge[Record] = PartitionMerge(range(len(log)), _key)
    for p, records in enumerate(log):
        if not records:
            merge.finish(p)
    out: list[Record] = []
    taken = [0] * len(log)
    for p in arrivals:
        merge.add(p, log[p][taken[p]])
        taken[p] += 1
        if taken[p] == len(log[p]):
            merge.finish(p)
        if data.draw(st.booleans(), label="hand out now"):
            out.extend(merge.ready())
    out.extend(merge.ready())
    assert out == list(heapq.merge(*log))


def test_nothing_is_handed_out_while_a_partition_that_may_still_deliver_has_nothing_buffered() -> None:
    merge: PartitionMerge[Record] = PartitionMerge([0, 1], _key)
    merge.add(0, (5, 0, 0))
    assert list(merge.ready()) == [], "partition 1's first record could be earlier"
    merge.add(1, (9, 1, 0))
    assert list(merge.ready()) == [(5, 0, 0)]
    assert merge.buffered(1) == 1
    merge.finish(0)
    assert list(merge.ready()) == [(9, 1, 0)]


@pytest.mark.kafka
def test_a_range_over_several_partitions_is_read_in_timestamp_order_every_time(bootstrap: str) -> None:
    """Partition 0's records are all later than partition 1's: a merged read holds partition 0 back,
    pausing it once thousands wait, and gives every record once."""
    topic = f"merge-{uuid.uuid4().hex[:10]}"
    ensure_topics(AdminClient({"bootstrap.servers": bootstrap}), [TopicSpec(topic, 3)])
    producer = Producer({**connection_config(bootstrap), "linger.ms": 5})
    base = 1_700_000_000_000
    for i in range(12_000):
        producer.produce(topic, value=b"late", partition=0, timestamp=base + 100_000 + i)
        producer.produce(topic, value=b"early", partition=1, timestamp=base + i)
        if i % 3 == 0:
            producer.produce(topic, value=b"between", partition=2, timestamp=base + 2 * i)
    assert producer.flush(30) == 0

    def read() -> list[tuple[int, int, int]]:
        return [(m.timestamp()[1], m.partition(), m.offset()) for m in LogRange(bootstrap, topic, batch_size=500)]

    first = read()
    assert len(first) == 28_000 and len(set(first)) == 28_000
    assert first == sorted(first)
    assert read() == first
