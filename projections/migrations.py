"""Versioned schema migrations of the state store, shared by every backend, applied in order at open.

Each entry runs once per store (its version is recorded in ``schema_migrations``, in the same
transaction as its statements). Entries are written in SQLite's dialect and translated for PostgreSQL
by ``statements``, which handles the differences explicitly and nothing else:

* ``integer primary key autoincrement`` (SQLite's rowid alias) becomes a ``bigint`` identity column;
* ``integer`` becomes ``bigint``: SQLite integers are 64-bit, PostgreSQL's ``integer`` is 32-bit and
  epoch milliseconds overflow it.

An entry that cannot be written portably gives each dialect its own script instead:
``(n, {"sqlite": "...", "postgresql": "..."})``. Append new entries; never edit or reorder old ones.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any, Literal, Protocol

Dialect = Literal["sqlite", "postgresql"]
DEFAULT_SCHEMA = "stepstream"  # the PostgreSQL schema of the store's tables, unless its URL says ``?schema=``
Script = str | Mapping[Dialect, str]

MIGRATIONS: tuple[tuple[int, Script], ...] = (
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
    (2, """
        -- dashboard: tasks newest first, keyset-paginated, optionally by state (by workflow: filtered, few
        -- workflows). Every task row changes with each of its events, and an update that changes an indexed
        -- column writes to every index of the table: the by-state index now orders by creation instead of
        -- adding one more index beside it.
        drop index tasks_by_status;
        create index tasks_by_created on tasks (created_at, task_id);
        create index tasks_by_status_created on tasks (status, created_at, task_id);
        -- dashboard: failed steps, most recent first (partial: only failed rows are in it)
        create index steps_failed on steps (updated_at, task_id, step)
            where status in ('failed', 'compensation_failed');
        -- dashboard: events per minute
        create index task_history_by_time on task_history (occurred_at);
        -- one row per dead letter on the dlq topic, and whether an operator replayed it
        create table dlq_entries (
            partition integer not null,
            dlq_offset integer not null,
            message_key text,
            origin_topic text,
            origin_partition integer,
            origin_offset integer,
            consumer_group text,
            reason text,
            error_class text,
            error_kind text,
            message_type text,
            size integer not null,
            dead_at integer not null,
            replayed_at integer,
            replayed_to text,
            primary key (partition, dlq_offset)
        );
        create index dlq_by_time on dlq_entries (dead_at, partition, dlq_offset);
        -- events the row mapping refused (a constraint broke): kept, so replays refuse them alike
        create table projection_errors (
            topic text not null,
            partition integer not null,
            event_offset integer not null,
            task_id text,
            event_type text,
            error text not null,
            primary key (topic, partition, event_offset)
        );
    """),
    (3, """
        -- compensation of a step: its own attempts, failures, calls and last error; attempt_id and
        -- complete_by hold the lock and deadline of whichever attempt is in progress, forward or compensating
        alter table steps add column compensation_attempt integer not null default 0;
        alter table steps add column compensation_failure_count integer not null default 0;
        alter table steps add column compensation_calls_used integer not null default 0;
        alter table steps add column compensation_error text;
        -- the supervisor's scan: steps with an attempt in progress (forward or compensating) by deadline,
        -- one ordered range, keyset-paginated
        create index steps_leased on steps (complete_by, task_id, step) where status in ('processing', 'compensating');
    """),
    (4, """
        -- an attempt waits for an agent (queued, or compensation_queued) until one takes it: when it was handed
        -- over, by when it must be taken, when it was, and how long it waited (of the step's last attempt,
        -- forward or compensating). complete_by is the deadline in force: start_by while queued.
        alter table steps add column queued_at integer;
        alter table steps add column start_by integer;
        alter table steps add column accepted_at integer;
        alter table steps add column waited_ms integer;
        -- the supervisor's scan covers queued attempts too (recovered after their start-by)
        drop index steps_leased;
        create index steps_leased on steps (complete_by, task_id, step)
            where status in ('queued', 'processing', 'compensation_queued', 'compensating');
    """),
    (5, """
        -- a step waits for a timer before its next attempt (status waiting, forward or of its undo): when the
        -- attempt may start and why it waits; the task shows the same (a forward wait makes it waiting)
        alter table steps add column retry_at integer;
        alter table steps add column wait_reason text;
        alter table tasks add column retry_at integer;
        alter table tasks add column wait_reason text;
        -- dashboard: waiting steps, soonest retry first (partial: only waiting rows are in it)
        create index steps_waiting on steps (retry_at, task_id, step) where status = 'waiting';
    """),
    (6, """
        -- a task whose history the scheduler cannot fold is 'quarantined' until an operator releases it: why
        alter table tasks add column quarantine_reason text;
    """),
    (7, """
        -- crypto-shredding: when the task's data key was deleted and by whom (an operator, or retention);
        -- its sealed values stay in task_history as they are, and open nowhere
        alter table tasks add column erased_at integer;
        alter table tasks add column erased_by text;
        -- retention: how long a finished task's sensitive data is kept (its workflow's), and when it is due
        alter table tasks add column retention_ms integer;
        alter table tasks add column erase_due_at integer;
        -- the supervisor's retention sweep: tasks due and not erased yet, soonest first
        create index tasks_erase_due on tasks (erase_due_at, task_id)
            where erase_due_at is not null and erased_at is null;
    """),
    (8, {
        # The console's task list: who submitted a task (rows projected before this version say nothing until a
        # rebuild), and indexes for its filters, newest first. Workflow, version and submitter never change once a
        # task is admitted, so these indexes cost the projector one write per task, not one per event. The search
        # by task id prefix is a range of the primary key in SQLite (byte order); PostgreSQL's primary key follows
        # the database's collation, where a prefix is not one range, so it gets an index in code-point order.
        "sqlite": """
            alter table tasks add column submitter text;
            create index tasks_by_workflow_created on tasks (workflow, workflow_version, created_at, task_id);
            create index tasks_by_submitter_created on tasks (submitter, created_at, task_id);
        """,
        "postgresql": """
            alter table tasks add column submitter text;
            create index tasks_by_workflow_created on tasks (workflow, workflow_version, created_at, task_id);
            create index tasks_by_submitter_created on tasks (submitter, created_at, task_id);
            create index tasks_by_id_code_points on tasks (task_id collate "C");
        """}),
    (9, """
        -- a dead letter an operator discarded (never to be replayed), and the proposed data key it shredded
        alter table dlq_entries add column discarded_at integer;
        alter table dlq_entries add column discard_shredded text;
    """),
)



_AUTOINCREMENT = re.compile(r"\binteger\s+primary\s+key\s+autoincrement\b", re.IGNORECASE)
_INTEGER = re.compile(r"\binteger\b", re.IGNORECASE)
_COMMENT = re.compile(r"--[^\n]*")


def statements(script: Script, dialect: Dialect) -> list[str]:
    """The statements of one migration in ``dialect``, in order."""
    if isinstance(script, Mapping):
        text = script[dialect]
    elif dialect == "postgresql":
        text = _INTEGER.sub("bigint", _AUTOINCREMENT.sub("bigint generated by default as identity primary key",
                                                         script))
    else:
        text = script
    # Comments go first: a ";" inside one would otherwise split a statement.
    return [s.strip() for s in _COMMENT.sub("", text).split(";") if s.strip()]


class MigrationTarget(Protocol):
    """What ``migrate`` needs from a backend: its dialect, statements, and a migrators-only transaction."""

    @property
    def dialect(self) -> Dialect: ...

    def execute(self, sql: str, params: tuple[Any, ...] = ..., /) -> Any: ...

    def exclusive(self) -> AbstractContextManager[None]:
        """A transaction that one migrator at a time can be in (commits on exit, rolls back on error)."""
        ...


def migrate(db: MigrationTarget) -> int:
    """Bring the store to the newest version; returns it. Safe to call from several processes at once."""
    with db.exclusive():  # concurrent "create table if not exists" can collide in PostgreSQL's catalog
        for statement in statements("create table if not exists schema_migrations "
                                    "(version integer primary key, applied_at integer)", db.dialect):
            db.execute(statement)
    current = int(db.execute("select coalesce(max(version), 0) from schema_migrations").fetchone()[0])
    for version, script in MIGRATIONS:
        if version <= current:
            continue
        with db.exclusive():
            # Another process may have applied it while this one waited for the lock.
            if db.execute("select 1 from schema_migrations where version = ?", (version,)).fetchone() is None:
                for statement in statements(script, db.dialect):
                    db.execute(statement)
                db.execute("insert into schema_migrations values (?, ?)", (version, int(time.time())))
        current = version
    return current
