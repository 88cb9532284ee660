"""Replay: read a topic's partitions from an offset up to where the log ends now.

Reads without a consumer group (no offsets are committed, nobody's assignment changes) and with
read_committed, so aborted transactions are never replayed. "Where the log ends" is the end each
partition had when the replay started: events appended meanwhile belong to the next replay.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka import Message as KafkaMessage

from eventstore.errors import LogReadError
from eventstore.kafka_config import connection_config, consume_available
from eventstore.merge import OrderKey, PartitionMerge
from eventstore.runtime import Record
from eventstore.topics import reader_group
from schemas.codec import Codec, default_codec
from schemas.errors import DecodeError

BUFFERED_PER_PARTITION = 5000
"""Records a partition may have waiting in a merged read (``LogRange``) before its fetching pauses."""

LEADERSHIP_MOVING = frozenset({
    KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE, KafkaError.FENCED_LEADER_EPOCH,
    KafkaError.UNKNOWN_LEADER_EPOCH, KafkaError.REPLICA_NOT_AVAILABLE, KafkaError._TRANSPORT,
    KafkaError._DESTROY_BROKER,
})
"""Errors a watermark query gets while a partition's leadership moves (a broker lost or back, a preferred
leader elected): librdkafka refreshes its metadata, and the same query asked again reaches the new leader.
``_DESTROY_BROKER``: a query that was on its way to a broker gone from the metadata (a SIGKILLed node once the
controller fenced it), whose handle librdkafka dropped."""


def watermarks(consumer: Any, tp: TopicPartition, timeout_s: float = 30.0) -> tuple[int, int]:
    """(low, high) watermarks of a partition, asked again while its leadership moves, up to ``timeout_s``.

    librdkafka answers a query that reached a former leader with NOT_LEADER_FOR_PARTITION at once rather than
    retrying it: on a three-broker cluster, after a SIGKILLed broker came back and took its partitions back,
    ``projections verify`` failed on that alone (exit 69).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            low, high = consumer.get_watermark_offsets(tp, timeout=max(0.1, deadline - time.monotonic()))
            return int(low), int(high)
        except KafkaException as exc:
            if exc.args[0].code() not in LEADERSHIP_MOVING or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


@dataclass
class ReplayStats:
    records: int = 0
    undecodable: int = 0
    end_offsets: dict[int, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.end_offsets.values())


class LogRange:
    """A topic's partitions from start offsets up to end offsets (exclusive), raw, headers included, several
    partitions merged by timestamp.

    No consumer group (nothing committed, nobody's assignment changes) and read_committed, so aborted
    transactions never show. ``partitions`` defaults to all; a partition's start to its low watermark
    and its end to its high watermark seen when the range is made (records appended meanwhile belong to
    the next read). ``committed_only=False`` reads past open transactions too (read_uncommitted): for a
    reader of records written without a transaction, behind a transaction of its own that is still open.
    """

    def __init__(self, bootstrap: str, topic: str, *, partitions: Iterable[int] | None = None,
                 starts: Mapping[int, int] | None = None, ends: Mapping[int, int] | None = None,
                 batch_size: int = 1000, committed_only: bool = True) -> None:
        self.topic = topic
        self.batch_size = batch_size
        self._consumer = Consumer({
            **connection_config(bootstrap),
            "group.id": reader_group("range"),
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            "isolation.level": "read_committed" if committed_only else "read_uncommitted",
            "fetch.max.bytes": 52428800,
            # Once 100,000 records of a partition wait in the local queue, librdkafka postpones the next
            # fetch by this long (default 1 s): a fast reader (``dlq list``) would stall on it.
            "fetch.queue.backoff.ms": 10,
        })
        metadata = self._consumer.list_topics(topic, timeout=30).topics[topic]
        if metadata.error is not None:
            self._consumer.close()
            raise LogReadError(f"cannot read {topic}: {metadata.error}")
        existing = sorted(metadata.partitions)
        self.partitions = existing if partitions is None else sorted(partitions)
        unknown = set(self.partitions) - set(existing)
        if unknown:
            self._consumer.close()
            raise LogReadError(f"{topic} has partitions {existing[0]}-{existing[-1]}, not {sorted(unknown)}")
        self.watermarks: dict[int, tuple[int, int]] = {}
        self.starts: dict[int, int] = {}
        self.ends: dict[int, int] = {}
        for p in self.partitions:
            low, high = watermarks(self._consumer, TopicPartition(topic, p))
            self.watermarks[p] = (low, high)
            self.starts[p] = max(low, (starts or {}).get(p, low))
            self.ends[p] = min(high, (ends or {}).get(p, high))

    @property
    def total(self) -> int:
        """Offsets in the range (an upper bound of its records: transaction markers take offsets too)."""
        return sum(max(0, self.ends[p] - self.starts[p]) for p in self.partitions)

    def close(self) -> None:
        self._consumer.close()

    def __iter__(self) -> Iterator[KafkaMessage]:
        """In offset order per partition; several partitions merged by timestamp (``eventstore.merge``), so
        every read of the range hands the records out in the same order."""
        pending = {p for p in self.partitions if self.ends[p] > self.starts[p]}
        if not pending:
            self._consumer.close()
            return
        self._consumer.assign([TopicPartition(self.topic, p, self.starts[p]) for p in sorted(pending)])
        merge = PartitionMerge(pending, _order) if len(pending) > 1 else None
        paused: set[int] = set()

        def ended(partition: int) -> None:
            pending.discard(partition)
            if merge is not None:
                merge.finish(partition)

        try:
            while pending:
                for msg in consume_available(self._consumer, self.batch_size, 1.0):
                    partition = msg.partition()
                    if msg.error() is not None:
                        if msg.error().code() == KafkaError._PARTITION_EOF:
                            ended(partition)
                            continue
                        raise LogReadError(f"reading {self.topic}[{partition}] failed: {msg.error()}")
                    if partition not in pending:
                        continue
                    if msg.offset() >= self.ends[partition]:
                        ended(partition)
                        continue
                    if merge is None:
                        yield msg
                    else:
                        merge.add(partition, msg)
                    if msg.offset() + 1 >= self.ends[partition]:
                        ended(partition)
                if merge is not None:  # once every partition ended, this hands out all that is left
                    yield from merge.ready()
                    self._throttle(merge, pending, paused)
        finally:
            self._consumer.close()

    def _throttle(self, merge: PartitionMerge[KafkaMessage], pending: set[int], paused: set[int]) -> None:
        """Pauses fetching a partition while it has many records buffered waiting for another's, so a
        partition whose records are all later than another's is not held in memory whole."""
        limit = max(BUFFERED_PER_PARTITION, 2 * self.batch_size)
        over = {p for p in pending if merge.buffered(p) >= limit} - paused
        under = {p for p in paused if p not in pending or merge.buffered(p) < limit // 2}
        if over:
            self._consumer.pause([TopicPartition(self.topic, p) for p in sorted(over)])
        if under:
            self._consumer.resume([TopicPartition(self.topic, p) for p in sorted(under)])
        paused |= over
        paused -= under


def _order(msg: KafkaMessage) -> OrderKey:
    return msg.timestamp()[1], msg.partition(), msg.offset()


class ReplayReader:
    """Decoded records of a topic in order per partition, up to the end offsets seen at start."""

    def __init__(self, bootstrap: str, topic: str, *, partitions: list[int] | None = None,
                 start_offsets: dict[int, int] | None = None, codec: Codec | None = None,
                 batch_size: int = 1000) -> None:
        self.topic = topic
        self.codec = codec or default_codec()
        self._range = LogRange(bootstrap, topic, partitions=partitions, starts=start_offsets, batch_size=batch_size)
        self.stats = ReplayStats(end_offsets=dict(self._range.ends))

    def raw(self) -> Iterator[tuple[int, int, bytes | None, bytes | None]]:
        """(partition, offset, key, value) without decoding, for tools that copy or inspect bytes."""
        for msg in self._range:
            yield msg.partition(), msg.offset(), msg.key(), msg.value()

    def __iter__(self) -> Iterator[Record]:
        for partition, offset, key, value in self.raw():
            try:
                message = self.codec.decode(value)
            except DecodeError:
                self.stats.undecodable += 1
                continue
            self.stats.records += 1
            yield Record(self.topic, partition, offset, key.decode() if key else None, message, [])


def offsets_at(bootstrap: str, topic: str, when: datetime) -> dict[int, int]:
    """Per partition, the first offset whose record is at or after ``when`` (the end offset if none)."""
    consumer = Consumer({**connection_config(bootstrap), "group.id": reader_group("times")})
    try:
        metadata = consumer.list_topics(topic, timeout=30).topics[topic]
        if metadata.error is not None:
            raise LogReadError(f"cannot read {topic}: {metadata.error}")
        stamp = int(when.timestamp() * 1000)
        found = consumer.offsets_for_times([TopicPartition(topic, p, stamp) for p in sorted(metadata.partitions)],
                                           timeout=30)
        out = {}
        for tp in found:
            _low, high = watermarks(consumer, TopicPartition(topic, tp.partition))
            out[tp.partition] = tp.offset if tp.offset >= 0 else high
        return out
    finally:
        consumer.close()
