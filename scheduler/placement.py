"""Records found on a partition that does not own their task: where they belong, and a tally of them.

A scheduler owns the tasks whose id Kafka's murmur2 partitioner puts on its inbox partitions
(``eventstore.partitioning``): their events, state and data keys, and every reply, recovery and command the
system sends them, all keyed by task id. A producer with another partitioner (librdkafka's default,
``consistent_random``: crc32, also the default of the Go, .NET and Node clients built on it) puts a task's
submission elsewhere. Decided there, the task would start on one partition while everything else about it
went to the other. So the scheduler moves such a record, as it is, to the owning partition in its
transaction (exactly once) and decides nothing for it where it landed; and it looks for a submission's
proposed data key on every ``keys`` partition when it is not on the task's own.

Each is counted (a metric) and logged in aggregate now and then, not a line per record: a foreign producer
sends every one of its records astray, and the log should say so once, with how many, from where to where.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

import structlog
from prometheus_client import Counter

from eventstore.partitioning import partition_of

log = structlog.get_logger("stepstream.scheduler")

MISPLACED = Counter(
    "stepstream_scheduler_misplaced_records_total",
    "Records on a partition that does not own their task: inbox records moved to the owning partition, "
    "proposed data keys taken from another keys partition", ["topic"])

MOVED_FROM = "stepstream.moved.from"
"""The header a moved inbox record gets besides its own: where it first landed (``topic[partition]@offset``)."""


def owner_elsewhere(task_id: str, partition: int, partitions: int) -> int | None:
    """The partition that owns ``task_id`` when it is not ``partition``; None when the record is in place."""
    owner = partition_of(task_id, partitions)
    return None if owner == partition else owner


class MisplacedRecords:
    """What the open transaction found misplaced, counted once it commits and logged at most every ``every_s``.

    Used on the consumer loop's thread only (the handler and the runtime's commit and abort callbacks), so it
    needs no lock. An aborted batch's records come again and are counted then.
    """

    def __init__(self, every_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._every_s = every_s
        self._clock = clock
        self._batch: collections.Counter[tuple[str, int, int]] = collections.Counter()
        self._unlogged: collections.Counter[tuple[str, int, int]] = collections.Counter()
        self._logged_at: float | None = None

    def add(self, topic: str, found_on: int, owner: int) -> None:
        """A record of ``topic`` found on partition ``found_on`` belongs to ``owner``."""
        self._batch[(topic, found_on, owner)] += 1

    def committed(self) -> dict[str, int] | None:
        """Count the batch's records; the tally since the last report (``topic found->owner``: how many) when
        one is due, which is also logged, else None."""
        for (topic, _found_on, _owner), count in self._batch.items():
            MISPLACED.labels(topic).inc(count)
        self._unlogged.update(self._batch)
        self._batch.clear()
        now = self._clock()
        if not self._unlogged or (self._logged_at is not None and now - self._logged_at < self._every_s):
            return None
        report = {f"{topic} {found_on}->{owner}": count
                  for (topic, found_on, owner), count in sorted(self._unlogged.items())}
        log.warning("records on a partition that does not own their task: a producer does not use the murmur2 "
                    "partitioner; each was taken to its owning partition", records=sum(report.values()),
                    moved=report)
        self._unlogged.clear()
        self._logged_at = now
        return report

    def aborted(self) -> None:
        self._batch.clear()
