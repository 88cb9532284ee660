"""How each event changes the projection's rows: the one place that maps the event model to tables.

Written against a DB-API connection with ``?`` placeholders so every backend shares it; it runs inside
the backend's transaction, together with the offset update.

A step row's ``attempt_id`` and ``complete_by`` are the lock and deadline of whichever attempt of the step
is in progress, forward or compensating, so the supervisor's one scan finds both; the compensation's own
attempt number, failures, calls and error have columns of their own. An attempt is ``queued`` (or
``compensation_queued``) until its agent takes it, with ``complete_by`` holding its start-by meanwhile; then
``processing`` (or ``compensating``) with the work deadline, and ``waited_ms`` says how long it waited. Bodies in
``task_history`` are the events as the log holds them: sealed fields stay sealed. An erased task's row says
when and by whom (``erased_at``, ``erased_by``): its sealed values no longer open anywhere. A task of a
workflow with a retention for sensitive data gets ``erase_due_at`` when it completes or is compensated.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

import orjson

from schemas.messages import (
    CompensationRetried,
    CompensationStarted,
    Event,
    MessageIgnored,
    OperatorAlert,
    OperatorCommandRefused,
    RetryBroughtForward,
    StepAccepted,
    StepCompensated,
    StepCompensationFailed,
    StepCompensationSkipped,
    StepCompensationStarted,
    StepFailed,
    StepResubmitted,
    StepRetryScheduled,
    StepStarted,
    StepSucceeded,
    TaskAccepted,
    TaskCompensated,
    TaskCompensationFailed,
    TaskCompleted,
    TaskDataErased,
    TaskFailed,
    TaskQuarantined,
    TaskRejected,
    TaskReleased,
)
from schemas.states import StepStatus, TaskStatus


class Executor(Protocol):
    def execute(self, sql: str, params: tuple[Any, ...] = ..., /) -> Any: ...


def ms(value: datetime) -> int:
    return int(value.timestamp() * 1000)


EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def exact_ms(value: datetime) -> int:
    """Epoch milliseconds, exactly, for query bounds a user typed (float seconds times 1000 can land a
    millisecond short); a time without an offset is UTC."""
    return ((value if value.tzinfo else value.replace(tzinfo=UTC)) - EPOCH) // timedelta(milliseconds=1)


def project(db: Executor, event: Event) -> None:
    at = ms(event.occurred_at)
    # pydantic's own JSON: the text ``orjson.dumps(model_dump(mode="json"))`` gave, byte for byte, for every value
    # an event can carry (JSON fields come off the log through orjson), without building the dict first.
    db.execute(
        "insert into task_history(task_id, sequence, event_type, occurred_at, body) values (?, ?, ?, ?, ?)",
        (event.task_id, event.sequence, type(event).__name__, at, event.model_dump_json()),
    )
    # The task row's changes the event makes, set together with its sequence and time in one statement.
    task_sets = ""
    task_values: tuple[Any, ...] = ()
    match event:
        case TaskAccepted() | TaskRejected():
            status = TaskStatus.ACCEPTED if isinstance(event, TaskAccepted) else TaskStatus.REJECTED
            error = event.reason if isinstance(event, TaskRejected) else None
            # A rejected task submitted again is admitted (or rejected) again: its row is updated. Any other
            # existing row makes the insert fail: a second admission is refused like any constraint breach.
            # No row count is read (PostgreSQL pipelines a batch's statements): the insert skips the row the
            # update just made current.
            db.execute("update tasks set status = ?, sequence = ?, updated_at = ?, error = ?, submitter = ? "
                       "where task_id = ? and status = ?",
                       (status, event.sequence, at, error, event.submitter, event.task_id, TaskStatus.REJECTED))
            db.execute(
                "insert into tasks(task_id, workflow, workflow_version, status, sequence, failure_count, "
                "created_at, updated_at, error, submitter) select ?, ?, ?, ?, ?, 0, ?, ?, ?, ? where not exists "
                "(select 1 from tasks where task_id = ? and sequence = ? and updated_at = ?)",
                (event.task_id, event.workflow, event.workflow_version, status, event.sequence, at, at, error,
                 event.submitter, event.task_id, event.sequence, at),
            )
            if isinstance(event, TaskAccepted) and event.retention_s is not None:
                db.execute("update tasks set retention_ms = ? where task_id = ?",
                           (round(event.retention_s * 1000), event.task_id))
            return
        case StepStarted():
            step_status, deadline, start_by = _handed_over(event, StepStatus.QUEUED, StepStatus.PROCESSING)
            db.execute(
                "insert into steps(task_id, step, step_index, status, attempt, attempt_id, complete_by, "
                "failure_count, calls_used, updated_at, queued_at, start_by) "
                "values (?, ?, ?, ?, ?, ?, ?, 0, 0, ?, ?, ?) "
                "on conflict(task_id, step) do update set status = excluded.status, attempt = excluded.attempt, "
                "attempt_id = excluded.attempt_id, complete_by = excluded.complete_by, "
                "updated_at = excluded.updated_at, queued_at = excluded.queued_at, start_by = excluded.start_by, "
                "accepted_at = null, waited_ms = null, retry_at = null, wait_reason = null",
                (event.task_id, event.step, event.step_index, step_status, event.attempt, event.attempt_id,
                 deadline, at, at, start_by),
            )
            task_sets, task_values = ("status = ?, current_step = ?, retry_at = null, wait_reason = null, ",
                                      (TaskStatus.RUNNING, event.step))
        case StepAccepted():
            db.execute(
                "update steps set status = ?, complete_by = ?, accepted_at = ?, waited_ms = ?, updated_at = ? "
                "where task_id = ? and step = ?",
                (StepStatus.COMPENSATING if event.compensation else StepStatus.PROCESSING, ms(event.complete_by),
                 ms(event.accepted_at), event.waited_ms, at, event.task_id, event.step),
            )
        case StepSucceeded():
            db.execute(
                "update steps set status = ?, calls_used = calls_used + ?, error = null, "
                "updated_at = ? where task_id = ? and step = ?",
                (StepStatus.SUCCEEDED, event.calls, at, event.task_id, event.step),
            )
        case StepFailed():
            db.execute(
                "update steps set status = ?, failure_count = ?, calls_used = calls_used + ?, "
                "error = ?, updated_at = ? where task_id = ? and step = ?",
                (StepStatus.FAILED, event.failure_count, event.calls, event.error, at, event.task_id, event.step),
            )
            task_sets = "failure_count = failure_count + 1, "
        case TaskCompleted():
            task_sets, task_values = ("status = ?, current_step = null, erase_due_at = ? + retention_ms, ",
                                      (TaskStatus.COMPLETED, at))
        case TaskFailed():
            task_sets, task_values = "status = ?, error = ?, ", (TaskStatus.ERROR, _headline(event.step, event.reason))
        case OperatorAlert():
            db.execute("insert into alerts(task_id, step, reason, occurred_at) values (?, ?, ?, ?)",
                       (event.task_id, event.step, event.reason, at))
        case StepResubmitted():
            db.execute("update steps set failure_count = 0, calls_used = 0, updated_at = ? where task_id = ? "
                       "and step = ?", (at, event.task_id, event.step))
            task_sets, task_values = "status = ?, error = null, ", (TaskStatus.RUNNING,)
        case CompensationStarted():
            # An operator's compensation of a task in error keeps the error that put it there.
            error = None if event.trigger == "operator" else _headline(event.step, event.reason)
            task_sets, task_values = ("status = ?, current_step = null, error = coalesce(?, error), retry_at = null, "
                                      "wait_reason = null, ", (TaskStatus.COMPENSATING, error))
            # A forward retry still waiting never runs: its step is a failed one to undo (as the decider has it).
            db.execute("update steps set status = ?, retry_at = null, wait_reason = null "
                       "where task_id = ? and status = ?", (StepStatus.FAILED, event.task_id, StepStatus.WAITING))
        case StepCompensationSkipped():
            db.execute("update steps set status = ?, updated_at = ? where task_id = ? and step = ?",
                       (StepStatus.COMPENSATION_SKIPPED, at, event.task_id, event.step))
        case StepCompensationStarted():
            step_status, deadline, start_by = _handed_over(event, StepStatus.COMPENSATION_QUEUED,
                                                           StepStatus.COMPENSATING)
            db.execute(
                "update steps set status = ?, compensation_attempt = ?, attempt_id = ?, complete_by = ?, "
                "updated_at = ?, queued_at = ?, start_by = ?, accepted_at = null, waited_ms = null, retry_at = null, "
                "wait_reason = null where task_id = ? and step = ?",
                (step_status, event.attempt, event.attempt_id, deadline, at, at, start_by, event.task_id, event.step),
            )
            task_sets, task_values = "current_step = ?, retry_at = null, wait_reason = null, ", (event.step,)
        case StepCompensated():
            db.execute(
                "update steps set status = ?, compensation_calls_used = compensation_calls_used + ?, "
                "compensation_error = null, updated_at = ? where task_id = ? and step = ?",
                (StepStatus.COMPENSATED, event.calls, at, event.task_id, event.step),
            )
        case StepCompensationFailed():
            db.execute(
                "update steps set status = ?, compensation_failure_count = ?, "
                "compensation_calls_used = compensation_calls_used + ?, compensation_error = ?, updated_at = ? "
                "where task_id = ? and step = ?",
                (StepStatus.COMPENSATION_FAILED, event.failure_count, event.calls, event.error, at, event.task_id,
                 event.step),
            )
        case CompensationRetried():
            db.execute("update steps set compensation_failure_count = 0, compensation_calls_used = 0, updated_at = ? "
                       "where task_id = ? and step = ?", (at, event.task_id, event.step))
            # The failed compensation is being retried: the headline goes back to why the task is undone.
            task_sets, task_values = "status = ?, error = ?, ", (TaskStatus.COMPENSATING,
                                                                  _compensation_cause(db, event.task_id))
        case TaskCompensated():
            task_sets, task_values = ("status = ?, current_step = null, erase_due_at = ? + retention_ms, ",
                                      (TaskStatus.COMPENSATED, at))
        case TaskCompensationFailed():
            task_sets, task_values = ("status = ?, current_step = null, error = ?, ",
                                      (TaskStatus.COMPENSATION_FAILED, _headline(event.step, event.reason)))
        case StepRetryScheduled():
            retry_at = ms(event.not_before)
            db.execute("update steps set status = ?, retry_at = ?, wait_reason = ?, updated_at = ? "
                       "where task_id = ? and step = ?",
                       (StepStatus.WAITING, retry_at, event.reason, at, event.task_id, event.step))
            # A forward wait is the task's state; an undo's leaves it compensating, with when and why it waits.
            task_sets, task_values = ("status = case when ? then status else ? end, current_step = null, "
                                      "retry_at = ?, wait_reason = ?, ",
                                      (event.compensation, TaskStatus.WAITING, retry_at, event.reason))
        case RetryBroughtForward():
            db.execute("update steps set retry_at = ?, updated_at = ? where task_id = ? and step = ?",
                       (at, at, event.task_id, event.step))
            task_sets, task_values = "retry_at = ?, ", (at,)
        case TaskQuarantined():
            # Set aside by the scheduler (its history does not fold): no command runs until a release.
            task_sets, task_values = "status = ?, quarantine_reason = ?, ", (TaskStatus.QUARANTINED, event.reason)
        case TaskReleased():
            task_sets, task_values = "status = ?, quarantine_reason = null, ", (event.status,)
        case TaskDataErased():
            task_sets, task_values = "erased_at = ?, erased_by = ?, ", (at, event.operator or "an operator")
        case MessageIgnored() | OperatorCommandRefused():
            pass
    db.execute(f"update tasks set {task_sets}sequence = ?, updated_at = ? where task_id = ?",
               (*task_values, event.sequence, at, event.task_id))


def _handed_over(event: StepStarted | StepCompensationStarted, queued: StepStatus,
                 running: StepStatus) -> tuple[StepStatus, int, int | None]:
    """An attempt's status, deadline in force and start-by as it is handed over: queued until an agent takes
    it (its deadline the start-by), or running at once when the event predates acknowledgements."""
    if event.start_by is None:
        return running, ms(event.complete_by), None
    return queued, ms(event.start_by), ms(event.start_by)


def _headline(step: str | None, reason: str) -> str:
    """A task's ``error``: the reason, after the step it concerns."""
    return f"{step}: {reason}" if step else reason


def _compensation_cause(db: Executor, task_id: str) -> str | None:
    """Why the task is being compensated, from its history: the reason its compensation started with, or
    (an operator's compensation of a task in error) the failure that put it in error."""
    rows = db.execute("select event_type, body from task_history where task_id = ? and event_type in "
                      "('CompensationStarted', 'TaskFailed') order by sequence desc", (task_id,)).fetchall()
    for event_type, body in rows:
        data = orjson.loads(body)
        if event_type == "TaskFailed" or data.get("trigger") != "operator":
            return _headline(data.get("step"), data["reason"])
    return None
