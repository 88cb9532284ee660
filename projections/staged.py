"""A replay from the beginning with partitions side by side, in worker processes.

Decoding a record and mapping it to rows is Python, so one process replays at what one core gives
(the GIL bounds threads alike). But events are keyed by task id: a task's events all sit in one partition,
and every row they touch (``tasks``, ``steps``, ``task_history``, ``alerts``, ``projection_errors``) is
derived from that partition alone; ``dlq`` touches only ``dlq_entries``. So each partition of ``events``
(and ``dlq`` as a whole) replays into a staging SQLite store of its own, in a process of its own, through the
same loop and row mapping as a replay in order (``replaying.apply_range``: same poison handling, same
refusals into ``projection_errors``); the staged rows are then loaded into the target in bulk
(``Store.load_staged``: SQLite copies them in SQL, PostgreSQL with COPY).

Checked before loading: no task has rows in two staging stores (a topic whose partitions were added to,
a producer that keyed otherwise). If one has, or the target refuses a staged row (PostgreSQL refuses text
SQLite takes), nothing is loaded (``StagingRefused``) and the caller replays in order instead.
"""

from __future__ import annotations

import heapq
import multiprocessing
import shutil
import sqlite3
import tempfile
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eventstore.replay import LogRange
from projections.replaying import ReplayStats, Source, apply_range
from projections.store import SqliteStore, StagingRefused, Store

POLL_S = 0.2  # how often the parent reads the workers' progress


@dataclass(frozen=True)
class Unit:
    """Partitions of one topic that one worker replays into one staging store."""

    bootstrap: str
    source: Source
    partitions: tuple[int, ...]
    starts: dict[int, int]
    ends: dict[int, int]
    path: Path
    slot: int  # its progress counter


def plan(bootstrap: str, ranges: Sequence[tuple[Source, LogRange]], folder: Path) -> list[Unit]:
    """A unit per partition of a source whose partitions are independent, one unit for any other source."""
    units: list[Unit] = []
    for source, log_range in ranges:
        pending = [p for p in log_range.partitions if log_range.ends[p] > log_range.starts[p]]
        groups = [[p] for p in pending] if source.per_partition else [pending] if pending else []
        for group in groups:
            units.append(Unit(bootstrap, source, tuple(group), {p: log_range.starts[p] for p in group},
                              {p: log_range.ends[p] for p in group}, folder / f"unit-{len(units)}.db", len(units)))
    return units


_counters: Any = None  # a worker's view of the shared progress counters


def _init_worker(counters: Any) -> None:
    global _counters
    _counters = counters


def _replay_unit(unit: Unit, batch_size: int) -> ReplayStats:
    """In a worker: the unit's partitions into its staging store, in order, as a replay in this process would."""
    stats = ReplayStats()
    store = SqliteStore(unit.path, scratch=True)
    store.keys_only()
    try:
        log_range = LogRange(unit.bootstrap, unit.source.topic, partitions=unit.partitions, starts=unit.starts,
                             ends=unit.ends)

        def progress() -> None:
            _counters[unit.slot] = stats.records

        apply_range(store, unit.source, log_range, batch_size, stats, progress)
    finally:
        store.close()
    return stats


def replay_staged(ranges: Sequence[tuple[Source, LogRange]], bootstrap: str, target: Store, *, batch_size: int,
                  workers: int, progress: Callable[[int], None]) -> ReplayStats:
    """Replay ``ranges`` (starting where ``target``, an empty store, starts) side by side, then load the
    results into ``target``. Raises ``StagingRefused`` with ``target`` left as it was when the results
    cannot be merged; ``progress`` gets the records replayed so far."""
    folder = Path(tempfile.mkdtemp(prefix=".stepstream-replay-", dir=target.staging_folder()))
    try:
        units = plan(bootstrap, ranges, folder)
        context = multiprocessing.get_context("spawn")  # no fork of a process that runs librdkafka threads
        counters = context.Array("q", max(1, len(units)), lock=False)
        with ProcessPoolExecutor(max_workers=max(1, min(workers, len(units))), mp_context=context,
                                 initializer=_init_worker, initargs=(counters,)) as pool:
            futures = [pool.submit(_replay_unit, unit, batch_size) for unit in units]
            _wait(futures, lambda: progress(sum(counters)))
        stats = ReplayStats(staged=True)
        for future in futures:
            stats.add(future.result())
        shared = shared_task(unit.path for unit in units)
        if shared is not None:
            raise StagingRefused(f"task {shared} has events in more than one partition")
        staged = [SqliteStore(unit.path, scratch=True) for unit in units]
        started = time.perf_counter()
        try:
            target.load_staged(staged)
        finally:
            for store in staged:
                store.close()
        stats.loading_s = time.perf_counter() - started
        return stats
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _wait(futures: list[Future[ReplayStats]], report: Callable[[], None]) -> None:
    """Until every unit is done, or one failed (its error is raised when its result is read)."""
    while True:
        done, pending = wait(futures, timeout=POLL_S, return_when=FIRST_EXCEPTION)
        report()
        if not pending or any(f.exception() is not None for f in done):
            return


def shared_task(paths: Iterator[Path]) -> str | None:
    """A task id with rows in more than one of the staging stores, if any: a merge of each store's sorted
    task ids, so memory stays flat however many tasks there are."""
    connections = [sqlite3.connect(f"file:{path}?mode=ro", uri=True) for path in paths]
    streams = [_task_ids(conn, i) for i, conn in enumerate(connections)]
    try:
        previous: tuple[str, int] | None = None
        for task_id, unit in heapq.merge(*streams):
            if previous is not None and previous[0] == task_id and previous[1] != unit:
                return task_id
            previous = (task_id, unit)
        return None
    finally:
        for stream in streams:  # before their connections
            stream.close()
        for conn in connections:
            conn.close()


def _task_ids(conn: sqlite3.Connection, unit: int) -> Generator[tuple[str, int], None, None]:
    cursor = conn.execute("select task_id from task_history union select task_id from projection_errors "
                          "where task_id is not null order by 1")
    while chunk := cursor.fetchmany(2000):
        for (task_id,) in chunk:
            yield task_id, unit
