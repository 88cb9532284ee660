"""``stepstream demo``: a batch of orders submitted to a local system with faults on (``demo.run``)."""

from __future__ import annotations

import argparse


def add_parsers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    demo = commands.add_parser("demo", help="submit a batch of orders to a local system with faults on")
    demo.add_argument("--tasks", type=int, default=20)
    demo.set_defaults(func=_demo)


def _demo(args: argparse.Namespace) -> int:
    from demo.run import run_demo

    if args.tasks < 1:
        raise SystemExit("stepstream demo: --tasks must be at least 1")
    return run_demo(tasks=args.tasks)
