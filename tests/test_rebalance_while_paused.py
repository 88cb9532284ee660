"""A consumer whose partitions were paused when the group took them away fetches them again once they come back.

librdkafka keeps a partition's pause across its revocation and a new assignment to the same consumer. The
keyed runtime pauses its partitions under back-pressure and the ordered one during a retry's wait; an agent
whose partitions were revoked then and assigned back fetched nothing more, its requests never answered.
"""

from __future__ import annotations

import pytest
from confluent_kafka import Consumer

from eventstore.kafka_config import connection_config
from eventstore.keyed import KeyedConsumerRuntime
from eventstore.producer import EventProducer
from eventstore.runtime import ConsumerRuntime, Record
from eventstore.topics import TopicLayout
from schemas.messages import OperatorAlert
from tests.kafka_helpers import wait_for
from tests.runtime_harness import running

pytestmark = pytest.mark.kafka


def _send(producer: EventProducer, topic: str, tag: str, count: int) -> None:
    for i in range(count):
        producer.send(topic, OperatorAlert(task_id=f"{tag}-{i}", sequence=1, workflow="w", workflow_version=1,
                                           causation_id="c", reason="a record"))
    producer.flush()


@pytest.mark.parametrize("kind", [ConsumerRuntime, KeyedConsumerRuntime], ids=["ordered", "keyed"])
def test_partitions_revoked_while_paused_are_fetched_again_once_assigned_back(
    bootstrap: str, layout: TopicLayout, kind: type[ConsumerRuntime],
) -> None:
    handled: list[str] = []
    producer = EventProducer(bootstrap)
    extra = {"concurrency": 4} if kind is KeyedConsumerRuntime else {}

    def handle(record: Record, _output: EventProducer) -> None:
        handled.append(record.message.task_id)

    with running(bootstrap, layout, layout.inbox, handle, kind=kind, **extra) as runtime:
        _send(producer, layout.inbox, "before", 9)
        assert wait_for(lambda: len(handled) == 9, timeout_s=30)
        runtime._consumer.pause(runtime._consumer.assignment())  # as back-pressure or a retry's wait leaves them
        # Another member joins (every partition is revoked, some assigned back), then leaves (all come back).
        other = Consumer({**connection_config(bootstrap), "group.id": runtime.group_id, "enable.auto.commit": False})
        other.subscribe([layout.inbox])

        def joined() -> bool:
            other.consume(1, 0.2)  # serves the rebalance
            return bool(other.assignment())

        try:
            assert wait_for(joined, timeout_s=30)
        finally:
            other.close()
        _send(producer, layout.inbox, "after", 9)
        assert wait_for(lambda: len(handled) == 18, timeout_s=30), f"handled after the rebalances: {handled[9:]}"
    assert sorted(handled[9:]) == sorted(f"after-{i}" for i in range(9))
