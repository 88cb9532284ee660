"""``python -m demo`` (what ``stepstream demo`` runs): the demo's batch of orders through a local system."""

from __future__ import annotations

import argparse
import sys

from demo.run import run_demo
from eventstore.errors import StepstreamError


def main() -> int:
    parser = argparse.ArgumentParser(prog="stepstream demo", description=__doc__)
    parser.add_argument("--tasks", type=int, default=20)
    args = parser.parse_args()
    if args.tasks < 1:
        parser.error("--tasks must be at least 1")
    try:
        return run_demo(tasks=args.tasks)
    except StepstreamError as exc:
        print(f"stepstream: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
