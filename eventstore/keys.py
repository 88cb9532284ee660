"""The ``keys`` topic read into memory: each task's wrapped data key, or the fact that it was erased.

A record's key is the task id, its value the data key wrapped by a master key (``kid:base64``, UTF-8); a
tombstone (no value) is an erased key. The scheduler writes both, in the transaction of the events that
call for them, so an agent that reads a request (read_committed) finds its task's key on this topic:
a task it has not seen yet makes it read on to the topic's end.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from eventstore.replay import LogRange


class DataKeys:
    """Wrapped data keys by task id, followed from the topic as far as a lookup needed."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self.bootstrap = bootstrap
        self.topic = topic
        self._wrapped: dict[str, str | None] = {}
        self._next: dict[int, int] = {}
        self._lock = threading.Lock()

    def wrapped(self, task_id: str) -> str | None:
        """The task's wrapped data key; None when it was erased or never written."""
        with self._lock:
            if task_id not in self._wrapped:
                self._wrapped.update(read_keys(self.bootstrap, self.topic, self._next))
            return self._wrapped.get(task_id)


def read_keys(bootstrap: str, topic: str, starts: dict[int, int], partitions: Iterable[int] | None = None
              ) -> dict[str, str | None]:
    """The keys written from ``starts`` (per partition; advanced in place) to the topic's end: the last
    record of each task, None for a tombstone."""
    found: dict[str, str | None] = {}
    for msg in LogRange(bootstrap, topic, partitions=partitions, starts=starts):
        key, value = msg.key(), msg.value()
        starts[msg.partition()] = msg.offset() + 1
        if key is not None:
            found[key.decode()] = None if value is None else value.decode()
    return found
