"""The records of several partitions in one order that depends on the log alone: merged by timestamp.

Kafka orders records within a partition only. A reader assigned several partitions gets them interleaved as
its fetches happen to arrive, so two replays of one log applied a key whose records span partitions (a topic
whose partitions were added to, a producer keyed otherwise) in different orders and could give different
stores: a second admission refused in one replay was the admission in the other. Merging the partitions'
sequences by (timestamp, partition, offset), as ``heapq.merge`` would, makes a replay a function of the log,
and follows the order the records were written in, which is what the live projector mostly saw.

A record is handed out only while every partition that may still deliver has one buffered: the next record
of an empty partition could come first.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from heapq import heappop, heappush
from typing import Generic, TypeVar

T = TypeVar("T")

OrderKey = tuple[int, int, int]
"""(timestamp ms, partition, offset): unique per record, so no two heads ever tie."""


class PartitionMerge(Generic[T]):
    """Buffers each partition's records as they arrive; ``ready`` yields those whose place is settled."""

    def __init__(self, partitions: Iterable[int], key: Callable[[T], OrderKey]) -> None:
        self._key = key
        self._buffers: dict[int, deque[T]] = {p: deque() for p in partitions}
        self._open = set(self._buffers)  # may still deliver records
        self._starving = set(self._buffers)  # open, nothing buffered: nothing can be handed out
        self._heads: list[tuple[OrderKey, int]] = []  # (key, partition) of each non-empty buffer's first record

    def add(self, partition: int, item: T) -> None:
        """The partition's next record, in offset order."""
        buffer = self._buffers[partition]
        if not buffer:
            heappush(self._heads, (self._key(item), partition))
            self._starving.discard(partition)
        buffer.append(item)

    def finish(self, partition: int) -> None:
        """The partition delivers nothing more: what it has buffered no longer waits for it."""
        self._open.discard(partition)
        self._starving.discard(partition)

    def buffered(self, partition: int) -> int:
        return len(self._buffers[partition])

    def ready(self) -> Iterator[T]:
        """The records whose place is settled, in order; add nothing until it is exhausted."""
        while self._heads and not self._starving:
            _key, partition = heappop(self._heads)
            buffer = self._buffers[partition]
            item = buffer.popleft()
            if buffer:
                heappush(self._heads, (self._key(buffer[0]), partition))
            elif partition in self._open:
                self._starving.add(partition)
            yield item
