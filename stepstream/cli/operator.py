"""``stepstream task resubmit|compensate|cancel|retry-compensation|try-now|release|erase TASK_ID``: operators
intervene on a task.

Each sub-command produces one ``OperatorCommand`` on ``inbox``, keyed by the task, under a command id the
operator may choose (``--command-id``): the scheduler answers a command id once, so a command sent again
after a timeout or a crash acts at most once. The scheduler decides, and records the outcome on
``events``: the transition the command caused (naming its command id), or ``OperatorCommandRefused`` with
the reason. With ``--wait`` this command reads ``events`` until that outcome appears and reports it.

- ``resubmit [--step S]``: a new attempt of the failed step of a task in ``error``, with a fresh budget,
  once the cause is fixed;
- ``compensate``: undo the completed steps of a task in ``error``;
- ``cancel``: stop a running task and undo what it completed (its attempt in flight is abandoned: a late
  answer changes nothing);
- ``retry-compensation [--step S]``: retry the failed compensation of a task in ``compensation_failed``;
- ``release``: let a ``quarantined`` task (its history did not fold) go on, once a scheduler version that
  folds it runs. Under a version that still cannot, the command is dead-lettered with the reason (and
  ``--wait`` times out).
- ``erase``: delete an ended task's data key (crypto-shredding): its sealed values open nowhere after, in
  any topic or store; the task can then be neither resubmitted nor compensated.

Exit codes: 0 sent (with ``--wait``: accepted), 3 no such task (nothing is sent), 6 refused, 124 ``--wait``
timed out.
Nothing printed comes from step outputs, so values marked sensitive never reach a terminal.
"""

from __future__ import annotations

import argparse
import getpass
from typing import Any

import orjson

from schemas.messages import OperatorAction, new_id
from stepstream.client import Client
from stepstream.client.outcomes import TaskEvents

EXIT_NOT_FOUND, EXIT_REFUSED, EXIT_TIMEOUT = 3, 6, 124
_ACTIONS: dict[OperatorAction, str] = {
    "resubmit": "run the failed step of a task in error again (after fixing its cause)",
    "compensate": "undo the completed steps of a task in error",
    "cancel": "stop a running task and undo what it completed",
    "retry-compensation": "retry the failed compensation of a task in compensation_failed",
    "try-now": "start the next attempt of a waiting step now instead of at its retry time",
    "release": "let a quarantined task go on, once a scheduler that folds its history runs",
    "erase": "delete an ended task's data key: its sealed input and outputs open nowhere after",
}
_TAKES_STEP: frozenset[OperatorAction] = frozenset({"resubmit", "retry-compensation", "try-now"})


def add_parsers(commands: Any) -> None:
    task = commands.add_parser("task", help="operator actions on one task")
    actions = task.add_subparsers(dest="action", required=True)
    for action, description in _ACTIONS.items():
        parser = actions.add_parser(action, help=description, description=description)
        parser.add_argument("task_id")
        if action in _TAKES_STEP:
            default = "the one waiting" if action == "try-now" else "the one that failed"
            parser.add_argument("--step", default=None, help=f"the step (default: {default})")
        parser.add_argument("--command-id", default=None,
                            help="idempotency key of this command (default: a new one); resend it to retry safely")
        parser.add_argument("--operator", default=None, help="who acts (default: the login name)")
        parser.add_argument("--wait", action="store_true", help="wait for the scheduler's answer")
        parser.add_argument("--timeout", type=float, default=60.0, help="seconds --wait waits")
        parser.add_argument("--json", action="store_true", help="machine-readable output")
        parser.set_defaults(func=_task)


def _task(args: argparse.Namespace) -> int:
    command_id = args.command_id or new_id()
    report = {"task_id": args.task_id, "command_id": command_id, "action": args.action}
    with Client() as client:
        watcher = TaskEvents(client.bootstrap, client.layout.events, args.task_id)
        # The store answers at once for a task it has; the log has the last word (the store may trail it).
        in_store = client.status(args.task_id) is not None
        history = watcher.read() if args.wait or not in_store else []
        if not in_store and not history:
            _print(args.json, {**report, "outcome": "not_found"},
                   f"no task {args.task_id!r} in the state store or the event log; nothing was sent")
            return EXIT_NOT_FOUND
        command = client.send_command(args.task_id, args.action, step=getattr(args, "step", None),
                                      command_id=command_id, operator=args.operator or _login())
    if not args.wait:
        _print(args.json, {**report, "outcome": "sent"},
               f"sent {command.action} for task {command.task_id} as command {command.command_id}")
        return 0
    outcome = watcher.wait(command.command_id, args.timeout, history)
    if outcome is None:
        _print(args.json, {**report, "outcome": "timeout"},
               f"no answer to command {command.command_id} within {args.timeout:g}s; it may still be applied "
               "(resend it with --command-id to wait again)")
        return EXIT_TIMEOUT
    _print(args.json, {**report, "outcome": outcome.status, "detail": outcome.detail},
           f"{outcome.status}: {outcome.detail}")
    return 0 if outcome.status == "accepted" else EXIT_REFUSED


def _login() -> str | None:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no login name in this environment (a container without a passwd entry)
        return None


def _print(as_json: bool, data: dict[str, Any], text: str) -> None:
    print(orjson.dumps(data).decode() if as_json else text)

