"""Replay: read a topic's partitions from an offset up to where the log ends now.

Reads without a consumer group (no offsets are committed, nobody's assignment changes) and with
read_committed, so aborted transactions are never replayed. "Where the log ends" is the end each
partition had when the replay started: events appended meanwhile belong to the next replay.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition

from eventstore.kafka_config import consume_available
from eventstore.runtime import Record
from schemas.codec import Codec, default_codec
from schemas.errors import DecodeError


@dataclass
class ReplayStats:
    records: int = 0
    undecodable: int = 0
    end_offsets: dict[int, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.end_offsets.values())


class ReplayReader:
    """Iterate a topic's records in order per partition, up to the end offsets seen at start."""

    def __init__(self, bootstrap: str, topic: str, *, partitions: list[int] | None = None,
                 start_offsets: dict[int, int] | None = None, codec: Codec | None = None,
                 batch_size: int = 1000) -> None:
        self.topic = topic
        self.codec = codec or default_codec()
        self.batch_size = batch_size
        self.stats = ReplayStats()
        self._consumer = Consumer({
            "bootstrap.servers": bootstrap,
            "group.id": f"stepstream-replay-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            "isolation.level": "read_committed",
            "fetch.max.bytes": 52428800,
        })
        metadata = self._consumer.list_topics(topic, timeout=30).topics[topic]
        if metadata.error is not None:
            raise ValueError(f"cannot replay {topic}: {metadata.error}")
        chosen = sorted(metadata.partitions) if partitions is None else partitions
        starts = start_offsets or {}
        self._assignment = [TopicPartition(topic, p, starts.get(p, OFFSET_BEGINNING)) for p in chosen]
        for p in chosen:
            _low, high = self._consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30)
            self.stats.end_offsets[p] = high

    def raw(self) -> Iterator[tuple[int, int, bytes | None, bytes | None]]:
        """(partition, offset, key, value) without decoding, for tools that copy or inspect bytes."""
        pending = {tp.partition for tp in self._assignment if self.stats.end_offsets[tp.partition] > 0}
        if not pending:
            self._consumer.close()
            return
        self._consumer.assign(self._assignment)
        try:
            while pending:
                for msg in consume_available(self._consumer, self.batch_size, 1.0):
                    partition = msg.partition()
                    if msg.error() is not None:
                        if msg.error().code() == KafkaError._PARTITION_EOF:
                            pending.discard(partition)
                            continue
                        raise RuntimeError(f"replay of {self.topic}[{partition}] failed: {msg.error()}")
                    if partition not in pending:
                        continue
                    offset = msg.offset()
                    if offset >= self.stats.end_offsets[partition]:
                        pending.discard(partition)
                        continue
                    yield partition, offset, msg.key(), msg.value()
                    if offset + 1 >= self.stats.end_offsets[partition]:
                        pending.discard(partition)
        finally:
            self._consumer.close()

    def __iter__(self) -> Iterator[Record]:
        for partition, offset, key, value in self.raw():
            try:
                message = self.codec.decode(value)
            except DecodeError:
                self.stats.undecodable += 1
                continue
            self.stats.records += 1
            yield Record(self.topic, partition, offset, key.decode() if key else None, message, [])
