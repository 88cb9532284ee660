"""The offset a partition may commit when its messages finish out of order.

With many messages of one partition in flight at once (different keys run concurrently), a later
message often finishes before an earlier one. Committing the later one's offset would tell Kafka the
earlier one is done too, and a crash would lose it. So a partition commits only up to its first
unfinished message: the watermark. The offsets above it that did finish travel with the commit, in its
metadata (as the Parallel Consumer encodes them), so the partition's next owner skips them: a crash or a
drain redoes only what was not finished (plus what finished after the last commit).
"""

from __future__ import annotations

from collections import deque

#: Marks the format of the commit metadata, so that metadata written by something else is never misread.
_DONE_PREFIX = "stepstream.done1:"
#: Brokers refuse commit metadata above ``offset.metadata.max.bytes`` (4096 by default): past this size the
#: finished offsets are left out, and the next owner merely redoes them.
MAX_METADATA_CHARS = 3000


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

    def finished_above(self) -> list[int]:
        """The finished offsets above the watermark, ascending: what a next owner need not redo."""
        return sorted(self._finished)


def encode_finished(committed: int, finished: list[int]) -> str:
    """Commit metadata naming the finished offsets above ``committed`` (base 36 distances from it)."""
    if not finished:
        return ""
    text = _DONE_PREFIX + ",".join(_base36(offset - committed) for offset in finished)
    return text if len(text) <= MAX_METADATA_CHARS else ""


def decode_finished(committed: int, metadata: str | None) -> set[int]:
    """The finished offsets a commit's metadata names; empty for any metadata not written by ``encode_finished``."""
    if not metadata or not metadata.startswith(_DONE_PREFIX) or committed < 0:
        return set()
    try:
        return {committed + int(part, 36) for part in metadata.removeprefix(_DONE_PREFIX).split(",")}
    except ValueError:
        return set()


def _base36(number: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    text = ""
    while True:
        number, digit = divmod(number, 36)
        text = digits[digit] + text
        if number == 0:
            return text
