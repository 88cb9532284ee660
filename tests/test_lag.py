"""Lag is what a consumer still has to read, on a partition written with transactions as the scheduler
writes ``events`` and agent requests: commit markers and aborted records take offsets that no consumer
ever gets, and must not show as lag (an idle partition once showed 1 forever). Each figure is checked
against what a real read_committed consumer then actually reads."""

from __future__ import annotations

import uuid

import pytest
from confluent_kafka import Consumer, KafkaError, TopicPartition

from eventstore.producer import EventProducer
from eventstore.topics import TopicLayout
from projections.lag import PEEK, PROJECTION, LagReader, PartitionLag
from tests.histories import histories

pytestmark = pytest.mark.kafka


class Partition0:
    """Partition 0 of ``events``: a transactional producer writing it and a consumer group reading it."""

    def __init__(self, bootstrap: str, layout: TopicLayout) -> None:
        self.bootstrap = bootstrap
        self.topic = layout.events
        self.group = f"{layout.prefix}reader"
        self.producer = EventProducer(bootstrap, transactional_id=f"lag-{uuid.uuid4().hex}")
        self.producer.init_transactions()
        self.reader = LagReader(bootstrap, layout.prefix, cache_s=0)
        self._events = histories(1000, seed=5)

    def write(self, records: int, *, commit: bool = True) -> None:
        self.producer.begin()
        for _ in range(records):
            self.producer.send(self.topic, next(self._events), partition=0)
        if commit:
            self.producer.commit()
        else:
            self.producer.flush()  # on the log first: an abort before delivery would leave nothing there
            self.producer.abort()

    def still_to_read(self, position: int) -> int:
        """Records a read_committed consumer starting at ``position`` gets before the end of the partition."""
        consumer = Consumer({"bootstrap.servers": self.bootstrap, "group.id": f"count-{uuid.uuid4().hex}",
                             "enable.partition.eof": True, "isolation.level": "read_committed"})
        consumer.assign([TopicPartition(self.topic, 0, position)])
        count = 0
        try:
            while True:
                msg = consumer.poll(10)
                assert msg is not None, "no end of partition within 10 s"
                if msg.error() is not None and msg.error().code() == KafkaError._PARTITION_EOF:
                    return count
                count += 1
        finally:
            consumer.close()

    def commit_position(self, offset: int) -> None:
        consumer = Consumer({"bootstrap.servers": self.bootstrap, "group.id": self.group})
        consumer.commit(offsets=[TopicPartition(self.topic, 0, offset)], asynchronous=False)
        consumer.close()

    def group_row(self) -> PartitionLag:
        return next(r for r in self.reader.groups() if r.group == self.group and r.topic == self.topic)

    def projection_row(self, position: int) -> PartitionLag:
        return next(r for r in self.reader.projection({self.topic: {0: position}}) if r.partition == 0)


@pytest.fixture
def partition(bootstrap: str, layout: TopicLayout) -> Partition0:
    return Partition0(bootstrap, layout)


def test_a_consumer_that_read_everything_of_a_transactional_partition_has_no_lag(partition: Partition0) -> None:
    partition.write(5)
    partition.commit_position(5)  # after the 5th record; the commit marker sits at offset 5
    row = partition.group_row()
    assert (row.position, row.end, row.lag) == (5, 6, 0)
    assert partition.still_to_read(5) == 0
    assert partition.projection_row(5).lag == 0 and partition.projection_row(5).group == PROJECTION


def test_lag_counts_records_still_to_read_and_neither_markers_nor_aborted_records(partition: Partition0) -> None:
    partition.write(5)
    partition.commit_position(5)
    partition.write(3)  # offsets 6-8, marker 9
    partition.write(4, commit=False)  # 10-13 aborted, marker 14
    partition.write(2)  # 15-16, marker 17
    row = partition.group_row()
    assert (row.position, row.end) == (5, 18)
    assert row.lag == partition.still_to_read(5) == 5
    assert partition.projection_row(0).lag == partition.still_to_read(0) == 10
    partition.write(3, commit=False)  # aborted at the end: nothing more to read
    assert partition.group_row().lag == partition.still_to_read(5) == 5


def test_a_backlog_longer_than_the_window_read_counts_offsets_below_it(partition: Partition0) -> None:
    for _ in range(3):
        partition.write(PEEK // 2)  # three transactions: offsets 0 .. 3 * (PEEK // 2 + 1) - 1
    partition.write(1, commit=False)  # an aborted record and its marker at the end
    end = 3 * (PEEK // 2 + 1) + 2
    assert partition.projection_row(0).end == end
    records = partition.still_to_read(0)
    assert records == 3 * (PEEK // 2)
    # Exact in the last PEEK offsets below the end; below them, one per offset (one commit marker there).
    assert partition.projection_row(0).lag == records + 1
