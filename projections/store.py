"""The state store: tables the projectors derive from the log, and the queries that read them.

One interface, two backends: ``SqliteStore`` (embedded default, WAL: one writer, any number of readers)
and ``PostgresStore`` (``projections/postgres.py``). Every query and every row mapping is written once,
with ``?`` placeholders; a backend supplies only its plumbing (connections, transactions, locks, query
plans, schema swaps).

A batch of records is applied in one transaction together with the next offset of each partition, so
the store is exactly what a replay of the log up to those offsets gives: restart the projector, kill it
mid-batch, the rows and the offsets never disagree, and records below the stored offsets are skipped.
"""

from __future__ import annotations

import sqlite3
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar, Generic, NamedTuple, TypeVar

from eventstore.errors import InfrastructureError
from projections.charts import CHART_EVENTS
from projections.migrations import Dialect, migrate
from projections.rows import Executor, ms, project
from schemas.messages import Event
from schemas.states import STEPS_FAILED, STEPS_IN_PROGRESS, STEPS_WAITING, StepStatus

T = TypeVar("T")

# Tables that are not part of the projection: never compared, never swapped.
BOOKKEEPING = frozenset({"schema_migrations", "sqlite_sequence", "sqlite_stat1", "sqlite_stat4"})
TASK_COLUMNS = ("task_id, workflow, workflow_version, status, sequence, current_step, failure_count, error, "
                "created_at, updated_at, retry_at, wait_reason, quarantine_reason, erased_at, erased_by, erase_due_at, "
                "submitter")


def _status_in(statuses: Sequence[StepStatus]) -> str:
    """``status in ('a', 'b')`` as literals, not parameters: SQLite uses a partial index only for a query whose
    condition repeats the index's, and the migrations spell the statuses out as literals."""
    return "status in (" + ", ".join(f"'{status}'" for status in statuses) + ")"


_IN_PROGRESS = _status_in(STEPS_IN_PROGRESS)  # the ``steps_leased`` partial index's condition
_FAILED = _status_in(STEPS_FAILED)  # the ``steps_failed`` partial index's condition


class StagingRefused(Exception):
    """Rows replayed side by side cannot be merged into the target (``projections.staged``); nothing was
    loaded, and the replay runs in order instead."""


@dataclass(frozen=True)
class ExpiredStep:
    task_id: str
    step: str
    attempt_id: str
    complete_by_ms: int


class Positioned(NamedTuple, Generic[T]):
    """One record to apply and where it sits in its topic."""

    partition: int
    offset: int
    item: T


class BatchResult(NamedTuple):
    applied: int
    skipped: int  # already in the store: below the stored offset of its partition
    rejected: int  # refused by a constraint; recorded in ``projection_errors``


# Maps one record to rows, inside the store's transaction (``rows.project`` for events).
Projection = Callable[[Executor, T], None]


@dataclass(frozen=True)
class TableLayout:
    """A projection table as verify compares it: its columns, and the columns rows are ordered by."""

    name: str
    columns: tuple[str, ...]
    order: tuple[str, ...]
    text_columns: frozenset[str] = frozenset()


class Store(ABC):
    """A state store. One connection per instance, guarded by a lock: safe to share between threads."""

    dialect: ClassVar[Dialect]

    def __init__(self) -> None:
        self._lock = threading.RLock()

    # -- backend plumbing ---------------------------------------------------------------------

    @abstractmethod
    def close(self) -> None: ...

    @abstractmethod
    def describe(self) -> str:
        """Where the store lives, for people (a path, or a database and schema without the password)."""

    @abstractmethod
    def _write(self) -> AbstractContextManager[Executor]:
        """A transaction that writers of this store enter one at a time (commits on exit)."""

    @abstractmethod
    def _snapshot(self) -> AbstractContextManager[Executor]:
        """A read-only transaction: every query in it sees the same committed state."""

    @abstractmethod
    def _stream(self, db: Executor, sql: str) -> Iterator[tuple[Any, ...]]:
        """Rows of a large query, fetched a chunk at a time."""

    @abstractmethod
    def _is_data_error(self, exc: BaseException) -> bool:
        """A constraint or value the database refused: the record is at fault, not the database."""

    @abstractmethod
    def _plan(self, db: Executor, sql: str, params: tuple[Any, ...]) -> str: ...

    @abstractmethod
    def _layouts(self, db: Executor) -> list[TableLayout]: ...

    @abstractmethod
    def _order_term(self, column: str, text: bool) -> str:
        """An ORDER BY term that sorts like Python does: NULLs first, text by code point."""

    def _bulk(self, _db: Executor) -> AbstractContextManager[None]:
        """Around the statements of a batch: PostgreSQL pipelines them, SQLite has no round trips to save."""
        return nullcontext()

    @abstractmethod
    def sibling(self, tag: str) -> Store:
        """A new, empty store beside this one (a file next to it, a schema in its database), for rebuilds."""

    @abstractmethod
    def discard(self) -> None:
        """Close and delete this store (a rebuild's scratch store that was not swapped in)."""

    @abstractmethod
    def swap_in(self, fresh: Store, topics: Sequence[str],
                catch_up: Callable[[dict[str, dict[int, int]]], None]) -> None:
        """Replace this store's contents with ``fresh``'s, atomically for every reader and writer.

        Inside the swap, writers of this store are held off; ``catch_up`` receives this store's offsets
        and must bring ``fresh`` at least that far, so the live projector, which resumes from the
        offsets it finds, never skips an event. ``fresh`` is consumed.
        """

    @abstractmethod
    def load_staged(self, staged: Sequence[SqliteStore]) -> None:
        """Copy every projection row of ``staged`` (partitions replayed side by side into stores of their own)
        into this empty store. Raises ``StagingRefused`` when a row is refused, this store left unchanged."""

    def staging_folder(self) -> Path | None:
        """Where a replay keeps its staging stores (None: the system's temporary folder)."""
        return None

    def analyze(self) -> None:
        """Refresh the planner's statistics (after a bulk load)."""
        with self._lock, self._write() as db:
            db.execute("analyze")

    # -- writing ------------------------------------------------------------------------------

    def offsets(self, topic: str) -> dict[int, int]:
        """Next offset to apply per partition of ``topic``."""
        return _offsets(self._rows("select partition, next_offset from offsets where topic = ?", (topic,)))

    def apply_batch(self, topic: str, records: Sequence[Positioned[T]], projection: Projection[T]) -> BatchResult:
        """Apply records of ``topic`` (in order per partition) and advance its offsets, in one transaction.

        A record a constraint refuses is deterministic (every replay meets it alike): the batch is redone
        with each record isolated, the refused one is recorded in ``projection_errors`` and skipped.
        """
        if not records:
            return BatchResult(0, 0, 0)
        with self._lock:
            try:
                return self._apply(topic, records, projection, isolate=False)
            except Exception as exc:
                if not self._is_data_error(exc):
                    raise
            return self._apply(topic, records, projection, isolate=True)

    def apply_events(self, topic: str, records: Sequence[Positioned[Event]]) -> BatchResult:
        return self.apply_batch(topic, records, project)

    def apply(self, topic: str, partition: int, offset: int, event: Event) -> bool:
        """Apply one event and advance the partition's offset atomically. False if already applied."""
        return self.apply_events(topic, [Positioned(partition, offset, event)]).skipped == 0

    def _apply(self, topic: str, records: Sequence[Positioned[T]], projection: Projection[T], *,
               isolate: bool) -> BatchResult:
        rejected = 0
        with self._write() as db:
            stored = _offsets(db.execute("select partition, next_offset from offsets where topic = ?", (topic,)))
            todo = [r for r in records if r.offset >= stored.get(r.partition, 0)]
            with nullcontext() if isolate else self._bulk(db):
                for record in todo:
                    if isolate:
                        rejected += self._apply_isolated(db, topic, record, projection)
                    else:
                        projection(db, record.item)
                ends: dict[int, int] = {}
                for record in todo:
                    ends[record.partition] = max(ends.get(record.partition, 0), record.offset + 1)
                for partition, next_offset in ends.items():
                    db.execute(
                        "insert into offsets(topic, partition, next_offset) values (?, ?, ?) "
                        "on conflict(topic, partition) do update set next_offset = excluded.next_offset",
                        (topic, partition, next_offset),
                    )
        return BatchResult(len(todo) - rejected, len(records) - len(todo), rejected)

    def _apply_isolated(self, db: Executor, topic: str, record: Positioned[T], projection: Projection[T]) -> int:
        db.execute("savepoint record")
        try:
            projection(db, record.item)
        except Exception as exc:
            if not self._is_data_error(exc):
                raise
            db.execute("rollback to savepoint record")
            db.execute("release savepoint record")
            db.execute(
                "insert into projection_errors(topic, partition, event_offset, task_id, event_type, error) "
                "values (?, ?, ?, ?, ?, ?)",
                (topic, record.partition, record.offset, getattr(record.item, "task_id", None),
                 type(record.item).__name__, f"{type(exc).__name__}: {exc}"[:2000]),
            )
            return 1
        db.execute("release savepoint record")
        return 0

    # -- reading ------------------------------------------------------------------------------

    def _rows(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self._lock, self._snapshot() as db:
            return list(db.execute(sql, params).fetchall())

    def _dicts(self, sql: str, params: tuple[Any, ...] = ()) -> list[dict[str, Any]]:
        with self._lock, self._snapshot() as db:
            return _dicts(db.execute(sql, params))

    # The status list must match the ``steps_leased`` partial index's word for word for the planner to use it.
    _EXPIRED = ("select task_id, step, attempt_id, complete_by from steps "
                f"where {_IN_PROGRESS} and complete_by <= ? "
                "and (complete_by, task_id, step) > (?, ?, ?) "
                "order by complete_by, task_id, step limit ?")

    def expired_steps(self, now: datetime, *, not_before: datetime, after: tuple[int, str, str] | None = None,
                      limit: int = 100) -> list[ExpiredStep]:
        """Attempts in progress whose deadline passed -- queued ones after their start-by, running ones after
        their complete-by, forward or compensating -- oldest first, a keyset page at a time.

        ``not_before`` bounds the window so a scan never walks the whole history; ``after`` is the last
        (complete_by, task_id, step) of the previous page. Served by the ``steps_leased`` partial index.
        """
        rows = self._rows(self._EXPIRED, self._expired_params(now, not_before, after, limit))
        return [ExpiredStep(t, s, a, c) for t, s, a, c in rows]

    def expired_steps_plan(self, now: datetime, *, not_before: datetime, limit: int = 100) -> str:
        """The query plan of ``expired_steps``, to prove it is index-backed."""
        with self._lock, self._snapshot() as db:
            return self._plan(db, self._EXPIRED, self._expired_params(now, not_before, None, limit))

    @staticmethod
    def _expired_params(now: datetime, not_before: datetime, after: tuple[int, str, str] | None,
                        limit: int) -> tuple[Any, ...]:
        start = after or (ms(not_before) - 1, "", "")
        return (ms(now), *start, limit)

    def tasks(self, *, state: str | None = None, workflow: str | None = None, since_ms: int | None = None,
              until_ms: int | None = None, before: tuple[int, str] | None = None, limit: int = 50,
              version: int | None = None, prefix: str | None = None, submitter: str | None = None,
              ) -> list[dict[str, Any]]:
        """Tasks newest first (by creation, which never changes, so pages stay stable while tasks move).

        ``before`` is the (created_at, task_id) of the previous page's last task: keyset pagination. ``prefix``
        finds the tasks whose id starts with it (by code point, case-sensitive, as ids are compared everywhere).
        """
        where, params = self._task_filter(state, workflow, version, since_ms, until_ms, prefix, submitter)
        if before is not None:
            where.append("(created_at, task_id) < (?, ?)")
            params.extend(before)
        sql = (f"select {TASK_COLUMNS} from tasks {'where ' + ' and '.join(where) if where else ''} "
               "order by created_at desc, task_id desc limit ?")
        return self._dicts(sql, (*params, limit))

    def count_tasks(self, *, state: str | None = None, workflow: str | None = None, since_ms: int | None = None,
                    until_ms: int | None = None, version: int | None = None, prefix: str | None = None,
                    submitter: str | None = None) -> int:
        """How many tasks ``tasks`` walks through with the same filters, over all its pages."""
        where, params = self._task_filter(state, workflow, version, since_ms, until_ms, prefix, submitter)
        sql = f"select count(*) from tasks {'where ' + ' and '.join(where) if where else ''}"
        return int(self._rows(sql, tuple(params))[0][0])

    def _task_filter(self, state: str | None, workflow: str | None, version: int | None, since_ms: int | None,
                     until_ms: int | None, prefix: str | None, submitter: str | None) -> tuple[list[str], list[Any]]:
        """The conditions of the task list's filters, each served by an index (migrations 2 and 8)."""
        where: list[str] = []
        params: list[Any] = []
        for clause, value in (("status = ?", state), ("workflow = ?", workflow), ("workflow_version = ?", version),
                              ("submitter = ?", submitter), ("created_at >= ?", since_ms),
                              ("created_at < ?", until_ms)):
            if value is not None:
                where.append(clause)
                params.append(value)
        if prefix:
            low, high = prefix_range(prefix)
            column = self._prefix_column(low, high)
            where.append(f"{column} >= ?")
            params.append(low)
            if high is not None:
                where.append(f"{column} < ?")
                params.append(high)
        return where, params

    # Past this many tasks with the prefix, a page is found faster walking the newest tasks than sorting those.
    NARROW_PREFIX = 2000

    def _few_start_with(self, low: str, high: str | None) -> bool:
        """Whether few tasks' ids are in [low, high): counted in the primary key, never past ``NARROW_PREFIX``."""
        bound, params = ("and task_id < ?", (low, high)) if high is not None else ("", (low,))
        return int(self._rows(f"select count(*) from (select 1 from tasks where task_id >= ? {bound} limit ?)",
                              (*params, self.NARROW_PREFIX))[0][0]) < self.NARROW_PREFIX

    def _prefix_column(self, low: str, high: str | None) -> str:
        """The task id as the prefix search compares it: by code point, through an index. In SQLite that is the
        column itself; for a prefix many tasks share it is ``+task_id``, which keeps the planner off the primary
        key (SQLite's documented way): it then walks tasks newest first and stops after a page, instead of
        sorting every match (60 ms for a third of 100,000 tasks, a few walking)."""
        return "task_id" if self._few_start_with(low, high) else "+task_id"

    def task(self, task_id: str) -> dict[str, Any] | None:
        """One task with its steps (in workflow order), or None."""
        with self._lock, self._snapshot() as db:
            found = _dicts(db.execute(f"select {TASK_COLUMNS} from tasks where task_id = ?", (task_id,)))
            if not found:
                return None
            task = found[0]
            task["steps"] = _dicts(db.execute("select * from steps where task_id = ? order by step_index, step",
                                              (task_id,)))
            return task

    def history(self, task_id: str) -> list[dict[str, Any]]:
        """Every event of a task, in order: its full timeline."""
        return self._dicts("select sequence, event_type, occurred_at, body from task_history where task_id = ? "
                           "order by sequence", (task_id,))

    def counts_by_status(self) -> dict[str, int]:
        return {s: int(n) for s, n in self._rows("select status, count(*) from tasks group by status")}

    def step_counts_by_status(self) -> dict[str, int]:
        return {s: int(n) for s, n in self._rows("select status, count(*) from steps group by status")}

    def erase_due(self, now: datetime, limit: int = 100) -> list[str]:
        """Tasks whose retention for sensitive data ran out and that are not erased yet, soonest due first."""
        return [str(row[0]) for row in self._rows(
            "select task_id from tasks where erase_due_at is not null and erased_at is null and erase_due_at <= ? "
            "order by erase_due_at, task_id limit ?", (ms(now), limit))]

    def stuck_steps(self, now: datetime, limit: int = 50) -> list[dict[str, Any]]:
        """Steps still queued, processing or compensating after their deadline, oldest deadline first."""
        return self._dicts(f"select * from steps where {_IN_PROGRESS} and complete_by <= ? "
                           "order by complete_by, task_id, step limit ?",
                           (ms(now), limit))

    def queued_steps(self, limit: int = 50) -> list[dict[str, Any]]:
        """Attempts waiting for an agent to take them (forward or compensating), longest waiting first."""
        return self._dicts(f"select * from steps where {_status_in(STEPS_WAITING)} "
                           "order by queued_at, task_id, step limit ?", (limit,))

    def waiting_steps(self, limit: int = 50) -> list[dict[str, Any]]:
        """Steps waiting for a timer before their next attempt (forward or undo), soonest retry first."""
        return self._dicts("select * from steps where status = 'waiting' order by retry_at, task_id, step limit ?",
                           (limit,))

    def queue_waits(self, since_ms: int) -> dict[str, Any]:
        """How long attempts taken since ``since_ms`` waited for an agent: count, mean and longest (ms)."""
        count, mean, longest = self._rows(
            "select count(*), avg(waited_ms), max(waited_ms) from steps where accepted_at >= ?", (since_ms,))[0]
        return {"accepted": int(count), "mean_ms": None if mean is None else round(float(mean)),
                "max_ms": None if longest is None else int(longest)}

    def failed_steps(self, limit: int = 50) -> list[dict[str, Any]]:
        """Steps that failed or whose compensation failed, most recent first."""
        return self._dicts(f"select * from steps where {_FAILED} "
                           "order by updated_at desc, task_id desc, step desc limit ?", (limit,))

    def alerts(self, limit: int = 100, before_id: int | None = None) -> list[dict[str, Any]]:
        """Operator alerts, most recent first; ``before_id`` pages back."""
        if before_id is None:
            return self._dicts("select * from alerts order by id desc limit ?", (limit,))
        return self._dicts("select * from alerts where id < ? order by id desc limit ?", (before_id, limit))

    def dlq_entries(self, *, limit: int = 50, before: tuple[int, int, int] | None = None,
                    replayed: bool | None = None, discarded: bool | None = None) -> list[dict[str, Any]]:
        """Dead letters newest first; ``before`` is the previous page's last (dead_at, partition, dlq_offset)."""
        where: list[str] = []
        params: list[Any] = []
        if replayed is not None:
            where.append("replayed_at is not null" if replayed else "replayed_at is null")
        if discarded is not None:
            where.append("discarded_at is not null" if discarded else "discarded_at is null")
        if before is not None:
            where.append("(dead_at, partition, dlq_offset) < (?, ?, ?)")
            params.extend(before)
        sql = (f"select * from dlq_entries {'where ' + ' and '.join(where) if where else ''} "
               "order by dead_at desc, partition desc, dlq_offset desc limit ?")
        return self._dicts(sql, (*params, limit))

    def dlq_depth(self) -> dict[str, int]:
        """Dead letters neither replayed nor discarded yet, by error kind."""
        return {str(k): int(n) for k, n in self._rows(
            "select coalesce(error_kind, 'unknown'), count(*) from dlq_entries "
            "where replayed_at is null and discarded_at is null group by coalesce(error_kind, 'unknown')")}

    def throughput(self, since_ms: int, until_ms: int) -> list[tuple[int, int]]:
        """Events per minute: (minute start in epoch ms, events) for each minute that had any."""
        rows = self._rows(
            "select occurred_at / 60000, count(*) from task_history where occurred_at >= ? and occurred_at < ? "
            "group by occurred_at / 60000 order by 1", (since_ms, until_ms))
        return [(int(minute) * 60000, int(n)) for minute, n in rows]

    def chart_rows(self, since_ms: int, until_ms: int) -> list[tuple[str, int, str, int]]:
        """(task_id, sequence, event_type, occurred_at) of the events the console's charts fold
        (``projections.charts``), in the window, by task and sequence."""
        types = ", ".join(f"'{t}'" for t in CHART_EVENTS)
        return [(str(t), int(s), str(e), int(o)) for t, s, e, o in self._rows(
            f"select task_id, sequence, event_type, occurred_at from task_history where occurred_at >= ? "
            f"and occurred_at < ? and event_type in ({types}) order by task_id, sequence", (since_ms, until_ms))]

    def projection_errors(self, limit: int = 100) -> list[dict[str, Any]]:
        return self._dicts("select * from projection_errors order by topic, partition, event_offset limit ?",
                           (limit,))

    # -- whole-store views, for verify ----------------------------------------------------------

    @contextmanager
    def snapshot(self) -> Iterator[StoreView]:
        """A consistent view of every table at one moment, however long it is read."""
        with self._lock, self._snapshot() as db:
            yield StoreView(self, db)


class StoreView:
    """A store frozen at one moment (see ``Store.snapshot``)."""

    def __init__(self, store: Store, db: Executor) -> None:
        self._store = store
        self._db = db

    def offsets(self, topic: str) -> dict[int, int]:
        return _offsets(self._db.execute("select partition, next_offset from offsets where topic = ?", (topic,)))

    def tables(self) -> list[TableLayout]:
        return [t for t in self._store._layouts(self._db) if t.name not in BOOKKEEPING]

    def rows(self, table: TableLayout) -> Iterator[tuple[Any, ...]]:
        """Every row of ``table`` in ``table.order``, sorted the way Python sorts (see ``_order_term``)."""
        order = ", ".join(self._store._order_term(c, c in table.text_columns) for c in table.order)
        columns = ", ".join(table.columns)
        return self._store._stream(self._db, f"select {columns} from {table.name} order by {order}")


def prefix_range(prefix: str) -> tuple[str, str | None]:
    """The strings starting with ``prefix`` are those in [low, high) by code point: ``high`` is the prefix with
    its last character moved one on (None: no string is past them). Surrogates are no characters of stored
    text, so the step from U+D7FF goes to U+E000."""
    stem = prefix
    while stem:
        last = ord(stem[-1])
        if last < 0x10FFFF:
            following = 0xE000 if 0xD800 <= last + 1 <= 0xDFFF else last + 1
            return prefix, stem[:-1] + chr(following)
        stem = stem[:-1]
    return prefix, None


def _offsets(rows: Any) -> dict[int, int]:
    return {int(p): int(o) for p, o in rows}


def _dicts(cursor: Any) -> list[dict[str, Any]]:
    names = [d[0] for d in cursor.description]
    return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]


def layouts_from_columns(columns: Mapping[str, Sequence[str]], keys: Mapping[str, Sequence[str]],
                         text: Mapping[str, set[str]]) -> list[TableLayout]:
    """Table layouts for verify. A sole ``id`` key is a surrogate: its values depend on how the projector
    interleaved partitions, not on the log, so it is left out and rows are ordered by every other column."""
    out = []
    for name, cols in sorted(columns.items()):
        key = tuple(keys.get(name, ()))
        texts = frozenset(text.get(name, set()))
        if key == ("id",):
            kept = tuple(c for c in cols if c != "id")
            out.append(TableLayout(name, kept, kept, texts))
        else:
            out.append(TableLayout(name, tuple(cols), key or tuple(cols), texts))
    return out


# -- SQLite -----------------------------------------------------------------------------------------


class SqliteStore(Store):
    """SQLite in WAL mode: one writer (the projector), any number of readers (supervisor, API).

    ``scratch`` stores (a rebuild's) keep their journal in memory and never fsync: a crash discards
    them anyway, and bulk loading is several times faster.
    """

    dialect = "sqlite"

    def __init__(self, path: Path, *, scratch: bool = False) -> None:
        super().__init__()
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._conn = sqlite3.connect(self.path, timeout=30, isolation_level=None, check_same_thread=False)
        if scratch:
            self._conn.execute("pragma journal_mode=memory")
            self._conn.execute("pragma synchronous=off")
        else:
            self._journal_mode_wal()
            self._conn.execute("pragma synchronous=normal")
        migrate(_SqliteMigrator(self._conn))

    def _journal_mode_wal(self, timeout_s: float = 30.0) -> None:
        """Switching a new file to WAL takes an exclusive lock and SQLite does not wait for it (no busy
        handler): several processes opening one new store at once retry here, as the connection would."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self._conn.execute("pragma journal_mode=wal")
                return
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(0.02)

    def close(self) -> None:
        self._conn.close()

    def describe(self) -> str:
        return str(self.path)

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """A write transaction; SQLite's operational errors inside it (locked, I/O, disk full) leave as the
        store's retryable ``InfrastructureError``, so the consumer runtime retries the batch."""
        with _infrastructure_errors():
            if self._conn.in_transaction:  # inside a swap's transaction: nest
                self._conn.execute("savepoint write")
                try:
                    yield self._conn
                except BaseException:
                    self._conn.execute("rollback to savepoint write")
                    self._conn.execute("release savepoint write")
                    raise
                self._conn.execute("release savepoint write")
                return
            self._conn.execute("begin immediate")
            try:
                yield self._conn
            except BaseException:
                self._conn.execute("rollback")
                raise
            self._conn.execute("commit")

    @contextmanager
    def _snapshot(self) -> Iterator[sqlite3.Connection]:
        if self._conn.in_transaction:  # nested in a write or another snapshot: already consistent
            yield self._conn
            return
        self._conn.execute("begin")
        try:
            yield self._conn
        finally:
            self._conn.execute("commit")

    def _stream(self, db: Executor, sql: str) -> Iterator[tuple[Any, ...]]:
        cursor = db.execute(sql)
        while chunk := cursor.fetchmany(2000):
            yield from chunk

    def _is_data_error(self, exc: BaseException) -> bool:
        return isinstance(exc, (sqlite3.IntegrityError, sqlite3.DataError))

    def _plan(self, db: Executor, sql: str, params: tuple[Any, ...]) -> str:
        return "\n".join(str(row[3]) for row in db.execute(f"explain query plan {sql}", params).fetchall())

    def _layouts(self, db: Executor, schema: str = "main") -> list[TableLayout]:
        names = [r[0] for r in db.execute(f"select name from {schema}.sqlite_master where type = 'table'").fetchall()]
        columns: dict[str, list[str]] = {}
        keys: dict[str, list[str]] = {}
        text: dict[str, set[str]] = {}
        for name in names:
            # cid, name, type, notnull, default, pk (position in the primary key, 0 if not in it)
            info = db.execute(f"pragma {schema}.table_info({name})").fetchall()
            columns[name] = [str(r[1]) for r in info]
            keys[name] = [str(r[1]) for r in sorted((r for r in info if r[5]), key=lambda r: int(r[5]))]
            text[name] = {str(r[1]) for r in info if str(r[2]).lower() == "text"}
        return layouts_from_columns(columns, keys, text)

    def _order_term(self, column: str, text: bool) -> str:
        return f"{column} nulls first"  # BINARY collation: UTF-8 byte order, which is code point order

    def sibling(self, tag: str) -> SqliteStore:
        return SqliteStore(self.path.with_name(f"{self.path.name}.{tag}"), scratch=True)

    def staging_folder(self) -> Path:
        return self.path.parent  # beside the store: where its owner chose to have room for it

    def keys_only(self) -> None:
        """Drop every index that is not a key or unique, for a staging store: the row mapping finds rows by key,
        the other indexes serve queries a staging store never answers, and each event's updates would maintain
        them (a third of a replay's writing); the target builds them once a row as it loads. Unique ones stay:
        what they refuse is refused in staging as in the target."""
        with self._lock, self._write() as db:
            for table in self._layouts(db):
                # seq, name, unique, origin ('c': made by create index), partial
                for _seq, name, unique, origin, _partial in db.execute(f"pragma index_list({table.name})").fetchall():
                    if origin == "c" and not unique:
                        db.execute(f"drop index {name}")

    def load_staged(self, staged: Sequence[SqliteStore]) -> None:
        """Each staging store attached in turn and copied in SQL, a transaction each (SQLite attaches outside
        a transaction only). The staging stores' task ids are disjoint (checked before), so no key collides."""
        with self._lock:
            for other in staged:
                alias = f"staged_{uuid.uuid4().hex[:8]}"
                self._conn.execute(f"attach database ? as {alias}", (str(other.path),))
                try:
                    with self._write() as db:
                        for table in self._layouts(db, alias):
                            if table.name not in BOOKKEEPING:
                                columns = ", ".join(table.columns)
                                db.execute(f"insert into main.{table.name} ({columns}) "
                                           f"select {columns} from {alias}.{table.name}")
                finally:
                    self._conn.execute(f"detach database {alias}")

    def discard(self) -> None:
        self.close()
        for suffix in ("", "-wal", "-shm", "-journal"):
            Path(f"{self.path}{suffix}").unlink(missing_ok=True)

    def swap_in(self, fresh: Store, topics: Sequence[str],
                catch_up: Callable[[dict[str, dict[int, int]]], None]) -> None:
        """Copy ``fresh`` into this file in one write transaction.

        Renaming a file over an SQLite database that other processes have open corrupts it (their WAL and
        locks belong to the old file), so the rows move instead: readers keep reading the old state (WAL)
        until the transaction commits, then see the new one; the projector waits for the write lock.
        """
        if not isinstance(fresh, SqliteStore):
            raise TypeError(f"cannot swap a {type(fresh).__name__} into an SQLite store")
        # Driven from the fresh store's connection: BEGIN IMMEDIATE there takes the write lock of every
        # attached file, so the live projector is held off while the catch-up writes into ``main``.
        live = f"live_{uuid.uuid4().hex[:8]}"
        conn = fresh._conn
        with fresh._lock:
            conn.execute(f"attach database ? as {live}", (str(self.path),))
            try:
                with fresh._write() as db:
                    catch_up({t: _offsets(db.execute(f"select partition, next_offset from {live}.offsets "
                                                     "where topic = ?", (t,))) for t in topics})
                    for table in fresh._layouts(db, live):
                        if table.name not in BOOKKEEPING:
                            db.execute(f"delete from {live}.{table.name}")
                            db.execute(f"insert into {live}.{table.name} select * from main.{table.name}")
            finally:
                conn.execute(f"detach database {live}")
        fresh.discard()


class _SqliteMigrator:
    dialect: Dialect = "sqlite"

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def execute(self, sql: str, params: tuple[Any, ...] = ()) -> Any:
        return self._conn.execute(sql, params)

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        self._conn.execute("begin immediate")
        try:
            yield
        except BaseException:
            self._conn.execute("rollback")
            raise
        self._conn.execute("commit")


@contextmanager
def _infrastructure_errors() -> Iterator[None]:
    """A locked or unreachable database is an infrastructure fault: retried, never dead-lettered. The error
    says so itself (``retryable``): the consumer runtime knows no database."""
    try:
        yield
    except sqlite3.OperationalError as exc:
        raise InfrastructureError(f"state store unavailable: {exc}") from exc
