"""``/livez`` and ``/readyz`` of the API process, as every other service has beside its metrics.

Live: the process answers, and when it takes writes, its decision watcher (the thread every ``--wait``
depends on) keeps turning; a stalled watcher is something only a restart cures. Ready: not draining
(SIGTERM), the state store answers a query, and the watcher, if any, has started. Both answer JSON
``{"ok", "reason"}`` with 200 or 503, as :mod:`eventstore.health` does.
"""

from __future__ import annotations

import threading

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from eventstore.health import Health
from projections.store import Store


def probes_router(store: Store, topic: str, stopping: threading.Event, watcher: Health | None) -> APIRouter:
    """Probes over ``store`` (asked for its offsets of ``topic``), the drain flag and the watcher's beat
    (None: the API serves reads only, so there is no loop to watch)."""
    router = APIRouter(include_in_schema=False)

    def answer(ok: bool, reason: str) -> JSONResponse:
        return JSONResponse({"ok": ok, "reason": reason}, status_code=200 if ok else 503)

    @router.get("/livez")
    def livez() -> JSONResponse:
        return answer(*(watcher.live() if watcher is not None else (True, "serving")))

    @router.get("/readyz")
    def readyz() -> JSONResponse:
        if stopping.is_set():
            return answer(False, "draining")
        try:
            store.offsets(topic)
        except Exception as exc:  # a store that cannot answer makes every read fail: not ready
            return answer(False, f"state store: {exc}")
        return answer(*(watcher.ready() if watcher is not None else (True, "serving reads")))

    return router
