"""Graceful shutdown on SIGTERM/SIGINT, armed before a service builds anything.

Arming first matters: a service can spend seconds connecting (transactional producer init, state
restore), and a SIGTERM in that window must still mean "drain and exit 0", not the default kill.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType

import structlog

log = structlog.get_logger("stepstream.shutdown")

EXIT_DRAIN_TIMEOUT = 75


class GracefulShutdown:
    """One per process. ``event`` is set on the first signal; past ``drain_timeout_s`` the process exits 75."""

    def __init__(self, drain_timeout_s: float) -> None:
        self.drain_timeout_s = drain_timeout_s
        self.event = threading.Event()

    def install(self) -> GracefulShutdown:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        return self

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if self.event.is_set():
            return
        log.info("draining", signal=signal.Signals(signum).name, timeout_s=self.drain_timeout_s)
        self.event.set()
        watchdog = threading.Timer(self.drain_timeout_s, self._expired)
        watchdog.daemon = True
        watchdog.start()

    def _expired(self) -> None:
        # Nothing is lost: work that did not finish was not committed and will be redone.
        log.error("drain timeout passed with work still in flight; exiting", timeout_s=self.drain_timeout_s)
        os._exit(EXIT_DRAIN_TIMEOUT)
