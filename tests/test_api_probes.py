"""The API's liveness and readiness: what an orchestrator restarts it for, and when it stops routing to it."""

from __future__ import annotations

import threading
from pathlib import Path

from fastapi.testclient import TestClient

from eventstore.health import Health
from eventstore.topics import TopicLayout
from projections.store import SqliteStore
from stepstream.http.app import create_app
from stepstream.http.probes import probes_router
from tests.fakes import FakeClock

LAYOUT = TopicLayout(prefix="probes.", partitions=3)


def probe(client: TestClient, path: str) -> tuple[int, str]:
    response = client.get(path)
    return response.status_code, response.json()["reason"]


def test_a_read_only_api_is_live_and_ready_until_it_drains_or_its_store_stops_answering(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "state.db")
    stopping = threading.Event()
    client = TestClient(create_app(store, LAYOUT, None, [probes_router(store, LAYOUT.events, stopping, None)]))
    assert probe(client, "/livez") == (200, "serving")
    assert probe(client, "/readyz") == (200, "serving reads")
    store.close()
    status, reason = probe(client, "/readyz")
    assert status == 503 and reason.startswith("state store: "), reason
    stopping.set()
    assert probe(client, "/readyz") == (503, "draining")
    assert probe(client, "/livez") == (200, "serving"), "draining is not dying: no restart"


def test_an_api_taking_writes_is_ready_once_its_decision_watcher_turns_and_dead_when_it_stalls(
    tmp_path: Path,
) -> None:
    store = SqliteStore(tmp_path / "state.db")
    clock = FakeClock()
    watcher = Health(stall_after_s=60, clock=clock)
    client = TestClient(create_app(store, LAYOUT, None,
                                   [probes_router(store, LAYOUT.events, threading.Event(), watcher)]))
    try:
        assert probe(client, "/readyz") == (503, "starting")
        watcher.beat()
        assert probe(client, "/readyz") == (200, "main loop turning")
        clock.now = 61.0
        status, reason = probe(client, "/livez")
        assert status == 503 and "has not turned for 61s" in reason
        assert probe(client, "/readyz")[0] == 503
    finally:
        store.close()
