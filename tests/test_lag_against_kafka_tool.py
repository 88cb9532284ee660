"""The lag the operator's kit alerts on, checked against Kafka's own ``kafka-consumer-groups`` tool.

``stepstream_group_lag`` and ``/api/lag`` read each group's committed offset, as the tool does, so a stopped
or restoring consumer's backlog is visible the whole time. They differ from the tool in one documented way:
the tool counts offsets up to the high watermark, and on a topic written in transactions every commit marker
takes an offset that no consumer ever reads; the kit counts the records a read_committed consumer would
still get. So on a plain topic the two agree exactly, and on a transactional topic they differ by exactly
the number of commit markers still ahead of the group.
"""

from __future__ import annotations

import pathlib
import uuid

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from eventstore.broker import run_kafka_tool
from eventstore.kafka_config import connection_config
from eventstore.topics import TopicLayout
from projections.lag import LagReader
from projections.store import SqliteStore
from stepstream.http.metrics import DashboardCollector

pytestmark = pytest.mark.kafka

GROUP_COMMAND = "org.apache.kafka.tools.consumer.group.ConsumerGroupCommand"
BACKLOG = 5_000
TRANSACTIONS_PER_PARTITION, RECORDS_PER_TRANSACTION, TRANSACTIONS_READ = 10, 20, 2


def tool_lag(bootstrap: str, group: str) -> dict[tuple[str, int], int]:
    """(topic, partition) -> LAG, as ``kafka-consumer-groups --describe`` prints it."""
    out = run_kafka_tool(GROUP_COMMAND, "--bootstrap-server", bootstrap, "--describe", "--group", group)
    rows = {}
    for line in out.splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[0] == group and fields[2].isdigit():
            rows[(fields[1], int(fields[2]))] = int(fields[5])
    return rows


def commit(bootstrap: str, group: str, offsets: list[TopicPartition]) -> None:
    """Commit offsets for a group as a consumer that read that far and stopped would have."""
    consumer = Consumer({**connection_config(bootstrap), "group.id": group, "enable.auto.commit": False})
    try:
        consumer.commit(offsets=offsets, asynchronous=False)
    finally:
        consumer.close()


def test_group_lag_of_a_stopped_consumer_equals_the_kafka_tool_on_a_plain_topic(
    bootstrap: str, layout: TopicLayout,
) -> None:
    producer = Producer({**connection_config(bootstrap), "enable.idempotence": True, "linger.ms": 5})
    for i in range(BACKLOG + 600):
        producer.produce(layout.inbox, key=f"task-{i}", value=b"submission")
    assert producer.flush(30) == 0
    group = layout.scheduler_group
    commit(bootstrap, group, [TopicPartition(layout.inbox, p, 200) for p in range(3)])

    expected = tool_lag(bootstrap, group)
    assert sum(expected.values()) == BACKLOG
    ours = {(r.topic, r.partition): r.lag for r in LagReader(bootstrap, layout.prefix).groups() if r.group == group}
    assert ours == expected


def test_group_lag_on_a_transactional_topic_is_the_kafka_tool_less_the_commit_markers_ahead(
    bootstrap: str, layout: TopicLayout, tmp_path: pathlib.Path,
) -> None:
    producer = Producer({**connection_config(bootstrap), "transactional.id": f"lag-{uuid.uuid4().hex}"})
    producer.init_transactions(30)
    for partition in range(3):
        for _ in range(TRANSACTIONS_PER_PARTITION):
            producer.begin_transaction()
            for _ in range(RECORDS_PER_TRANSACTION):
                producer.produce(layout.events, key=f"p{partition}", value=b"event", partition=partition)
            producer.commit_transaction(30)
    group = layout.projector_group
    read = TRANSACTIONS_READ * (RECORDS_PER_TRANSACTION + 1)  # each transaction: its records and a marker
    commit(bootstrap, group, [TopicPartition(layout.events, p, read) for p in range(3)])

    markers_ahead = TRANSACTIONS_PER_PARTITION - TRANSACTIONS_READ
    expected = {tp: lag - markers_ahead for tp, lag in tool_lag(bootstrap, group).items()}
    assert set(expected.values()) == {markers_ahead * RECORDS_PER_TRANSACTION}
    reader = LagReader(bootstrap, layout.prefix)
    assert {(r.topic, r.partition): r.lag for r in reader.groups() if r.group == group} == expected

    store = SqliteStore(tmp_path / "store.db")
    try:
        collector = DashboardCollector(store, reader, [layout.events])
        gauge = next(m for m in collector.collect() if m.name == "stepstream_group_lag")
        exported = {(s.labels["topic"], int(s.labels["partition"])): s.value
                    for s in gauge.samples if s.labels["group"] == group}
        assert exported == expected
    finally:
        store.close()
