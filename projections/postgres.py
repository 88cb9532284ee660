"""The PostgreSQL backend of the state store (psycopg 3), for production.

A store is one schema of a database (``search_path`` names it), so one database can hold several
(a live one, a rebuild's, a point-in-time copy). The SQL is the shared SQL of ``projections.store`` with
its ``?`` placeholders translated; the migrations are the shared ones in PostgreSQL's dialect.

Writers of a store serialize on a transaction-scoped advisory lock named after the schema, as SQLite's
``BEGIN IMMEDIATE`` serializes them: two projectors never interleave a partition, and a rebuild's swap
can hold the live projector off while it catches up.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
from psycopg import sql as pgsql

from eventstore.errors import InfrastructureError
from projections.migrations import DEFAULT_SCHEMA, Dialect, migrate
from projections.store import SqliteStore, StagingRefused, Store, TableLayout, layouts_from_columns


@functools.lru_cache(maxsize=512)
def _translate(sql: str) -> str:
    """``?`` placeholders to psycopg's ``%s`` (a literal ``%`` doubled first)."""
    return sql.replace("%", "%%").replace("?", "%s")


class _QmarkConnection:
    """The connection as the shared SQL sees it: DB-API ``execute`` with ``?`` placeholders.

    One cursor serves every statement (making one per statement costs more than many statements do);
    callers read a statement's rows before the next one, as the shared SQL does.
    """

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn
        self._cursor = conn.cursor()

    def execute(self, sql: str, params: tuple[Any, ...] = ()) -> psycopg.Cursor[Any]:
        return self._cursor.execute(_translate(sql), params)


class PostgresStore(Store):
    """One schema of a PostgreSQL database. ``scratch`` stores (a rebuild's) commit without waiting for
    the WAL flush: losing their last transactions in a crash costs nothing, they are rebuilt."""

    dialect = "postgresql"

    def __init__(self, url: str, schema: str = DEFAULT_SCHEMA, *, scratch: bool = False) -> None:
        super().__init__()
        self.url = url
        self.schema = schema
        self.scratch = scratch
        self._db = self._connect()
        migrate(_PostgresMigrator(self._db, schema))

    def _connect(self) -> _QmarkConnection:
        try:
            conn = psycopg.connect(self.url, autocommit=True)
        except psycopg.OperationalError as exc:
            raise InfrastructureError(f"state store unavailable: {exc}") from exc
        schema = pgsql.Identifier(self.schema)
        with conn.transaction():  # concurrent "create schema if not exists" can collide in the catalog
            conn.execute("select pg_advisory_xact_lock(hashtextextended(%s, 0))", (_migrate_lock(self.schema),))
            conn.execute(pgsql.SQL("create schema if not exists {}").format(schema))
        conn.execute(pgsql.SQL("set search_path to {}").format(schema))
        if self.scratch:
            conn.execute("set synchronous_commit = off")
        return _QmarkConnection(conn)

    def _connection(self) -> _QmarkConnection:
        """The connection, reopened if it was lost (the server restarted, the network dropped)."""
        if self._db.conn.closed or self._db.conn.broken:
            self._db = self._connect()
        return self._db

    def close(self) -> None:
        self._db.conn.close()

    def describe(self) -> str:
        parts = urlsplit(self.url)
        host = parts.hostname or ""
        netloc = f"{parts.username}@{host}" if parts.username else host
        if parts.port:
            netloc += f":{parts.port}"
        return f"{urlunsplit((parts.scheme, netloc, parts.path, '', ''))} schema {self.schema}"

    @contextmanager
    def _transaction(self) -> Iterator[_QmarkConnection]:
        try:
            db = self._connection()
            with db.conn.transaction():
                yield db
        except psycopg.OperationalError as exc:
            raise InfrastructureError(f"state store unavailable: {exc}") from exc

    @contextmanager
    def _write(self) -> Iterator[_QmarkConnection]:
        with self._transaction() as db:
            db.execute("select pg_advisory_xact_lock(hashtextextended(?, 0))", (_lock_name(self.schema),))
            yield db

    @contextmanager
    def _snapshot(self) -> Iterator[_QmarkConnection]:
        db = self._connection()
        if db.conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            yield db  # nested in another transaction: already consistent
            return
        with self._transaction() as db:
            db.execute("set transaction isolation level repeatable read, read only")
            yield db

    def _stream(self, db: Any, sql: str) -> Iterator[tuple[Any, ...]]:
        cursor = db.conn.cursor(name=f"stream_{uuid.uuid4().hex[:8]}")
        cursor.itersize = 2000
        try:
            cursor.execute(_translate(sql))
            yield from cursor
        finally:
            cursor.close()

    def _bulk(self, db: Any) -> AbstractContextManager[None]:
        pipeline: AbstractContextManager[None] = db.conn.pipeline()
        return pipeline

    def load_staged(self, staged: Sequence[SqliteStore]) -> None:
        """COPY every staged row in one transaction: a refused row (text SQLite takes and PostgreSQL does not,
        a NUL character) leaves the store empty as it was."""
        try:
            with self._lock, self._write() as db:
                for other in staged:
                    with other.snapshot() as view:
                        for table in view.tables():
                            columns = pgsql.SQL(", ").join(pgsql.Identifier(c) for c in table.columns)
                            statement = pgsql.SQL("copy {} ({}) from stdin").format(
                                pgsql.Identifier(table.name), columns)
                            with db.conn.cursor().copy(statement) as copy:
                                for row in view.rows(table):
                                    copy.write_row(row)
        except Exception as exc:
            if self._is_data_error(exc):
                raise StagingRefused(f"{self.describe()} refused a staged row: {exc}") from exc
            raise

    def _is_data_error(self, exc: BaseException) -> bool:
        return isinstance(exc, (psycopg.IntegrityError, psycopg.DataError))

    def _plan(self, db: Any, sql: str, params: tuple[Any, ...]) -> str:
        return "\n".join(str(row[0]) for row in db.execute(f"explain {sql}", params).fetchall())

    def _layouts(self, db: Any) -> list[TableLayout]:
        rows = db.execute(
            "select table_name, column_name, data_type from information_schema.columns "
            "where table_schema = current_schema() order by table_name, ordinal_position").fetchall()
        columns: dict[str, list[str]] = {}
        text: dict[str, set[str]] = {}
        for table, column, data_type in rows:
            columns.setdefault(table, []).append(column)
            if data_type == "text":
                text.setdefault(table, set()).add(column)
        keys: dict[str, list[str]] = {}
        for table, column in db.execute(
                "select tc.table_name, kcu.column_name from information_schema.table_constraints tc "
                "join information_schema.key_column_usage kcu on kcu.constraint_name = tc.constraint_name "
                "and kcu.table_schema = tc.table_schema "
                "where tc.table_schema = current_schema() and tc.constraint_type = 'PRIMARY KEY' "
                "order by tc.table_name, kcu.ordinal_position").fetchall():
            keys.setdefault(table, []).append(column)
        return layouts_from_columns(columns, keys, text)

    def _order_term(self, column: str, text: bool) -> str:
        return f'{column} collate "C" nulls first' if text else f"{column} nulls first"

    def _prefix_column(self, low: str, high: str | None) -> str:
        # the ``tasks_by_id_code_points`` index's expression (migration 8); the planner's statistics choose
        # between it and the creation order by themselves
        return 'task_id collate "C"'

    def sibling(self, tag: str) -> PostgresStore:
        return PostgresStore(self.url, f"{self.schema}_{tag}".replace("-", "_")[:63], scratch=True)

    def discard(self) -> None:
        with self._transaction() as db:
            db.conn.execute(pgsql.SQL("drop schema if exists {} cascade").format(pgsql.Identifier(self.schema)))
        self.close()

    def swap_in(self, fresh: Store, topics: Sequence[str],
                catch_up: Callable[[dict[str, dict[int, int]]], None]) -> None:
        """Rename schemas in one transaction: live to old, fresh to live, drop old.

        Sessions name tables through ``search_path``, so after the commit every statement resolves to
        the new tables (statements waiting on the old ones re-resolve once they get their lock). Dropping
        the old schema in the same transaction also invalidates every plan prepared against it.
        """
        if not isinstance(fresh, PostgresStore) or fresh.url != self.url:
            raise TypeError("a PostgreSQL store can only swap in a schema of the same database")
        old = f"{self.schema}_old_{uuid.uuid4().hex[:8]}"[:63]
        with self._lock, self._write() as db:
            catch_up({t: {int(p): int(o) for p, o in db.execute(
                "select partition, next_offset from offsets where topic = ?", (t,)).fetchall()} for t in topics})
            fresh.close()
            rename = pgsql.SQL("alter schema {} rename to {}")
            db.conn.execute(rename.format(pgsql.Identifier(self.schema), pgsql.Identifier(old)))
            db.conn.execute(rename.format(pgsql.Identifier(fresh.schema), pgsql.Identifier(self.schema)))
            db.conn.execute(pgsql.SQL("drop schema {} cascade").format(pgsql.Identifier(old)))


def _lock_name(schema: str) -> str:
    return f"stepstream.store:{schema}"


def _migrate_lock(schema: str) -> str:
    return f"stepstream.migrate:{schema}"


class _PostgresMigrator:
    dialect: Dialect = "postgresql"

    def __init__(self, db: _QmarkConnection, schema: str) -> None:
        self._db = db
        self._schema = schema

    def execute(self, sql: str, params: tuple[Any, ...] = ()) -> Any:
        return self._db.execute(sql, params)

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._db.conn.transaction():
            self._db.execute("select pg_advisory_xact_lock(hashtextextended(?, 0))", (_migrate_lock(self._schema),))
            yield
