"""Versioned schema migrations of the state store, applied in order at open; each runs once."""

from __future__ import annotations

import sqlite3
import time

MIGRATIONS: tuple[tuple[int, str], ...] = (
    (1, """
        create table tasks (
            task_id text primary key,
            workflow text not null,
            workflow_version integer not null,
            status text not null,
            sequence integer not null,
            current_step text,
            failure_count integer not null default 0,
            error text,
            created_at integer not null,
            updated_at integer not null
        );
        create index tasks_by_status on tasks (status, updated_at, task_id);
        create table steps (
            task_id text not null,
            step text not null,
            step_index integer not null,
            status text not null,
            attempt integer not null,
            attempt_id text,
            complete_by integer,
            failure_count integer not null default 0,
            calls_used integer not null default 0,
            error text,
            updated_at integer not null,
            primary key (task_id, step)
        );
        -- the supervisor's scan: processing steps by deadline, keyset-paginated
        create index steps_expiry on steps (status, complete_by, task_id, step);
        create table task_history (
            task_id text not null,
            sequence integer not null,
            event_type text not null,
            occurred_at integer not null,
            body text not null,
            primary key (task_id, sequence)
        );
        create table alerts (
            id integer primary key autoincrement,
            task_id text not null,
            step text,
            reason text not null,
            occurred_at integer not null
        );
        create table offsets (
            topic text not null,
            partition integer not null,
            next_offset integer not null,
            primary key (topic, partition)
        );
    """),
)


def migrate(conn: sqlite3.Connection) -> int:
    """Bring the database to the newest version; returns it. Safe to call from several processes."""
    conn.execute("create table if not exists schema_migrations (version integer primary key, applied_at integer)")
    current = conn.execute("select coalesce(max(version), 0) from schema_migrations").fetchone()[0]
    for version, script in MIGRATIONS:
        if version <= current:
            continue
        conn.execute("begin immediate")
        try:
            if conn.execute("select 1 from schema_migrations where version = ?", (version,)).fetchone():
                conn.execute("rollback")
                continue
            for statement in filter(str.strip, script.split(";")):
                conn.execute(statement)
            conn.execute("insert into schema_migrations values (?, ?)", (version, int(time.time())))
            conn.execute("commit")
        except BaseException:
            conn.execute("rollback")
            raise
        current = version
    return int(current)
