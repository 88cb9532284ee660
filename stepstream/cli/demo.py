"""``stepstream demo``: a batch of orders submitted to a local system with faults on.

The demo is a project of its own (``demo/stepstream.toml``): this verb runs its script (``python -m demo``) as
a process, which runs ``stepstream up`` on that file, as the front runs any project's service, so the front
never imports it.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from eventstore.settings import KafkaSettings
from stepstream.local.up import refuse_if_up
from stepstream.project.files import BUILT_IN_PACKAGE


def add_parsers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    demo = commands.add_parser("demo", help="submit a batch of orders to a local system with faults on")
    demo.add_argument("--tasks", type=int, default=20)
    demo.set_defaults(func=_demo)


def _demo(args: argparse.Namespace) -> int:
    if args.tasks < 1:
        raise SystemExit("stepstream demo: --tasks must be at least 1")
    refuse_if_up(KafkaSettings().home.resolve())  # said here, in the command's own words, before it starts
    demo = subprocess.Popen([sys.executable, "-m", BUILT_IN_PACKAGE, "--tasks", str(args.tasks)])
    try:
        return demo.wait()
    except KeyboardInterrupt:  # Ctrl-C reached the demo too (one process group): it stops its system first
        return demo.wait()
