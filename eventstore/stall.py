"""A guard for calls into librdkafka that can block past their own timeout.

``send_offsets_to_transaction`` ignores its timeout when the group coordinator's broker dies
(confluentinc/librdkafka#5456, #5511): a scheduler was seen sitting in it for minutes after a broker SIGKILL, its
partitions owned and never read again. Worse, it stays in its consumer group meanwhile (librdkafka heartbeats
from a thread of its own), so the rebalance that the coordinator's move starts waits for it, and the other
schedulers stop too (with the guard at 75 s, a broker-kill run left every task waiting 93 s). Nothing inside
the process can cancel that call: librdkafka refuses a second transactional call while one is in progress, so
another thread cannot abort the transaction, and a fresh producer in the same process would leave the main loop
stuck in the old one. So past a deadline (``STEPSTREAM_CONSUMER_COMMIT_STALL_S``, 15 s a call: above the
transaction timeout each call is given, ``STEPSTREAM_CONSUMER_TRANSACTION_TIMEOUT_S``, so a call librdkafka ends in
time never fires it) the guard ends the process (``EXIT_STALLED``), which is what it is for: the supervisor
(``stepstream up``, compose's ``restart: unless-stopped``, an orchestrator, the tests' ``System``) starts it again,
the new instance's transactional id fences the stuck transaction (its coordinator has aborted it already if the
transaction timeout passed), and the group moves its partitions once its session times out. Nothing is lost: the
offsets were not committed, so the batch is read again.
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
