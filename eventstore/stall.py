"""A guard for calls into librdkafka that can block past their own timeout.

``send_offsets_to_transaction`` ignores its timeout when the group coordinator's broker dies
(confluentinc/librdkafka#5456): a scheduler was seen sitting in it for minutes after a broker SIGKILL, its
partitions owned and never read again, while the rest of the group waited for it. Nothing inside the process
can cancel that call: librdkafka refuses a second transactional call while one is in progress, so another
thread cannot abort the transaction, and a fresh producer in the same process would leave the main loop stuck
in the old one. The broker aborts the transaction when a successor with the same transactional id fences it
(or its ``transaction.timeout.ms`` runs out). So past a deadline (``STEPSTREAM_CONSUMER_COMMIT_STALL_S``) the
guard ends the process (``EXIT_STALLED``), which is what it is for: the supervisor (``stepstream up``,
compose's ``restart: unless-stopped``, an orchestrator, the tests' ``System``) starts it again, the new
instance's transactional id fences the stuck transaction, and the group moves its partitions in the meantime.
Nothing is lost: the offsets were not committed, so the batch is read again.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import structlog

log = structlog.get_logger("stepstream.runtime")

EXIT_STALLED = 75  # EX_TEMPFAIL: try again (a restart) and it works


def _exit_stalled() -> None:
    os._exit(EXIT_STALLED)  # a clean exit would wait for the very thread that is stuck


@contextmanager
def stall_guard(limit_s: float, what: str, *, give_up: Callable[[], None] = _exit_stalled) -> Iterator[None]:
    """Run the block; if it has not finished after ``limit_s``, log why and ``give_up`` (end the process)."""

    def stalled() -> None:
        log.critical("stalled: ending the process for a restart", what=what, limit_s=limit_s,
                     exit_code=EXIT_STALLED)
        give_up()

    timer = threading.Timer(limit_s, stalled)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
