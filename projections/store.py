"""The state store: tables the projector derives from ``events``, and the queries that read them.

Each event is applied in one database transaction together with the next offset of its partition, so
the store is exactly what a replay of the log up to those offsets gives: restart the projector, kill it
mid-batch, the rows and the offsets never disagree.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from eventstore.errors import InfrastructureError
from projections.migrations import migrate
from projections.rows import ms, project
from schemas.messages import Event


@dataclass(frozen=True)
class ExpiredStep:
    task_id: str
    step: str
    attempt_id: str
    complete_by_ms: int


class SqliteStore:
    """SQLite in WAL mode: one writer (the projector), any number of readers (supervisor, API)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._conn = sqlite3.connect(self.path, timeout=30, isolation_level=None, check_same_thread=False)
        self._conn.execute("pragma journal_mode=wal")
        self._conn.execute("pragma synchronous=normal")
        migrate(self._conn)

    def close(self) -> None:
        self._conn.close()

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        try:
            self._conn.execute("begin immediate")
        except sqlite3.OperationalError as exc:
            raise InfrastructureError(f"state store unavailable: {exc}") from exc
        try:
            yield self._conn
        except BaseException:
            self._conn.execute("rollback")
            raise
        self._conn.execute("commit")

    # -- writing ------------------------------------------------------------------------------

    def offsets(self, topic: str) -> dict[int, int]:
        rows = self._conn.execute("select partition, next_offset from offsets where topic = ?", (topic,))
        return {int(p): int(o) for p, o in rows}

    def apply(self, topic: str, partition: int, offset: int, event: Event) -> bool:
        """Apply one event and advance the partition's offset atomically. False if already applied."""
        with self._transaction() as db:
            row = db.execute("select next_offset from offsets where topic = ? and partition = ?",
                             (topic, partition)).fetchone()
            if row is not None and row[0] > offset:
                return False
            project(db, event)
            db.execute(
                "insert into offsets(topic, partition, next_offset) values (?, ?, ?) "
                "on conflict(topic, partition) do update set next_offset = excluded.next_offset",
                (topic, partition, offset + 1),
            )
        return True

    # -- reading ------------------------------------------------------------------------------

    def expired_steps(self, now: datetime, *, not_before: datetime, after: tuple[int, str, str] | None = None,
                      limit: int = 100) -> list[ExpiredStep]:
        """Steps in ``processing`` whose deadline passed, oldest first, one keyset page at a time.

        ``not_before`` bounds the window so a scan never walks the whole history; ``after`` is the last
        (complete_by, task_id, step) of the previous page.
        """
        start = after or (ms(not_before) - 1, "", "")
        rows = self._conn.execute(
            "select task_id, step, attempt_id, complete_by from steps "
            "where status = 'processing' and complete_by <= ? "
            "and (complete_by, task_id, step) > (?, ?, ?) "
            "order by complete_by, task_id, step limit ?",
            (ms(now), *start, limit),
        ).fetchall()
        return [ExpiredStep(t, s, a, c) for t, s, a, c in rows]

    def task(self, task_id: str) -> dict[str, Any] | None:
        row = self._conn.execute("select * from tasks where task_id = ?", (task_id,))
        found = _dicts(row)
        if not found:
            return None
        task = found[0]
        task["steps"] = _dicts(self._conn.execute(
            "select * from steps where task_id = ? order by step_index", (task_id,)))
        return task

    def counts_by_status(self) -> dict[str, int]:
        return {s: n for s, n in self._conn.execute("select status, count(*) from tasks group by status")}

    def history(self, task_id: str) -> list[dict[str, Any]]:
        return _dicts(self._conn.execute(
            "select sequence, event_type, occurred_at, body from task_history where task_id = ? order by sequence",
            (task_id,)))

    def alerts(self, limit: int = 100) -> list[dict[str, Any]]:
        return _dicts(self._conn.execute("select * from alerts order by id desc limit ?", (limit,)))


def _dicts(cursor: sqlite3.Cursor) -> list[dict[str, Any]]:
    names = [d[0] for d in cursor.description]
    return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]
