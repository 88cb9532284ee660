"""Consumer lag as the broker sees it, for dashboards and metrics: what a consumer still has to read.

Two kinds, per topic and partition:

* every consumer group of the deployment (its name starts with the topic prefix): its committed offset;
* the projection store: the offsets stored with its rows, which is what the projector resumes from.

``end`` is the last stable offset (read_committed consumers never read past it). Lag is not ``end`` minus
the position: a transaction's commit or abort marker takes an offset that no consumer ever gets, and so do
the records of an aborted transaction. A consumer that read everything of a partition written with
transactions (``events``, agent requests) sits one offset (the marker) below ``end``, and an alert on
"lag > 0" would fire forever. So lag is the number of records a read_committed consumer at the position
would still get, counted by reading the tail of the partition: the last ``PEEK`` offsets below ``end``,
and further back in growing windows only while they hold no record at all. It is exact whenever the
backlog fits in the window read (and always 0 when nothing is left to read); a longer backlog counts
the offsets below the window one each, markers included, as an estimate of what is already large.

Each reading asks the broker a few questions, so readings are cached for a short while: a dashboard
refreshing every few seconds and a Prometheus scrape share them.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from confluent_kafka import ConsumerGroupTopicPartitions, IsolationLevel, TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec

from eventstore.kafka_config import connection_config
from eventstore.replay import LogRange

PROJECTION = "projection store"  # the "group" of the store's own offsets
PEEK = 500  # offsets read first from a partition's end: a lag up to this is counted record by record


@dataclass(frozen=True)
class PartitionLag:
    group: str
    topic: str
    partition: int
    position: int  # the next offset the group (or the store) will read
    end: int  # the last stable offset
    lag: int  # records a read_committed consumer at position still gets (see the module doc)

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Tail:
    """The readable records (their offsets, ascending) of a partition from ``start`` to its end."""

    start: int
    records: list[int]

    def lag(self, position: int) -> int:
        """What a consumer at ``position`` still has to read: exact from ``start`` on; offsets below it (a
        backlog longer than the window read) count one each, commit markers among them included."""
        return max(0, self.start - position) + len(self.records) - bisect.bisect_left(self.records, position)


class LagReader:
    def __init__(self, bootstrap: str, prefix: str, *, cache_s: float = 2.0, timeout_s: float = 10.0) -> None:
        self.bootstrap = bootstrap
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
            rows = self._rows(committed)
            self._cached = (time.monotonic(), rows)
            return rows

    def projection(self, stored: Mapping[str, Mapping[int, int]]) -> list[PartitionLag]:
        """The store's offsets (topic -> partition -> next offset) against every partition of those topics."""
        metadata = self._admin.list_topics(timeout=self.timeout_s).topics
        return self._rows({(PROJECTION, t, p): stored[t].get(p, 0)
                           for t in stored if t in metadata for p in sorted(metadata[t].partitions)})

    def _rows(self, positions: Mapping[tuple[str, str, int], int]) -> list[PartitionLag]:
        """(group, topic, partition) -> position, as rows against the last stable offsets."""
        ends = self.ends((t, p) for _g, t, p in positions)
        floors: dict[tuple[str, int], int] = {}  # per partition, the lowest position still behind its end
        for (_g, t, p), o in positions.items():
            if (t, p) in ends and ends[(t, p)] > o:
                floors[(t, p)] = min(o, floors.get((t, p), o))
        tails = self.tails(floors, ends)
        return [PartitionLag(g, t, p, o, ends[(t, p)], tails[(t, p)].lag(o) if (t, p) in tails else 0)
                for (g, t, p), o in sorted(positions.items()) if (t, p) in ends]

    def tails(self, floors: Mapping[tuple[str, int], int],
              ends: Mapping[tuple[str, int], int]) -> dict[tuple[str, int], Tail]:
        """Per (topic, partition), the records a read_committed consumer gets in the last window below its end
        that holds any (or, when none does, down to its floor). Windows grow fourfold from ``PEEK`` offsets, so
        an idle partition costs one small read."""
        found: dict[tuple[str, int], list[int]] = {}
        pending = {tp: (ends[tp], PEEK) for tp in floors}  # (topic, partition) -> (read below, window)
        starts: dict[tuple[str, int], int] = {}
        while pending:
            starts.update({tp: max(floors[tp], stop - window) for tp, (stop, window) in pending.items()})
            for topic in {t for t, _p in pending}:
                reading = LogRange(self.bootstrap, topic, partitions=[p for t, p in pending if t == topic],
                                   starts={p: starts[(t, p)] for t, p in pending if t == topic},
                                   ends={p: stop for (t, p), (stop, _w) in pending.items() if t == topic})
                for msg in reading:
                    found.setdefault((topic, msg.partition()), []).append(msg.offset())
            pending = {tp: (starts[tp], window * 4) for tp, (_stop, window) in pending.items()
                       if tp not in found and starts[tp] > floors[tp]}
        return {tp: Tail(start, found.get(tp, [])) for tp, start in starts.items()}

    def ends(self, partitions: Iterable[tuple[str, int]]) -> dict[tuple[str, int], int]:
        """The last stable offset of each partition."""
        request = {TopicPartition(t, p): OffsetSpec.latest() for t, p in set(partitions)}
        if not request:
            return {}
        futures = self._admin.list_offsets(request, isolation_level=IsolationLevel.READ_COMMITTED,
                                           request_timeout=self.timeout_s)
        return {(tp.topic, tp.partition): future.result(self.timeout_s).offset for tp, future in futures.items()}
