"""What a replay reads and how it applies it: the sources of the store, and the loop that applies a log
range to a store a batch (one transaction, with its offsets) at a time.

Shared by a replay in this process (``rebuild.Replayer``) and by the worker processes of a replay that
takes partitions side by side (``projections.staged``); the converters are module functions so that a
``Source`` can be sent to a worker process.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from confluent_kafka import Message as KafkaMessage

from eventstore.dlq import DeadLetter
from eventstore.replay import LogRange
from eventstore.topics import TopicLayout
from projections.dlq_rows import project_dead_letter
from projections.rows import project
from projections.store import Positioned, Projection, Store
from schemas.codec import default_codec
from schemas.errors import DecodeError
from schemas.messages import Event


@dataclass(frozen=True)
class Source:
    """A topic the store is derived from: how a record becomes something to apply (None: skip it, as
    the live projector does), how that changes rows, and whether records of different partitions change
    different rows (then its partitions can be replayed side by side: ``projections.staged``)."""

    topic: str
    convert: Callable[[KafkaMessage], Any]
    projection: Projection[Any]
    per_partition: bool = False


def decoded_event(msg: KafkaMessage) -> Event | None:
    """The event a record of ``events`` holds; None for what the live projector dead-letters instead of
    applying (undecodable records, messages that are not events)."""
    try:
        message = default_codec().decode(msg.value())
    except DecodeError:
        return None
    return message if isinstance(message, Event) else None


def sources(layout: TopicLayout) -> list[Source]:
    """``events`` (undecodable records and non-events are dead-lettered by the live projector, never
    applied: skipped here alike), keyed by task id, so a task's rows come from one partition; and ``dlq``,
    whose replay markers may name a dead letter of another partition."""
    return [Source(layout.events, decoded_event, project, per_partition=True),
            Source(layout.dlq, DeadLetter.from_message, project_dead_letter)]


@dataclass
class ReplayStats:
    records: int = 0
    applied: int = 0
    skipped: int = 0  # already in the store (a catch-up overlapping what the store had)
    rejected: int = 0  # refused by a constraint: in projection_errors
    seconds: float = 0.0
    staged: bool = False  # partitions replayed side by side (``projections.staged``), not in order here
    loading_s: float = 0.0  # of ``seconds``, loading the staged rows into the target

    def add(self, other: ReplayStats) -> None:
        self.records += other.records
        self.applied += other.applied
        self.skipped += other.skipped
        self.rejected += other.rejected
        self.seconds += other.seconds
        self.staged = self.staged or other.staged
        self.loading_s += other.loading_s


def apply_range(store: Store, source: Source, log_range: LogRange, batch_size: int, stats: ReplayStats,
                on_batch: Callable[[], None]) -> None:
    """Apply every record of ``log_range`` to ``store``, ``batch_size`` records a transaction; ``on_batch``
    after each (progress)."""
    batch: list[Positioned[Any]] = []
    for msg in log_range:
        stats.records += 1
        item = source.convert(msg)
        if item is not None:
            batch.append(Positioned(msg.partition(), msg.offset(), item))
        if len(batch) >= batch_size:
            _apply(store, source, batch, stats)
            on_batch()
            batch = []
    _apply(store, source, batch, stats)
    on_batch()


def _apply(store: Store, source: Source, batch: list[Positioned[Any]], stats: ReplayStats) -> None:
    result = store.apply_batch(source.topic, batch, source.projection)
    stats.applied += result.applied
    stats.skipped += result.skipped
    stats.rejected += result.rejected
