"""Rebuild a store by replaying the log, and verify that two stores (or a store and a replay) agree.

The projection is a deterministic function of the log (``events``, and ``dlq`` for ``dlq_entries``), so:

* **rebuild** replays both topics from the beginning into a fresh store beside the live one (a new
  SQLite file, a new PostgreSQL schema) while the live store keeps serving, catches up with the high
  watermarks, then swaps it in (``Store.swap_in``: atomic for every reader; the live projector is held
  off for the swap and finds offsets at least as far as its own, so it never skips an event). A rebuild
  bounded by a point in the log (``until``: offsets or a time) builds a separate store and swaps nothing:
  "what did it look like then".
* **verify** compares two stores table by table, row by row, in one consistent snapshot of each; against
  "a fresh replay" it replays up to exactly the offsets the live snapshot holds, so a projector that keeps
  running meanwhile makes no false difference.

Both show progress (records, records/s, remaining, ETA) on a rich console.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import structlog
from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, Task, TaskID, TextColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from eventstore.console import command_console
from eventstore.replay import LogRange, offsets_at
from projections.replaying import ReplayStats, Source, apply_range
from projections.staged import replay_staged
from projections.store import StagingRefused, Store, StoreView

log = structlog.get_logger("stepstream.rebuild")

CATCH_UP_ROUNDS = 10  # before the swap, replay again while more than a batch arrived meanwhile
# A staged replay (partitions side by side) starts its worker processes, each importing the code and
# connecting, about a second: below this many records a replay in order is done sooner.
STAGE_FROM = 50_000


def default_workers() -> int:
    """Twice the cores: a worker waits on the broker and the disk part of the time, and one per partition
    keeps partitions from queueing behind each other (three partitions on two workers take two rounds)."""
    return 2 * (os.cpu_count() or 1)
SAMPLES_PER_TABLE = 5

Offsets = dict[str, dict[int, int]]  # topic -> partition -> next offset


class _Rate(ProgressColumn):
    """The average since the start, as the summary line computes it: rich's own speed estimate needs
    several updates and showed 0 for a replay done in a batch or two."""

    def render(self, task: Task) -> Text:
        rate = task.completed / task.elapsed if task.elapsed else 0.0
        return Text(f"{rate:,.0f} records/s", style="progress.data.speed")


class _Remaining(ProgressColumn):
    def render(self, task: Task) -> Text:
        return Text(f"{max(0, int((task.total or 0) - task.completed)):,} remaining", style="progress.remaining")


def progress_bar(console: Console | None) -> Progress:
    """Records done of the total, records/s, remaining and ETA; ``None`` shows nothing (scripts, tests)."""
    return Progress(TextColumn("{task.description}"), BarColumn(),
                    TextColumn("{task.completed:,.0f}/{task.total:,.0f}"), _Rate(), _Remaining(),
                    TimeRemainingColumn(), console=console or command_console(stderr=True), disable=console is None)


class Replayer:
    """Replays the sources into a store, a batch (one transaction, with its offsets) at a time.

    Into an empty store, a replay of at least ``stage_from`` records takes partitions side by side in up
    to ``workers`` processes (``projections.staged``); otherwise, or when the staged rows cannot be merged,
    in order in this process.
    """

    def __init__(self, bootstrap: str, topics: Sequence[Source], *, batch_size: int = 2000,
                 progress: Progress | None = None, workers: int = 1, stage_from: int = STAGE_FROM) -> None:
        self.bootstrap = bootstrap
        self.sources = list(topics)
        self.batch_size = batch_size
        self.progress = progress
        self.workers = workers
        self.stage_from = stage_from

    @property
    def topics(self) -> list[str]:
        return [s.topic for s in self.sources]

    def _ranges(self, store: Store, ends: Mapping[str, Mapping[int, int]] | None,
                listed_only: bool) -> list[tuple[Source, LogRange]]:
        out = []
        for source in self.sources:
            limit = (ends or {}).get(source.topic)
            partitions = list(limit or {}) if listed_only else None
            if listed_only and not partitions:
                continue
            out.append((source, LogRange(self.bootstrap, source.topic, partitions=partitions,
                                         starts=store.offsets(source.topic), ends=limit)))
        return out

    def behind(self, store: Store) -> int:
        """Records (at most) between the store's offsets and the high watermarks now."""
        ranges = self._ranges(store, None, listed_only=False)
        for _source, log_range in ranges:
            log_range.close()
        return sum(r.total for _s, r in ranges)

    def replay(self, store: Store, *, ends: Mapping[str, Mapping[int, int]] | None = None,
               listed_only: bool = False, label: str = "replaying") -> ReplayStats:
        """From the store's offsets up to ``ends`` (default: the high watermarks now). With
        ``listed_only``, only the partitions ``ends`` lists are read."""
        started = time.perf_counter()
        ranges = self._ranges(store, ends, listed_only)
        task = self._task(label, sum(r.total for _s, r in ranges))
        stats = None
        if self._stages(store, ranges):
            stats = self._staged(store, ranges, task)
            if stats is None:  # made again as they were: the staged replay read them
                ranges = self._ranges(store, {s.topic: dict(r.ends) for s, r in ranges}, listed_only=True)
        if stats is None:
            stats = ReplayStats()
            for source, log_range in ranges:
                apply_range(store, source, log_range, self.batch_size, stats,
                            lambda: self._advance(task, stats.records))
        stats.seconds = time.perf_counter() - started
        if self.progress is not None and task is not None:
            # The totals counted offsets; transaction markers take offsets but are no records.
            self.progress.update(task, completed=stats.records, total=stats.records)
        return stats

    def _stages(self, store: Store, ranges: list[tuple[Source, LogRange]]) -> bool:
        return (self.workers > 1 and sum(r.total for _s, r in ranges) >= self.stage_from
                and not any(store.offsets(source.topic) for source, _r in ranges))

    def _staged(self, store: Store, ranges: list[tuple[Source, LogRange]], task: TaskID | None) -> ReplayStats | None:
        """The replay side by side; None, ``store`` as it was, when its rows could not be merged."""
        for _source, log_range in ranges:
            log_range.close()  # the workers read the ranges; these only fixed where they end
        try:
            return replay_staged(ranges, self.bootstrap, store, batch_size=self.batch_size, workers=self.workers,
                                 progress=lambda records: self._advance(task, records))
        except StagingRefused as exc:
            log.warning("replaying in order: the partitions replayed side by side cannot be merged", error=str(exc))
        return None

    def _advance(self, task: TaskID | None, records: int) -> None:
        if self.progress is not None and task is not None:
            self.progress.update(task, completed=records)

    def _task(self, label: str, total: int) -> TaskID | None:
        return None if self.progress is None else self.progress.add_task(label, total=total)


@dataclass
class RebuildReport:
    store: str
    replay: ReplayStats
    seconds: float  # the whole rebuild, swap included
    swapped: bool
    offsets: Offsets = field(default_factory=dict)

    @property
    def records(self) -> int:
        return self.replay.records

    def as_json(self) -> dict[str, Any]:
        return {"store": self.store, "records": self.records, "applied": self.replay.applied,
                "rejected": self.replay.rejected, "staged": self.replay.staged,
                "loading_seconds": round(self.replay.loading_s, 3), "seconds": round(self.seconds, 3),
                "records_per_s": round(self.records / self.seconds) if self.seconds else None,
                "swapped": self.swapped, "offsets": {t: {str(p): o for p, o in v.items()}
                                                     for t, v in self.offsets.items()}}


def rebuild_live(live: Store, replayer: Replayer) -> RebuildReport:
    """Replay into a fresh store beside ``live``, catch up, swap it in. The live store serves until then."""
    started = time.perf_counter()
    fresh = live.sibling(f"rebuild_{uuid.uuid4().hex[:8]}")
    stats = ReplayStats()
    try:
        stats.add(replayer.replay(fresh, label="rebuilding"))
        for _ in range(CATCH_UP_ROUNDS):
            if replayer.behind(fresh) <= replayer.batch_size:
                break
            stats.add(replayer.replay(fresh, label="catching up"))

        def catch_up(live_offsets: dict[str, dict[int, int]]) -> None:
            stats.add(replayer.replay(fresh, ends=live_offsets, listed_only=True, label="swapping in"))

        fresh.analyze()
        live.swap_in(fresh, replayer.topics, catch_up)
    except BaseException:
        fresh.discard()
        raise
    return RebuildReport(live.describe(), stats, time.perf_counter() - started, True,
                         {t: live.offsets(t) for t in replayer.topics})


def rebuild_into(target: Store, replayer: Replayer, until: Offsets | None = None) -> RebuildReport:
    """Replay into ``target`` (an empty store, or one to bring further), up to ``until`` if given."""
    started = time.perf_counter()
    stats = replayer.replay(target, ends=until, label="rebuilding")
    target.analyze()
    return RebuildReport(target.describe(), stats, time.perf_counter() - started, False,
                         {t: target.offsets(t) for t in replayer.topics})


def until_time(bootstrap: str, topics: Sequence[str], when: datetime) -> Offsets:
    """The end offsets of every topic at ``when``: the log as it stood then."""
    return {topic: offsets_at(bootstrap, topic, when) for topic in topics}


# -- verify ----------------------------------------------------------------------------------------


@dataclass
class TableDiff:
    table: str
    rows_a: int = 0
    rows_b: int = 0
    only_a: int = 0
    only_b: int = 0
    differing: int = 0
    note: str | None = None
    samples: list[str] = field(default_factory=list)

    @property
    def equal(self) -> bool:
        return not (self.only_a or self.only_b or self.differing or self.note)

    def sample(self, text: str) -> None:
        if len(self.samples) < SAMPLES_PER_TABLE:
            self.samples.append(text[:500])


@dataclass
class Comparison:
    a: str
    b: str
    tables: list[TableDiff]

    @property
    def equal(self) -> bool:
        return all(t.equal for t in self.tables)

    def as_json(self) -> dict[str, Any]:
        return {"a": self.a, "b": self.b, "equal": self.equal,
                "tables": [{**t.__dict__, "equal": t.equal} for t in self.tables]}

    def render(self, console: Console) -> None:
        table = Table(title=f"A: {self.a}\nB: {self.b}")
        for column in ("table", "rows A", "rows B", "only in A", "only in B", "differing", ""):
            table.add_column(column, justify="left" if column in ("table", "") else "right")
        for t in self.tables:
            table.add_row(t.table, f"{t.rows_a:,}", f"{t.rows_b:,}", str(t.only_a), str(t.only_b), str(t.differing),
                          "[green]equal[/green]" if t.equal else f"[red]{t.note or 'DIFFERENT'}[/red]")
        console.print(table)
        for t in self.tables:
            for line in t.samples:
                console.print(f"  {t.table}: {line}", highlight=False, markup=False)
        console.print("[green]stores are equal[/green]" if self.equal else "[red]stores differ[/red]")


def compare_views(a: StoreView, b: StoreView, names: tuple[str, str],
                  progress: Progress | None = None) -> Comparison:
    layouts_a = {t.name: t for t in a.tables()}
    layouts_b = {t.name: t for t in b.tables()}
    task = progress.add_task("comparing", total=len(set(layouts_a) | set(layouts_b))) if progress else None
    diffs = []
    for name in sorted(set(layouts_a) | set(layouts_b)):
        if name not in layouts_a or name not in layouts_b:
            diffs.append(TableDiff(name, note=f"only in {'A' if name in layouts_a else 'B'}"))
        elif layouts_a[name].columns != layouts_b[name].columns:
            diffs.append(TableDiff(name, note="columns differ: "
                                   f"{layouts_a[name].columns} vs {layouts_b[name].columns}"))
        else:
            layout = layouts_a[name]
            key = [layout.columns.index(c) for c in layout.order]
            diffs.append(_merge(name, layout.columns, key, a.rows(layout), b.rows(layouts_b[name])))
        if progress is not None and task is not None:
            progress.advance(task)
    return Comparison(names[0], names[1], diffs)


def _sort_key(row: tuple[Any, ...], key: list[int]) -> tuple[tuple[bool, Any], ...]:
    """As the stores order rows (``Store._order_term``): NULLs first, then values."""
    return tuple((row[i] is not None, row[i]) for i in key)


def _merge(name: str, columns: tuple[str, ...], key: list[int], rows_a: Iterator[tuple[Any, ...]],
           rows_b: Iterator[tuple[Any, ...]]) -> TableDiff:
    diff = TableDiff(name)
    ra, rb = next(rows_a, None), next(rows_b, None)
    while ra is not None or rb is not None:
        if rb is None or (ra is not None and _sort_key(ra, key) < _sort_key(rb, key)):
            diff.only_a += 1
            diff.rows_a += 1
            diff.sample(f"only in A: {_show(columns, ra)}")
            ra = next(rows_a, None)
        elif ra is None or _sort_key(rb, key) < _sort_key(ra, key):
            diff.only_b += 1
            diff.rows_b += 1
            diff.sample(f"only in B: {_show(columns, rb)}")
            rb = next(rows_b, None)
        else:
            if tuple(ra) != tuple(rb):
                diff.differing += 1
                changed = {c: (x, y) for c, x, y in zip(columns, ra, rb, strict=True) if x != y}
                diff.sample(f"differs at {[ra[i] for i in key]}: {changed}")
            diff.rows_a += 1
            diff.rows_b += 1
            ra, rb = next(rows_a, None), next(rows_b, None)
    return diff


def _show(columns: tuple[str, ...], row: tuple[Any, ...] | None) -> str:
    return str(dict(zip(columns, row or (), strict=False)))


def verify_stores(a: Store, b: Store, progress: Progress | None = None) -> Comparison:
    with a.snapshot() as view_a, b.snapshot() as view_b:
        return compare_views(view_a, view_b, (a.describe(), b.describe()), progress)


def verify_against_replay(live: Store, replayer: Replayer) -> Comparison:
    """Compare ``live`` with a replay of the log up to exactly the offsets ``live`` holds."""
    with live.snapshot() as view:
        ends = {topic: view.offsets(topic) for topic in replayer.topics}
        with _scratch(live, "verify") as fresh:
            replayer.replay(fresh, ends=ends, listed_only=True, label="replaying to the store's offsets")
            with fresh.snapshot() as fresh_view:
                return compare_views(view, fresh_view, (live.describe(), "a fresh replay of the log"),
                                     replayer.progress)


@contextmanager
def _scratch(beside: Store, purpose: str) -> Iterator[Store]:
    store = beside.sibling(f"{purpose}_{uuid.uuid4().hex[:8]}")
    try:
        yield store
    finally:
        store.discard()
