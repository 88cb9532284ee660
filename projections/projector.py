"""``stepstream run projector``: keeps the state store in step with ``events``.

It resumes from the offsets stored in the database (not the consumer group's), because those are
committed in the same transaction as the rows: the store is a deterministic function of the log.
"""

from __future__ import annotations

import threading

from confluent_kafka import OFFSET_BEGINNING, TopicPartition

from eventstore.errors import PoisonMessageError
from eventstore.producer import EventProducer
from eventstore.runtime import ConsumerRuntime, Record
from eventstore.settings import ConsumerSettings, KafkaSettings
from eventstore.topics import TopicLayout
from projections.store import SqliteStore
from schemas.messages import Event


class Projector:
    def __init__(self, store: SqliteStore, events_topic: str) -> None:
        self.store = store
        self.events_topic = events_topic

    def handle(self, record: Record, _output: EventProducer) -> None:
        if not isinstance(record.message, Event):
            raise PoisonMessageError(f"{type(record.message).__name__} does not belong on {record.topic}")
        self.store.apply(record.topic, record.partition, record.offset, record.message)

    def seek_to_stored_offsets(self, partitions: list[TopicPartition]) -> list[TopicPartition]:
        """Called on assignment: start each partition where the database says, whatever the group says."""
        stored = self.store.offsets(self.events_topic)
        return [TopicPartition(tp.topic, tp.partition, stored.get(tp.partition, OFFSET_BEGINNING))
                for tp in partitions]


def build_projector(kafka: KafkaSettings, consumer: ConsumerSettings, store: SqliteStore,
                    stop_event: threading.Event | None = None) -> ConsumerRuntime:
    layout = TopicLayout.from_settings(kafka)
    projector = Projector(store, layout.events)
    return ConsumerRuntime(
        bootstrap=kafka.resolved_bootstrap(),
        group_id=f"{layout.prefix}projector",
        topics=[layout.events],
        handler=projector.handle,
        dlq_topic=layout.dlq,
        settings=consumer,
        on_assign=projector.seek_to_stored_offsets,
        stop_event=stop_event,
    )
