"""Restoring one partition's tasks: the changelog, then the events it does not reflect yet.

The changelog (``scheduler.changelog``) holds each task's state as of the partition's checkpoint (and the
events of the transaction that wrote it); what ``events`` holds past the checkpoint is folded onto it. That
tail is what a scheduler wrote since its last transaction -- nothing, after a clean stop -- or, after a
version without a changelog ran (a first start, a rolling upgrade), whatever that one wrote. With no
checkpoint (a new changelog, or one lost) the restore folds ``events`` whole, as before the changelog, and
every task is then written to the changelog with the next transaction. A task whose record this version
cannot read is folded again from ``events`` alone (only its records are decoded; the others before the
checkpoint are skipped by key), and quarantined as usual if that fold fails too. So is a task quarantined
because its history did not fold (its record has no state): this version may be a release that folds it,
and an operator's release needs its state. Either costs a read of the partition's ``events`` (decoding only
those tasks' records), for as long as such a task stays quarantined.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

import structlog

from eventstore.replay import ReplayReader
from eventstore.topics import TopicLayout
from scheduler.changelog import UnreadableRecord, read_partition
from scheduler.quarantine import PartitionFold, Quarantine
from scheduler.sealing import EventSealer
from scheduler.settled import PartitionTasks
from schemas.codec import default_codec
from schemas.sealed import TaskKey

log = structlog.get_logger("stepstream.scheduler")

_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6") if sys.platform == "linux" else None


def return_freed_memory() -> None:
    """Give back to the system the memory a restore used and freed (glibc's ``malloc_trim``).

    Reading a partition allocates and frees about a kilobyte per record (the record, its parse) between
    allocations that stay (the spill's page cache, the live states), so the freed memory lies in the middle of
    the heap, where ``free`` does not return it: after 200,000 finished tasks the scheduler's resident memory
    stayed 110 MB above what it held, and fell back to 10 MB above once trimmed. Elsewhere than glibc,
    nothing is done.
    """
    if _LIBC is not None and hasattr(_LIBC, "malloc_trim"):
        _LIBC.malloc_trim(0)


@dataclass
class Restored:
    """A partition's tasks as restored (the finished ones spilled), and what it cost. ``unsaved``: tasks whose
    state the changelog does not hold yet (folded from ``events`` here); ``events_end``: how far ``events`` was
    read."""

    tasks: PartitionTasks
    quarantined: dict[str, Quarantine]
    unsaved: set[str]
    events_end: int
    changelog_records: int
    event_records: int
    refolded: set[str] = field(default_factory=set)
    unattributed: int = 0


def restore_partition(bootstrap: str, layout: TopicLayout, partition: int, sealer: EventSealer,
                      keys: Mapping[str, TaskKey]) -> Restored:
    tasks = PartitionTasks()
    changelog = read_partition(bootstrap, layout.scheduler_state, partition, tasks)
    checkpoint = changelog.checkpoint
    if checkpoint is None:
        tasks.close()  # the records reach no known point of ``events``: they are not used
        tasks = PartitionTasks()
    quarantined: dict[str, Quarantine] = {}
    reflected: dict[str, tuple[int, int]] = {}
    refold: set[str] = set()
    for task_id, saved in changelog.tasks.items() if checkpoint is not None else ():
        if isinstance(saved, UnreadableRecord):
            log.warning("changelog record unreadable: folding the task from events", task_id=task_id,
                        partition=partition, reason=str(saved))
            refold.add(task_id)
            continue
        if saved.state is None:
            # Quarantined because an earlier version could not fold its history: this one may (a fixed release).
            refold.add(task_id)
            continue
        tasks[task_id] = sealer.open_state(saved.state, keys.get(task_id))
        if saved.quarantine is not None:
            quarantined[task_id] = saved.quarantine
        reflected[task_id] = (saved.overlap_from, saved.state.sequence)

    def reflected_range(task_id: str) -> tuple[int, int] | None:
        return reflected.get(task_id) or tasks.reflected(task_id)

    fold = PartitionFold(default_codec(), sealer.opener(keys), tasks, quarantined, reflected_range)
    start = 0 if checkpoint is None or refold else checkpoint
    skip_below = checkpoint or 0
    refold_keys = {task_id.encode() for task_id in refold}
    reader = ReplayReader(bootstrap, layout.events, partitions=[partition], start_offsets={partition: start})
    read = 0
    for _partition, offset, key, value in reader.raw():
        read += 1
        if offset < skip_below and key not in refold_keys:
            continue  # reflected by the changelog
        fold.add(key, value, f"{partition}:{offset}")
    unsaved = set(tasks) | set(fold.quarantined) if checkpoint is None else fold.touched | refold
    tasks.loaded()
    return Restored(tasks, fold.quarantined, unsaved, reader.stats.end_offsets[partition], changelog.read,
                    read, refold, fold.unattributed)
