"""How each event changes the projection's rows: the one place that maps the event model to tables.

Written against a DB-API connection with ``?`` placeholders so every backend shares it; it runs inside
the backend's transaction, together with the offset update.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Protocol

import orjson

from schemas.messages import (
    Event,
    MessageIgnored,
    OperatorAlert,
    StepFailed,
    StepStarted,
    StepSucceeded,
    TaskAccepted,
    TaskCompleted,
    TaskFailed,
    TaskRejected,
)


class Executor(Protocol):
    def execute(self, sql: str, params: tuple[Any, ...] = ..., /) -> Any: ...


def ms(value: datetime) -> int:
    return int(value.timestamp() * 1000)


def project(db: Executor, event: Event) -> None:
    at = ms(event.occurred_at)
    db.execute(
        "insert into task_history(task_id, sequence, event_type, occurred_at, body) values (?, ?, ?, ?, ?)",
        (event.task_id, event.sequence, type(event).__name__, at,
         orjson.dumps(event.model_dump(mode="json")).decode()),
    )
    task_update = "update tasks set sequence = ?, updated_at = ? where task_id = ?"
    match event:
        case TaskAccepted() | TaskRejected():
            status = "accepted" if isinstance(event, TaskAccepted) else "rejected"
            db.execute(
                "insert into tasks(task_id, workflow, workflow_version, status, sequence, failure_count, "
                "created_at, updated_at, error) values (?, ?, ?, ?, ?, 0, ?, ?, ?)",
                (event.task_id, event.workflow, event.workflow_version, status, event.sequence, at, at,
                 event.reason if isinstance(event, TaskRejected) else None),
            )
            return
        case StepStarted():
            db.execute(
                "insert into steps(task_id, step, step_index, status, attempt, attempt_id, complete_by, "
                "failure_count, calls_used, updated_at) values (?, ?, ?, 'processing', ?, ?, ?, 0, 0, ?) "
                "on conflict(task_id, step) do update set status = 'processing', attempt = excluded.attempt, "
                "attempt_id = excluded.attempt_id, complete_by = excluded.complete_by, "
                "updated_at = excluded.updated_at",
                (event.task_id, event.step, event.step_index, event.attempt, event.attempt_id,
                 ms(event.complete_by), at),
            )
            db.execute("update tasks set status = 'running', current_step = ? where task_id = ?",
                       (event.step, event.task_id))
        case StepSucceeded():
            db.execute(
                "update steps set status = 'succeeded', calls_used = calls_used + ?, error = null, "
                "updated_at = ? where task_id = ? and step = ?",
                (event.calls, at, event.task_id, event.step),
            )
        case StepFailed():
            db.execute(
                "update steps set status = 'failed', failure_count = ?, calls_used = calls_used + ?, "
                "error = ?, updated_at = ? where task_id = ? and step = ?",
                (event.failure_count, event.calls, event.error, at, event.task_id, event.step),
            )
            db.execute("update tasks set failure_count = failure_count + 1 where task_id = ?", (event.task_id,))
        case TaskCompleted():
            db.execute("update tasks set status = 'completed', current_step = null where task_id = ?",
                       (event.task_id,))
        case TaskFailed():
            db.execute("update tasks set status = 'error', error = ? where task_id = ?",
                       (f"{event.step}: {event.reason}", event.task_id))
        case OperatorAlert():
            db.execute("insert into alerts(task_id, step, reason, occurred_at) values (?, ?, ?, ?)",
                       (event.task_id, event.step, event.reason, at))
        case MessageIgnored():
            pass
    db.execute(task_update, (event.sequence, at, event.task_id))
