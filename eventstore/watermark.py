"""The offset a partition may commit when its messages finish out of order.

With many messages of one partition in flight at once (different keys run concurrently), a later
message often finishes before an earlier one. Committing the later one's offset would tell Kafka the
earlier one is done too, and a crash would lose it. So a partition commits only up to its first
unfinished message: the watermark. A crash then redoes the unfinished message and those after it that
did finish, which at-least-once (and idempotent handlers) already accept.
"""

from __future__ import annotations

from collections import deque


class Watermark:
    """The offsets of one partition taken for work, in offset order, and which of them finished.

    Not thread-safe: its owner guards it. Offsets must be taken in increasing order (as a consumer
    reads them); gaps (transaction markers, compacted records) are fine.
    """

    def __init__(self) -> None:
        self._taken: deque[int] = deque()
        self._finished: set[int] = set()
        self._next: int | None = None

    def take(self, offset: int) -> None:
        """Work on ``offset`` starts (or waits its turn behind its key)."""
        if self._next is not None and offset < self._next:
            raise ValueError(f"offset {offset} taken after {self._next - 1}: offsets must increase")
        self._taken.append(offset)
        self._next = offset + 1

    def finish(self, offset: int) -> None:
        """The work on ``offset`` is done (its output sent, or the message dead-lettered)."""
        self._finished.add(offset)
        while self._taken and self._taken[0] in self._finished:
            self._finished.discard(self._taken.popleft())

    @property
    def pending(self) -> int:
        """Offsets taken and not yet finished."""
        return len(self._taken) - len(self._finished)

    def committable(self) -> int | None:
        """The offset to commit: the first unfinished one, else one past the last taken (None: nothing taken)."""
        return self._taken[0] if self._taken else self._next
