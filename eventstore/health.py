"""Liveness and readiness of a service process, served beside its metrics on ``STEPSTREAM_METRICS_PORT``.

``/livez`` answers 200 while the service's main loop keeps turning (it beats at least once per poll), 503
once it has not for ``stall_after_s``: a hung loop (a deadlock, a handler stuck forever) is something only a
restart cures, which is what an orchestrator does with a failed liveness probe. A process running several
loops (the agent host: one per agent) is live only while every one of them turns, so one stalled agent does
not hide behind the others. ``/readyz`` answers 200
from the first turn of the loop until the service starts draining (SIGTERM), 503 otherwise: a consumer
owning no partition (more instances than partitions) is still ready, it is the group's standby.
``/metrics`` is Prometheus' exposition, as before.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import orjson
from prometheus_client import make_wsgi_app


class Health:
    """The process's own view of itself: when its loop last turned, and whether it takes work."""

    def __init__(self, stall_after_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.stall_after_s = stall_after_s
        self._clock = clock
        self._beats: dict[str, float] = {}  # per loop, when it last turned
        self._draining = False
        self.turns = 0
        """How often the loop turned: that it keeps polling, where nothing else shows it (a paused partition)."""

    def beat(self, loop: str = "main") -> None:
        """The loop ``loop`` turned (called once per poll; a process with one loop need not name it)."""
        self._beats[loop] = self._clock()
        self.turns += 1

    def retire(self, loop: str) -> None:
        """The loop ``loop`` ended (drained): its silence from now on is no stall."""
        self._beats.pop(loop, None)

    def draining(self) -> None:
        """The service stops taking work: no longer ready, still alive while it drains."""
        self._draining = True

    def live(self) -> tuple[bool, str]:
        beats = dict(self._beats)  # a copy: loops beat from their own threads
        if not beats:
            return True, "starting"
        loop, last = min(beats.items(), key=lambda item: item[1])
        idle = self._clock() - last
        if idle > self.stall_after_s:
            name = "main loop" if loop == "main" else f"loop {loop}"
            return False, f"{name} has not turned for {idle:.0f}s (limit {self.stall_after_s:g}s)"
        return True, "main loop turning" if len(beats) == 1 else f"{len(beats)} loops turning"

    def ready(self) -> tuple[bool, str]:
        if self._draining:
            return False, "draining"
        if not self._beats:
            return False, "starting"
        return self.live()


HEALTH = Health()
"""The process's health, like Prometheus' default registry one per process: every loop beats it."""


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # probes every few seconds: no access log
        pass


def health_app(health: Health) -> Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]:
    """A WSGI app: ``/livez``, ``/readyz`` (JSON ``{"ok", "reason"}``), everything else Prometheus'."""
    metrics = make_wsgi_app()

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        probe = {"/livez": health.live, "/readyz": health.ready}.get(environ.get("PATH_INFO", ""))
        if probe is None:
            return metrics(environ, start_response)  # type: ignore[no-any-return]
        ok, reason = probe()
        start_response("200 OK" if ok else "503 Service Unavailable", [("Content-Type", "application/json")])
        return [orjson.dumps({"ok": ok, "reason": reason})]

    return app


def serve_health(port: int, addr: str = "127.0.0.1", health: Health = HEALTH) -> WSGIServer:
    """Serve ``/metrics``, ``/livez`` and ``/readyz`` on ``port`` (0: any free one) from a daemon thread."""
    server = make_server(addr, port, health_app(health), handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="health-http", daemon=True).start()
    return server
