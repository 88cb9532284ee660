"""``stepstream submit``, ``stepstream status`` and ``stepstream tasks``: the submission path for people
and scripts.

Exit codes scripts can rely on: 0 done (submitted, or completed with --wait), 2 invalid input (an unknown
workflow or version included, or one no running scheduler runs: nothing is produced), 3 no such task, 4 the
task ended without completing, 5 rejected by the scheduler (admission control, a workflow version it does
not run, an input it refuses), 6 refused as a contradiction (the task id exists with other data; the existing
task is untouched), 124 --wait timed out.

``stepstream tasks`` lists tasks from the state store, newest first (by creation): a table for people, or
with ``--json`` one JSON object per line (the store's row, times in epoch milliseconds) and nothing else on
stdout. Its exit codes: 0 listed (an empty list too, and a store no projector has created yet), 2 invalid
arguments (an unknown ``--state``, a ``--limit`` below 1, a time that is not ISO 8601, ``--until`` not
after ``--since``), 1 the state store could not be read.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
from pydantic import ValidationError

from projections.rows import EPOCH, exact_ms
from scheduler.settings import SchedulerSettings, WorkflowsUnloadable
from schemas.states import TaskStatus
from stepstream.client import Client, InvalidSubmission, SubmissionContradicts, SubmissionRejected, TaskWaitTimeout

if TYPE_CHECKING:
    from projections.store import Store

EXIT_INVALID, EXIT_NOT_FOUND, EXIT_NOT_COMPLETED, EXIT_REJECTED, EXIT_CONTRADICTION, EXIT_TIMEOUT = 2, 3, 4, 5, 6, 124

# The task states, as ``/api/tasks?state=`` accepts them and in its order.
TASK_STATES: tuple[str, ...] = tuple(status.value for status in TaskStatus)  # plain: argparse shows their repr
ERROR_WIDTH = 60
AGENTS_CHECK_S = 2.0  # how long status waits for the broker to say which agents run, before answering without


def add_parsers(commands: Any) -> None:
    submit = commands.add_parser(
        "submit", help="submit a task", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Submit a task. Exit codes: 0 submitted (with --wait: completed), 2 invalid input (unknown "
                    "workflow or version included), 4 ended without completing, 5 rejected by the scheduler (admission "
                    "control, a version it does not run, an input it refuses), "
                    "6 refused as a contradiction, 124 --wait timed out, 69 no Kafka cluster answered.",
        epilog=_workflows_help())
    submit.add_argument("workflow")
    submit.add_argument("--input", required=True, help="a JSON object, or @file holding one")
    submit.add_argument("--task-id", default=None, help="idempotency key (default: a new id)")
    submit.add_argument("--version", type=int, default=None, help="workflow version (default: latest)")
    submit.add_argument("--submitter", default=None, help="name whose private reply topic gets progress")
    submit.add_argument("--await-version", type=float, default=0.0, metavar="SECONDS",
                        help="when no running scheduler runs the workflow version yet (a rollout under way), wait "
                             "this long for one to start instead of refusing at once")
    submit.add_argument("--wait", action="store_true", help="wait until the task ends")
    submit.add_argument("--timeout", type=float, default=120.0, help="seconds --wait waits")
    submit.add_argument("--json", action="store_true", help="machine-readable output")
    submit.set_defaults(func=_submit)

    status = commands.add_parser("status", help="show a task and its steps (and which wait on an agent nobody runs)")
    status.add_argument("task_id")
    status.add_argument("--json", action="store_true")
    status.set_defaults(func=_status)

    tasks = commands.add_parser(
        "tasks", help="list tasks from the state store, newest first",
        description="List tasks from the state store, newest first (by creation time). Exit codes: 0 listed "
                    "(also when none match, or no projector has created the store yet), 2 invalid arguments, "
                    "1 the store could not be read.")
    tasks.add_argument("--state", action="append", choices=TASK_STATES, metavar="STATE",
                       help=f"only tasks in this state; repeat for any of several ({', '.join(TASK_STATES)})")
    tasks.add_argument("--workflow", type=_nonempty, default=None, help="only tasks of this workflow")
    tasks.add_argument("--since", type=_instant, default=None, metavar="ISO",
                       help="created at or after this time (ISO 8601; without an offset it is UTC)")
    tasks.add_argument("--until", type=_instant, default=None, metavar="ISO",
                       help="created before this time (ISO 8601; without an offset it is UTC)")
    tasks.add_argument("--limit", type=_positive, default=50, metavar="N",
                       help="show at most N tasks (default 50); with --all, read N at a time")
    tasks.add_argument("--all", action="store_true", help="every matching task, however many")
    tasks.add_argument("--json", action="store_true",
                       help="one JSON object per line (JSON Lines), nothing else on stdout")
    tasks.set_defaults(func=_tasks)


def _workflows_help() -> str:
    """The workflows this deployment runs and their inputs (the registry STEPSTREAM_SCHEDULER_WORKFLOWS names)."""
    try:
        lines = SchedulerSettings().load_registry().describe_inputs()
    except (ValidationError, WorkflowsUnloadable) as exc:  # every command builds this parser:
        return f"workflows: cannot load STEPSTREAM_SCHEDULER_WORKFLOWS: {exc}"  # say what is wrong, do not fail
    return ("workflows and their --input (a sealed field is encrypted here, before it is sent, and opened only by "
            "the steps that need it):\n" + "\n".join(f"  {line}" for line in lines))


def _nonempty(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _instant(text: str) -> int:
    """An ISO 8601 time as epoch milliseconds, exactly; a time without an offset is UTC."""
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an ISO 8601 time: {text!r}") from None
    return exact_ms(value)


def _read_input(raw: str) -> Any:
    try:
        text = Path(raw[1:]).read_bytes() if raw.startswith("@") else raw.encode()
    except OSError as exc:
        raise InvalidSubmission("input", f"cannot read {raw[1:]}: {exc.strerror or exc}") from None
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise InvalidSubmission("input", f"not valid JSON: {exc}") from None


def _print(task: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(orjson.dumps(task).decode())
        return
    print(f"{task['task_id']}: {task['status']} ({task['workflow']} v{task['workflow_version']})"
          + (f" — {task['error']}" if task.get("error") else ""))
    if task.get("erased_at") is not None:
        print(f"  data erased at {_iso(task['erased_at'])} by {task.get('erased_by') or 'an operator'}: "
              "its data key is deleted, its sensitive values open nowhere")
    unattended = {entry["step"]: entry["reason"] for entry in task.get("unattended") or []}
    for step in task.get("steps", []):
        notes = [note for note in (step.get("error"), unattended.get(step["step"])) if note]
        print(f"  {step['step']}: {step['status']}, attempt {step['attempt']}, failures {step['failure_count']}"
              + "".join(f" — {note}" for note in notes))


def _unattended(task: dict[str, Any]) -> list[dict[str, str]]:
    """Its steps in progress whose agent has no process running (``stepstream.presence``); none when the
    broker does not answer within a few seconds: status still answers from the store."""
    from eventstore.kafka_config import check_reachable
    from eventstore.settings import KafkaSettings
    from eventstore.topics import TopicLayout
    from stepstream.presence import Presence

    try:
        kafka = KafkaSettings()
        bootstrap = kafka.resolved_bootstrap()
        check_reachable(bootstrap, AGENTS_CHECK_S, "agents check")  # quiet: librdkafka would log each refusal
        presence = Presence.of(SchedulerSettings().load_registry(), bootstrap, TopicLayout.from_settings(kafka),
                               timeout_s=AGENTS_CHECK_S)
        return presence.unattended(task)
    except Exception:  # no broker, or workflows that do not load: the store's answer stands alone
        return []


def _submit(args: argparse.Namespace) -> int:
    try:
        data = _read_input(args.input)
        with Client(submitter=args.submitter) as client:
            task_id = client.submit(args.workflow, data, version=args.version, task_id=args.task_id,
                                    await_version_s=args.await_version)
            if not args.wait:  # (with --wait, the task's line names the version it ran under)
                pinned = client.pinned_versions(args.workflow, args.version)
                said = f"{args.workflow} v{' or v'.join(map(str, pinned))}" + (
                    "" if args.version is not None else ", the latest")
                print(orjson.dumps({"task_id": task_id, "workflow_version": pinned[0] if len(pinned) == 1
                                    else None}).decode() if args.json else f"submitted {task_id} ({said})")
                return 0
            task = client.wait(task_id, timeout_s=args.timeout)
    except InvalidSubmission as exc:
        print(f"stepstream submit: invalid {exc}", file=sys.stderr)
        return EXIT_INVALID
    except SubmissionContradicts as exc:
        print(f"stepstream submit: refused as a contradiction: {exc}", file=sys.stderr)
        return EXIT_CONTRADICTION
    except SubmissionRejected as exc:
        print(f"stepstream submit: {exc}", file=sys.stderr)
        return EXIT_REJECTED
    except TaskWaitTimeout as exc:
        print(f"stepstream submit: --wait timed out: {exc}", file=sys.stderr)
        return EXIT_TIMEOUT
    _print(dict(task.row), args.json)
    return 0 if task.completed else EXIT_NOT_COMPLETED


def _status(args: argparse.Namespace) -> int:
    """Reads the state store only: it answers with the broker down."""
    store = _open_store("status")
    if store is None:
        return EXIT_NOT_FOUND
    try:
        task = store.task(args.task_id)
    finally:
        store.close()
    if task is None:
        print(f"stepstream status: no task {args.task_id!r} in the state store", file=sys.stderr)
        return EXIT_NOT_FOUND
    _print({**task, "unattended": _unattended(task)}, args.json)
    return 0


@dataclass(frozen=True)
class TaskFilter:
    """What ``stepstream tasks`` lists: ``states`` empty means any state."""

    states: tuple[str, ...] = ()
    workflow: str | None = None
    since_ms: int | None = None
    until_ms: int | None = None


def _newest_first(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # One row per task: a task that moved between two states' queries may be in both answers.
    unique = {row["task_id"]: row for row in rows}
    return sorted(unique.values(), key=lambda row: (row["created_at"], row["task_id"]), reverse=True)


def _newest(store: Store, wanted: TaskFilter, until_ms: int | None, limit: int) -> list[dict[str, Any]]:
    """The newest ``limit`` tasks of each state created before ``until_ms``, merged newest first."""
    rows: list[dict[str, Any]] = []
    for state in wanted.states or (None,):
        rows += store.tasks(state=state, workflow=wanted.workflow, since_ms=wanted.since_ms, until_ms=until_ms,
                            limit=limit)
    return _newest_first(rows)


def _created_in(store: Store, wanted: TaskFilter, at_ms: int, chunk: int) -> list[dict[str, Any]]:
    """Every matching task created in the millisecond ``at_ms`` (each state paged by the store's own keyset)."""
    rows: list[dict[str, Any]] = []
    for state in wanted.states or (None,):
        before: tuple[int, str] | None = None
        while True:
            page = store.tasks(state=state, workflow=wanted.workflow, since_ms=at_ms, until_ms=at_ms + 1,
                               before=before, limit=chunk)
            rows += page
            if len(page) < chunk:
                break
            before = (at_ms, page[-1]["task_id"])
    return rows


def first_tasks(store: Store, wanted: TaskFilter, limit: int) -> tuple[list[dict[str, Any]], bool]:
    """The newest ``limit`` matching tasks, and whether more match."""
    rows = _newest(store, wanted, wanted.until_ms, limit + 1)
    return rows[:limit], len(rows) > limit


def all_tasks(store: Store, wanted: TaskFilter, size: int) -> Iterator[list[dict[str, Any]]]:
    """Every matching task once, newest first, in pages of about ``size``.

    The store pages by (created_at, task_id), but several states are several queries whose task ids only
    the database orders (PostgreSQL's collation need not be Python's). So a page ends after a whole
    millisecond of creation times, and the next page asks for tasks created before it: creation times
    never change, so no task is listed twice or skipped. A page grows past ``size`` by the tasks that
    share its last millisecond.
    """
    until_ms = wanted.until_ms
    while True:
        rows = _newest(store, wanted, until_ms, size + 1)
        if len(rows) <= size:  # every state answered fewer than it was asked for: nothing is left
            if rows:
                yield rows
            return
        # Each state that answered in full ends at or before ``last``, so it gave every task newer than that.
        last = rows[size - 1]["created_at"]
        yield _newest_first([r for r in rows if r["created_at"] > last] + _created_in(store, wanted, last, size))
        until_ms = last


def _open_store(command: str, *, quiet: bool = False) -> Store | None:
    """The configured state store; None (said on stderr unless ``quiet``) when it is an SQLite file no
    projector has created yet: opening it would create an empty one, answering every question with "none"."""
    from eventstore.settings import KafkaSettings
    from projections.settings import StoreSettings

    spec = StoreSettings().spec(KafkaSettings().home)
    if spec.kind == "sqlite" and not Path(spec.location).exists():
        if not quiet:
            print(f"stepstream {command}: no state store at {spec.location} yet (has the projector run?)",
                  file=sys.stderr)
        return None
    return spec.open()


def _iso(epoch_ms: int | None) -> str:
    if epoch_ms is None:
        return ""
    return (EPOCH + timedelta(milliseconds=epoch_ms)).strftime("%Y-%m-%dT%H:%M:%SZ")


def _clip(text: str | None, width: int = ERROR_WIDTH) -> str:
    if not text:
        return ""
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[:width - 1] + "…"


STATUS_STYLES: dict[TaskStatus, str] = {
    TaskStatus.COMPLETED: "green", TaskStatus.ERROR: "red", TaskStatus.COMPENSATION_FAILED: "bold red",
    TaskStatus.REJECTED: "red", TaskStatus.COMPENSATING: "yellow", TaskStatus.COMPENSATED: "yellow",
    TaskStatus.RUNNING: "cyan", TaskStatus.WAITING: "magenta", TaskStatus.QUARANTINED: "bold magenta",
}


def _table(rows: Sequence[dict[str, Any]], more: bool) -> None:
    from rich.table import Table
    from rich.text import Text

    from eventstore.console import command_console

    console = command_console()
    if rows:
        table = Table(box=None, header_style="bold", pad_edge=False)
        for name in ("task", "workflow", "status", "created (UTC)", "updated (UTC)", "error"):
            table.add_column(name, no_wrap=name != "error", overflow="fold")
        for row in rows:
            # Text, not str: ids and errors are data, never rich markup.
            table.add_row(Text(row["task_id"]), Text(f"{row['workflow']} v{row['workflow_version']}"),
                          Text(row["status"], style=STATUS_STYLES.get(row["status"], "")),
                          Text(_iso(row["created_at"])), Text(_iso(row["updated_at"])), Text(_clip(row["error"])))
        console.print(table)
    console.print(Text(f"{len(rows)} task{'' if len(rows) == 1 else 's'}"
                       + (" (more match: raise --limit, or list them all with --all)" if more else "")))


def _tasks(args: argparse.Namespace) -> int:
    if args.since is not None and args.until is not None and args.until <= args.since:
        print("stepstream tasks: argument --until: must be after --since", file=sys.stderr)
        return EXIT_INVALID
    wanted = TaskFilter(tuple(dict.fromkeys(args.state or ())), args.workflow, args.since, args.until)
    store = _open_store("tasks", quiet=args.json)
    try:
        if args.all:
            pages: Iterator[list[dict[str, Any]]] = all_tasks(store, wanted, args.limit) if store else iter(())
            if args.json:
                for page in pages:
                    sys.stdout.write("".join(orjson.dumps(row).decode() + "\n" for row in page))
                    sys.stdout.flush()
            else:
                _table([row for page in pages for row in page], more=False)
            return 0
        rows, more = first_tasks(store, wanted, args.limit) if store else ([], False)
        if args.json:
            sys.stdout.write("".join(orjson.dumps(row).decode() + "\n" for row in rows))
        else:
            _table(rows, more)
        return 0
    except BrokenPipeError:  # the reader stopped (``| head``): not an error; keep Python from reporting it
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    finally:
        if store is not None:
            store.close()
