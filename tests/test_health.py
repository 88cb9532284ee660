"""``/livez`` and ``/readyz`` beside ``/metrics``: what an orchestrator's probes hear from a service, over real HTTP."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from eventstore.health import Health, serve_health
from tests.fakes import FakeClock

Probed = tuple[Health, "FakeClock", httpx.Client]


@pytest.fixture
def probed() -> Iterator[tuple[Health, FakeClock, httpx.Client]]:
    clock = FakeClock(100.0)
    health = Health(stall_after_s=30, clock=clock)
    server = serve_health(0, health=health)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{server.server_port}", timeout=10) as client:
            yield health, clock, client
    finally:
        server.shutdown()
        server.server_close()


def answer(client: httpx.Client, path: str) -> tuple[int, str]:
    response = client.get(path)
    return response.status_code, response.json()["reason"]


def test_a_starting_service_is_alive_but_not_ready_until_its_loop_turns(probed: Probed) -> None:
    health, _clock, client = probed
    assert answer(client, "/livez") == (200, "starting")
    assert answer(client, "/readyz") == (503, "starting")
    health.beat()
    assert answer(client, "/readyz") == (200, "main loop turning")


def test_a_draining_service_is_no_longer_ready_but_still_alive(probed: Probed) -> None:
    health, _clock, client = probed
    health.beat()
    health.draining()
    assert answer(client, "/readyz") == (503, "draining")
    assert answer(client, "/livez")[0] == 200, "an orchestrator must not kill it mid-drain"


def test_a_loop_that_stopped_turning_fails_the_liveness_probe(probed: Probed) -> None:
    health, clock, client = probed
    health.beat()
    clock.now += 31
    status, reason = answer(client, "/livez")
    assert status == 503 and reason == "main loop has not turned for 31s (limit 30s)"
    assert answer(client, "/readyz")[0] == 503


def test_the_same_port_still_serves_prometheus_metrics(probed: Probed) -> None:
    _health, _clock, client = probed
    response = client.get("/metrics")
    assert response.status_code == 200 and "python_info" in response.text


def test_one_stalled_loop_of_several_fails_the_liveness_probe_and_names_it(probed: Probed) -> None:
    health, clock, client = probed
    health.beat("agent.payments")
    health.beat("agent.shipping")
    assert answer(client, "/livez") == (200, "2 loops turning")
    clock.advance(31)
    health.beat("agent.shipping")  # one agent of the host keeps turning; the other does not
    assert answer(client, "/livez") == (503, "loop agent.payments has not turned for 31s (limit 30s)")
    health.retire("agent.payments")  # drained: it stopped as asked
    assert answer(client, "/livez") == (200, "main loop turning")
