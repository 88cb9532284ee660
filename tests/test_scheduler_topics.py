"""A scheduler makes every agent topic its workflows name before it takes a command: a topic first made in the
middle of a batch once lost that batch's requests (their events committed, the requests never on the topic)."""

from __future__ import annotations

import pytest
from confluent_kafka.admin import AdminClient

from eventstore.settings import ConsumerSettings, KafkaSettings
from eventstore.topics import TopicLayout
from scheduler.decider import Limits
from scheduler.service import build_scheduler
from schemas.sealed import Keyring
from tests.test_compensation_end_to_end import KEY
from tests.workflows import COMPENSATION_REGISTRY

pytestmark = pytest.mark.kafka


def test_every_agent_topic_of_the_registry_exists_before_the_scheduler_takes_a_command(
    bootstrap: str, layout: TopicLayout,
) -> None:
    agents = {layout.agent(name) for name in COMPENSATION_REGISTRY.agents}
    admin = AdminClient({"bootstrap.servers": bootstrap})
    assert not agents & set(admin.list_topics(timeout=10).topics), "none of them exists yet"
    kafka = KafkaSettings(bootstrap_servers=bootstrap, topic_prefix=layout.prefix, partitions=layout.partitions)
    build_scheduler(kafka, ConsumerSettings(), COMPENSATION_REGISTRY, Limits(), keyring=Keyring.parse(f"k1:{KEY}"))
    topics = admin.list_topics(timeout=10).topics
    assert agents <= set(topics)
    assert {len(topics[name].partitions) for name in agents} == {layout.partitions}
