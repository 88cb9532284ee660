"""A three-broker KRaft cluster from the project's own jars: replicated topics, a broker SIGKILLed while
records are written, nothing acknowledged lost or doubled, writes going on, and the broker back; a reader of
``keys`` that goes on reading after its partition's leader was SIGKILLed. One cluster serves the module; each
test brings back the broker it killed."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator

import pytest
from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer
from confluent_kafka.admin import AdminClient, ConfigResource

from eventstore.cluster import LocalCluster
from eventstore.kafka_config import producer_config
from eventstore.keys import KeyFollower
from eventstore.topics import TopicSpec, ensure_topics
from tests.kafka_helpers import wait_for

pytestmark = pytest.mark.kafka


def produce(bootstrap: str, topic: str, values: range) -> list[KafkaError]:
    """Send ``values`` with the product's producer settings (idempotent, acks=all); the delivery errors."""
    errors: list[KafkaError] = []

    def delivered(error: KafkaError | None, _message: Message) -> None:
        if error is not None:
            errors.append(error)

    producer = Producer({**producer_config(bootstrap), "delivery.report.only.error": False})
    for value in values:
        producer.produce(topic, key=str(value % 17), value=str(value), on_delivery=delivered)
        producer.poll(0)
    assert producer.flush(60) == 0, "every record acknowledged within a minute"
    return errors


def read_all(bootstrap: str, topic: str, expected: int) -> Counter[str]:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "cluster-reader", "auto.offset.reset": "earliest",
                         "enable.auto.commit": False, "isolation.level": "read_committed"})
    consumer.subscribe([topic])
    seen: Counter[str] = Counter()
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            message = consumer.poll(0.5)
            if message is not None and message.error() is None:
                seen[(message.value() or b"").decode()] += 1
            if sum(seen.values()) >= expected:
                break
    finally:
        consumer.close()
    return seen


def topic_config(admin: AdminClient, topic: str) -> dict[str, str] | None:
    """The topic's configuration, or None while the broker asked has not learnt of the topic yet."""
    (future,) = admin.describe_configs([ConfigResource("topic", topic)]).values()
    try:
        return {name: entry.value for name, entry in future.result(timeout=30).items()}
    except KafkaException:
        return None


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    cluster = LocalCluster(tmp_path_factory.mktemp("cluster"), nodes=3)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


def test_a_sigkilled_broker_of_three_loses_no_acknowledged_record_and_writes_go_on(cluster: LocalCluster) -> None:
    bootstrap = cluster.bootstrap_servers
    admin = AdminClient({"bootstrap.servers": bootstrap})
    ensure_topics(admin, [TopicSpec("orders", 3)], replication_factor=3)
    partitions = admin.list_topics("orders", timeout=30).topics["orders"].partitions
    assert all(len(p.replicas) == 3 for p in partitions.values()), "three copies of every partition"
    assert wait_for(lambda: topic_config(admin, "orders") is not None, timeout_s=30), \
        "every broker learns of the new topic"
    assert (topic_config(admin, "orders") or {})["min.insync.replicas"] == "2"

    assert produce(bootstrap, "orders", range(0, 300)) == []
    cluster.node(2).kill()
    assert produce(bootstrap, "orders", range(300, 600)) == [], "two of three in sync: writes go on"

    seen = read_all(bootstrap, "orders", 600)
    assert set(seen) == {str(v) for v in range(600)} and set(seen.values()) == {1}, "each record once"

    cluster.node(2).start()
    assert len(admin.list_topics(timeout=30).brokers) == 3, "the killed broker is back in the cluster"


def test_a_keys_reader_reads_on_after_its_partitions_leader_is_sigkilled(cluster: LocalCluster) -> None:
    """An agent's data keys and a scheduler's proposals are read by a long-lived follower; where partitions end
    was asked of the leader it learnt when it started, and after that broker's SIGKILL every question timed
    out (30 s an agent request, for good)."""
    bootstrap = cluster.bootstrap_servers
    admin = AdminClient({"bootstrap.servers": bootstrap})
    ensure_topics(admin, [TopicSpec("keys", 2)], replication_factor=3)
    producer = Producer(producer_config(bootstrap))
    producer.produce("keys", key=b"task-1", value=b"key-1", partition=0)
    assert producer.flush(30) == 0
    follower = KeyFollower(bootstrap, "keys", None, committed_only=True)
    try:
        assert [m.key() for m in follower.read_on(None, lambda: False)] == [b"task-1"]
        leader = admin.list_topics("keys", timeout=30).topics["keys"].partitions[0].leader
        cluster.node(leader).kill()
        try:
            producer.produce("keys", key=b"task-2", value=b"key-2", partition=0)
            assert producer.flush(30) == 0, "two of three in sync: the new record is acknowledged"
            assert [m.key() for m in follower.read_on(None, lambda: False)] == [b"task-2"]
        finally:
            cluster.node(leader).start()
    finally:
        follower.close()
