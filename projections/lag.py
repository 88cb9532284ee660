"""Consumer lag as the broker sees it, for dashboards and metrics.

Two kinds, per topic and partition, both measured against the last stable offset (read_committed
consumers never read past it, so lag to the high watermark would count open transactions as lag):

* every consumer group of the deployment (its name starts with the topic prefix): its committed offset;
* the projection store: the offsets stored with its rows, which is what the projector resumes from.

Lag counts offsets, and a transaction's commit marker takes an offset that no consumer ever gets, so a
consumer that has read everything of a transactionally written partition (``events``, and dead letters
of the scheduler) can show a lag of 1 there until the next record comes.

Each reading asks the broker a few questions, so readings are cached for a short while: a dashboard
refreshing every few seconds and a Prometheus scrape share them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from confluent_kafka import ConsumerGroupTopicPartitions, IsolationLevel, TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec

from eventstore.kafka_config import connection_config

PROJECTION = "projection store"  # the "group" of the store's own offsets


@dataclass(frozen=True)
class PartitionLag:
    group: str
    topic: str
    partition: int
    position: int  # the next offset the group (or the store) will read
    end: int  # the last stable offset
    lag: int

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


class LagReader:
    def __init__(self, bootstrap: str, prefix: str, *, cache_s: float = 2.0, timeout_s: float = 10.0) -> None:
        self.prefix = prefix
        self.cache_s = cache_s
        self.timeout_s = timeout_s
        self._admin = AdminClient(connection_config(bootstrap))
        self._lock = threading.Lock()
        self._cached: tuple[float, list[PartitionLag]] | None = None

    def groups(self) -> list[PartitionLag]:
        """Every consumer group of the deployment that committed offsets, per partition it consumes."""
        with self._lock:
            if self._cached is not None and time.monotonic() - self._cached[0] < self.cache_s:
                return self._cached[1]
            listing = self._admin.list_consumer_groups(request_timeout=self.timeout_s).result(self.timeout_s)
            committed: dict[tuple[str, str, int], int] = {}
            for group in sorted(g.group_id for g in listing.valid if g.group_id.startswith(self.prefix)):
                future = self._admin.list_consumer_group_offsets([ConsumerGroupTopicPartitions(group)],
                                                                 request_timeout=self.timeout_s)[group]
                for tp in future.result(self.timeout_s).topic_partitions or []:
                    if tp.offset >= 0:
                        committed[(group, tp.topic, tp.partition)] = tp.offset
            ends = self.ends((t, p) for _g, t, p in committed)
            rows = [PartitionLag(g, t, p, o, ends[(t, p)], max(0, ends[(t, p)] - o))
                    for (g, t, p), o in sorted(committed.items()) if (t, p) in ends]
            self._cached = (time.monotonic(), rows)
            return rows

    def projection(self, stored: Mapping[str, Mapping[int, int]]) -> list[PartitionLag]:
        """The store's offsets (topic -> partition -> next offset) against every partition of those topics."""
        metadata = self._admin.list_topics(timeout=self.timeout_s).topics
        wanted = [(t, p) for t in stored if t in metadata for p in sorted(metadata[t].partitions)]
        ends = self.ends(wanted)
        return [PartitionLag(PROJECTION, t, p, stored[t].get(p, 0), ends[(t, p)],
                             max(0, ends[(t, p)] - stored[t].get(p, 0))) for t, p in wanted if (t, p) in ends]

    def ends(self, partitions: Iterable[tuple[str, int]]) -> dict[tuple[str, int], int]:
        """The last stable offset of each partition."""
        request = {TopicPartition(t, p): OffsetSpec.latest() for t, p in set(partitions)}
        if not request:
            return {}
        futures = self._admin.list_offsets(request, isolation_level=IsolationLevel.READ_COMMITTED,
                                           request_timeout=self.timeout_s)
        return {(tp.topic, tp.partition): future.result(self.timeout_s).offset for tp, future in futures.items()}
