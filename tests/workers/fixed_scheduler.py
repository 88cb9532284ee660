"""The scheduler of a "fixed" release, for tests/test_quarantine.py: today's, whose decider also folds a
task completed twice (the poison that test appends), as a release repairing such a history would.

Run as ``python -m tests.workers.fixed_scheduler``; the rest is ``stepstream run scheduler``.
"""

from __future__ import annotations

from scheduler.decider import transitions
from schemas.messages import TaskCompleted
from stepstream.cli import main

transitions._ALLOWED_FROM[TaskCompleted] = frozenset({"running", "completed"})

raise SystemExit(main(["run", "scheduler"]))
