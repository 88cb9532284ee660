"""A scheduler that SIGKILLs itself between writing a batch's events and committing it, for
tests/test_scheduler_restore.py: today's, except that after ``STEPSTREAM_TEST_DIE_AFTER_BATCHES`` batches it
writes the next one's changelog records, flushes them and the batch's events to the broker (inside the open
transaction), and dies before the commit -- the moment a crash between "events" and "state" would fall in.

Run as ``python -m tests.workers.crashing_scheduler``; the rest is ``stepstream run scheduler``.
"""

from __future__ import annotations

import os
import signal

from eventstore.producer import EventProducer
from scheduler.service import Scheduler
from stepstream.cli import main

_save = Scheduler.save_state
_left = [int(os.environ["STEPSTREAM_TEST_DIE_AFTER_BATCHES"])]


def _save_then_die(self: Scheduler, output: EventProducer) -> None:
    _save(self, output)
    _left[0] -= 1
    if _left[0] < 0 and self._batch:
        output.raw.flush(10)  # the batch's records reach the broker, their transaction still open
        os.kill(os.getpid(), signal.SIGKILL)


Scheduler.save_state = _save_then_die  # type: ignore[method-assign]

raise SystemExit(main(["run", "scheduler"]))
