"""``stepstream submit`` and ``stepstream status``: the submission path for people and scripts.

Exit codes scripts can rely on: 0 done (submitted, or completed with --wait), 2 invalid input, 3 no such
task, 4 the task ended without completing, 5 rejected by admission control, 124 --wait timed out.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import orjson

from stepstream.client import Client, InvalidSubmission, SubmissionRejected, TaskWaitTimeout

EXIT_INVALID, EXIT_NOT_FOUND, EXIT_NOT_COMPLETED, EXIT_REJECTED, EXIT_TIMEOUT = 2, 3, 4, 5, 124


def add_parsers(commands: Any) -> None:
    submit = commands.add_parser("submit", help="submit a task")
    submit.add_argument("workflow")
    submit.add_argument("--input", required=True, help="a JSON object, or @file holding one")
    submit.add_argument("--task-id", default=None, help="idempotency key (default: a new id)")
    submit.add_argument("--version", type=int, default=None, help="workflow version (default: latest)")
    submit.add_argument("--submitter", default=None, help="name whose private reply topic gets progress")
    submit.add_argument("--wait", action="store_true", help="wait until the task ends")
    submit.add_argument("--timeout", type=float, default=120.0, help="seconds --wait waits")
    submit.add_argument("--json", action="store_true", help="machine-readable output")
    submit.set_defaults(func=_submit)

    status = commands.add_parser("status", help="show a task and its steps")
    status.add_argument("task_id")
    status.add_argument("--json", action="store_true")
    status.set_defaults(func=_status)


def _read_input(raw: str) -> Any:
    text = Path(raw[1:]).read_bytes() if raw.startswith("@") else raw.encode()
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
    for step in task.get("steps", []):
        print(f"  {step['step']}: {step['status']}, attempt {step['attempt']}, failures {step['failure_count']}"
              + (f" — {step['error']}" if step.get("error") else ""))


def _submit(args: argparse.Namespace) -> int:
    try:
        data = _read_input(args.input)
        with Client(submitter=args.submitter) as client:
            task_id = client.submit(args.workflow, data, version=args.version, task_id=args.task_id)
            if not args.wait:
                print(orjson.dumps({"task_id": task_id}).decode() if args.json else f"submitted {task_id}")
                return 0
            task = client.wait(task_id, timeout_s=args.timeout)
    except InvalidSubmission as exc:
        print(f"stepstream submit: invalid {exc}", file=sys.stderr)
        return EXIT_INVALID
    except OSError as exc:
        print(f"stepstream submit: cannot read --input: {exc}", file=sys.stderr)
        return EXIT_INVALID
    except SubmissionRejected as exc:
        print(f"stepstream submit: {exc}", file=sys.stderr)
        return EXIT_REJECTED
    except TaskWaitTimeout as exc:
        print(f"stepstream submit: {exc}", file=sys.stderr)
        return EXIT_TIMEOUT
    _print(task, args.json)
    return 0 if task["status"] == "completed" else EXIT_NOT_COMPLETED


def _status(args: argparse.Namespace) -> int:
    with Client() as client:
        task = client.status(args.task_id)
    if task is None:
        print(f"stepstream status: no task {args.task_id!r} in the state store", file=sys.stderr)
        return EXIT_NOT_FOUND
    _print(task, args.json)
    return 0
