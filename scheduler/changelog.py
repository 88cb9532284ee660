"""The scheduler's changelog (``scheduler-state``): the record format, and reading one partition of it.

A restore that folds ``events`` costs time in proportion to the whole history. The changelog holds instead,
per task, what the scheduler holds in memory -- a live task's full state, a finished one's settled state, a
quarantine -- written in the transaction of the events that changed it, so a crash never leaves the two
disagreeing: both are committed or neither. Compacted, a partition of it is one record per task.

Besides the tasks, each partition has one *checkpoint* record (key ``b""``: a task id is never empty):
``events_end``, an offset of ``events`` below which every event is reflected by the task records. It is
the end of what the scheduler had written when the transaction carrying the checkpoint began, so the events
of that transaction itself lie above it though their tasks' records reflect them: each task record says
from which of its sequences on (``overlap_from``) its events may still follow the checkpoint, and a restore
skips those. Any other event after the checkpoint (written by a scheduler version without a changelog, by a
restore's quarantine records, behind the scheduler's back) is folded onto the record.

Records are versioned (``v``) and carry every field of ``TaskState`` and ``Quarantine`` as pydantic dumps
them, so a field added to either is written and read with no change here (a new field needs a default to
read records written before it; a record this version cannot read is not trusted, and its task is folded
again from ``events``). Sensitive step outputs are sealed as on ``events`` (``EventSealer.seal_state``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import orjson
from pydantic import TypeAdapter, ValidationError

from eventstore.replay import LogRange
from scheduler.decider import TaskState
from scheduler.quarantine import Quarantine
from scheduler.settled import PartitionTasks
from schemas.states import TERMINAL

CHECKPOINT_KEY = b""
VERSION: Literal[1] = 1
"""Bumped when a record can no longer be read as the previous version wrote it; older versions' records
stay readable by a decoder that knows them, or their tasks are folded again from ``events``."""


@dataclass(frozen=True)
class SavedTask:
    """One task's record: its state (None for a quarantined task this version cannot fold), its quarantine,
    and the first of its sequences that may lie on ``events`` after the partition's checkpoint."""

    state: TaskState | None
    quarantine: Quarantine | None
    overlap_from: int


@dataclass(frozen=True)
class _TaskRecord:
    v: Literal[1]
    task: SavedTask


@dataclass(frozen=True)
class _Checkpoint:
    v: Literal[1]
    events_end: int


_TASK = TypeAdapter(_TaskRecord)
_TERMINAL_VALUES = frozenset(status.value for status in TERMINAL)
_CHECKPOINT = TypeAdapter(_Checkpoint)


class UnreadableRecord(ValueError):
    """A changelog record this version cannot read: its task is folded again from ``events``."""


def encode_task(saved: SavedTask) -> bytes:
    return _TASK.dump_json(_TaskRecord(VERSION, saved))


def decode_task(value: bytes) -> SavedTask:
    try:
        return _TASK.validate_json(value).task
    except ValidationError as exc:
        raise UnreadableRecord(f"changelog record of version {_version(value)} cannot be read: "
                               f"{exc.errors()[0]['msg']} at {'/'.join(map(str, exc.errors()[0]['loc']))}") from None


def encode_checkpoint(events_end: int) -> bytes:
    return _CHECKPOINT.dump_json(_Checkpoint(VERSION, events_end))


def decode_checkpoint(value: bytes) -> int:
    try:
        return _CHECKPOINT.validate_json(value).events_end
    except ValidationError as exc:
        raise UnreadableRecord(f"changelog checkpoint of version {_version(value)} cannot be read: {exc}") from None


def _version(value: bytes) -> object:
    try:
        document = orjson.loads(value)
    except orjson.JSONDecodeError:
        return "unknown (not JSON)"
    return document.get("v", "unknown") if isinstance(document, dict) else "unknown"


@dataclass
class PartitionLog:
    """One partition of the changelog as a restore reads it: the last record of each task not ended, decoded
    (or why it cannot be), and the checkpoint (None: no scheduler with a changelog has written the
    partition). The ended tasks' records went to the partition's spill (``scheduler.settled``)."""

    tasks: dict[str, SavedTask | UnreadableRecord]
    checkpoint: int | None
    read: int


def read_partition(bootstrap: str, topic: str, partition: int, settled: PartitionTasks) -> PartitionLog:
    """Every record of the partition, the last of each key winning (a tombstone removes the task). An ended
    task's record is spilled to ``settled`` as it is, not validated: most of a long history's tasks have
    ended, and a command may never come for them (the caller ends the spill with ``settled.loaded``)."""
    tasks: dict[str, SavedTask | UnreadableRecord] = {}
    checkpoint: int | None = None
    read = 0
    for msg in LogRange(bootstrap, topic, partitions=[partition], batch_size=10000):
        read += 1
        key, value = msg.key(), msg.value()
        if key == CHECKPOINT_KEY:
            try:
                checkpoint = None if value is None else decode_checkpoint(value)
            except UnreadableRecord:
                checkpoint = None  # nothing says how far the records reach: the restore folds ``events`` whole
        elif key is not None:
            task_id = key.decode()
            tasks.pop(task_id, None)
            if value is None:
                settled.unspill(task_id)
            elif (ended := _ended_state(value)) is not None:
                settled.spill_record(task_id, *ended)
            else:
                settled.unspill(task_id)
                try:
                    tasks[task_id] = decode_task(value)
                except UnreadableRecord as exc:
                    tasks[task_id] = exc
    return PartitionLog(tasks, checkpoint, read)


def _ended_state(value: bytes) -> tuple[bytes, int, int] | None:
    """A record of an ended task that is not quarantined, as ``PartitionTasks.spill_record`` takes it (its
    state encoded, the range of sequences it reflects), read with no more than a JSON parse; None for any
    other record, which is decoded whole."""
    try:
        document = orjson.loads(value)
        if document["v"] != VERSION:
            return None
        task = document["task"]
        state = task["state"]
        if task["quarantine"] is not None or state is None or state["status"] not in _TERMINAL_VALUES:
            return None
        return orjson.dumps(state), int(task["overlap_from"]), int(state["sequence"])
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return None
