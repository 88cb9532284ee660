"""An agent host: several agents' consumer loops in one process, one thread each, ended together.

Why one process: each agent alone is a Python interpreter, a producer, a data-keys reader and a pool of
connections of its own, and every answer it sends is a produce request of its own. In one host the agents
share the producer (answers of different agents to one inbox partition ride in one request), the data-keys
reader (a task's key is read once for all its steps) and a connection pool per service.

What each agent keeps: its consumer (its own group, so pause and back-pressure stay per agent and the
group's members still say which agents run), its worker threads (its concurrency), its policy, breaker,
budget, pace and metrics, and its drain.

Why one agent's trouble does not stall the others:

- **Stuck**: every agent's loop runs on its own thread and its calls on its own workers, so a call that
  never returns holds only that agent's workers; the others keep taking and answering their requests. Its
  loop keeps turning (it pauses its partitions once its workers are all held), and ``/livez`` names a loop
  that stopped turning (:class:`eventstore.health.Health`, one beat per agent).
- **Crash**: a loop that ends with an error ends the host. The others drain first (their calls in flight
  finish, their offsets are committed), then the host re-raises the crash, so the process exits with its
  code (75 for a restart the runtime asked for, :mod:`eventstore.stall`) and the supervisor (``stepstream
  up``, an orchestrator) starts it again. A crashed loop is not restarted inside the process: threads it
  left running (a handler that never returned) end only with the process, and a second loop beside them
  could call the service for the same request twice at once.
- **Drain**: SIGTERM sets the one stop event every agent shares; each drains on its own thread, at once.
  One that has not finished when the drain timeout passes ends the process with 75
  (:data:`eventstore.shutdown.EXIT_DRAIN_TIMEOUT`): nothing is lost, uncommitted work is redone.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping

import structlog

from eventstore.shutdown import EXIT_DRAIN_TIMEOUT

log = structlog.get_logger("stepstream.agent")

SIGNAL_CHECK_S = 0.2
"""How often the main thread wakes while the agents run, so a signal's handler runs (see ``run``)."""

Loop = Callable[[], None]
"""An agent's consumer loop: returns once its stop event is set and it drained, or raises if it broke."""


class AgentHost:
    """Runs ``loops`` (by agent name) until ``stop`` is set (SIGTERM, or any loop ending), then waits up to
    ``drain_timeout_s`` for all of them to drain; ``run`` re-raises the first loop's crash."""

    def __init__(self, loops: Mapping[str, Loop], stop: threading.Event, drain_timeout_s: float, *,
                 give_up: Callable[[int], None] = os._exit) -> None:
        self.loops = dict(loops)
        self.stop = stop
        self.drain_timeout_s = drain_timeout_s
        self._give_up = give_up  # a clean exit would wait for the very thread that is stuck
        self._crashes: list[tuple[str, BaseException]] = []
        self._lock = threading.Lock()

    def run(self) -> None:
        threads = [threading.Thread(target=self._run_one, args=(name, loop), name=f"agent {name}", daemon=True)
                   for name, loop in self.loops.items()]
        for thread in threads:
            thread.start()
        log.info("agent host running", agents=sorted(self.loops))
        # Not one wait without a timeout: SIGTERM may be delivered to any thread, and Python runs its handler
        # (which sets ``stop``) only in the main thread, once that thread runs again: a main thread blocked
        # for good in ``wait()`` would never drain.
        while not self.stop.wait(SIGNAL_CHECK_S):
            pass
        deadline = time.monotonic() + self.drain_timeout_s
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        stuck = [thread.name for thread in threads if thread.is_alive()]
        if stuck:
            log.error("agents still draining after the drain timeout; exiting", agents=stuck,
                      timeout_s=self.drain_timeout_s)
            self._give_up(EXIT_DRAIN_TIMEOUT)
            return
        if self._crashes:
            name, crash = self._crashes[0]
            log.error("agent host stopped: an agent crashed", agent=name, error=repr(crash))
            raise crash

    def _run_one(self, name: str, loop: Loop) -> None:
        try:
            loop()
        except BaseException as exc:  # its own thread: nothing above it would say anything
            with self._lock:
                self._crashes.append((name, exc))
            log.error("agent crashed; the others drain and the host exits for a restart", agent=name,
                      error=repr(exc), exc_info=exc)
        finally:
            self.stop.set()  # a loop ends only when asked or broken: either way every agent stops
