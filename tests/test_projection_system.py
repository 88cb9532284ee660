"""The whole system under faults (every service a process, the order service over HTTP), on each backend:
a rebuild while tasks keep running swaps in a store equal to a fresh replay, the API answers throughout,
and a store rebuilt afterwards equals the live one row for row."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from projections.settings import StoreSpec
from schemas.states import TERMINAL
from tests.kafka_helpers import wait_for
from tests.system import System

pytestmark = pytest.mark.kafka

ROOT = Path(__file__).parent.parent


def _cli(system: System, *argv: str, timeout_s: float = 180) -> tuple[int, Any]:
    """``stepstream ARGV --json --no-progress`` as operators run it, with the system's settings."""
    done = subprocess.run([sys.executable, "-m", "stepstream", *argv, "--json", "--no-progress"], env=system.env,
                          cwd=ROOT, capture_output=True, timeout=timeout_s)
    assert done.stdout or done.returncode == 0, done.stderr.decode()[-3000:]
    return done.returncode, orjson.loads(done.stdout) if done.stdout else None


class Poller(threading.Thread):
    """Asks the API what a dashboard asks, over and over, and keeps every failure."""

    def __init__(self, api: httpx.Client) -> None:
        super().__init__(daemon=True)
        self.api = api
        self.answers = 0
        self.failures: list[str] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            for path in ("/api/counts", "/api/tasks?limit=5", "/api/steps/stuck"):
                try:
                    response = self.api.get(path)
                    if response.status_code != 200:
                        self.failures.append(f"{path}: {response.status_code} {response.text[:200]}")
                    self.answers += 1
                except httpx.HTTPError as exc:
                    self.failures.append(f"{path}: {exc!r}")
            time.sleep(0.02)


def _statuses(api: httpx.Client, ids: list[str]) -> dict[str, str]:
    out = {}
    for task_id in ids:
        response = api.get(f"/api/tasks/{task_id}")
        out[task_id] = response.json()["status"] if response.status_code == 200 else "unknown"
    return out


def test_a_rebuild_while_tasks_run_under_faults_equals_a_fresh_replay_and_the_api_kept_answering(
    system: System, store_spec: StoreSpec, tmp_path: Path,
) -> None:
    system.env["STEPSTREAM_STORE_URL"] = str(store_spec)  # SQLite: the system's own file
    system.admin.set_faults(latency_ms=20, error_rate=0.2, throttle_rate=0.1, retry_after_s=1)
    system.start()
    api = system.start_api()
    first = [f"before-{i}" for i in range(12)]
    for task_id in first:
        system.submit(task_id, version=1)
    system.producer.send_raw(system.layout.inbox, "poison", b"\x00 not a command")  # the scheduler dead-letters it
    system.producer.flush()
    assert wait_for(lambda: sum(s in TERMINAL for s in _statuses(api, first).values()) >= 6, timeout_s=90), \
        system.logs_tail()

    later = [f"during-{i}" for i in range(12)]
    for task_id in later:
        system.submit(task_id, version=1)
    poller = Poller(api)
    poller.start()
    events_before = api.get("/api/throughput").json()["total"]
    code, report = _cli(system, "projections", "rebuild")
    answers_during_rebuild = poller.answers
    assert api.get("/api/throughput").json()["total"] > events_before, "tasks kept running during the rebuild"
    poller.done.set()
    poller.join(timeout=30)
    assert code == 0 and report["swapped"], report
    assert poller.failures == [], poller.failures[:5]
    assert answers_during_rebuild >= 10, "the API was asked, and answered, while the rebuild ran"

    everything = first + later
    assert wait_for(lambda: all(s in TERMINAL for s in _statuses(api, everything).values()), timeout_s=120), \
        f"{_statuses(api, everything)}\n{system.logs_tail()}"
    assert wait_for(lambda: api.get("/api/dlq/summary").json()["depth"] == 1, timeout_s=30)
    # Verify replays up to exactly the offsets the store holds: it needs no quiet moment.
    code, comparison = _cli(system, "projections", "verify")
    assert code == 0 and comparison["equal"], comparison

    into = (str(tmp_path / "rebuilt.db") if store_spec.kind == "sqlite"
            else str(StoreSpec("postgresql", store_spec.location, "rebuilt")))
    code, built = _cli(system, "projections", "rebuild", "--into", into)
    assert code == 0 and not built["swapped"], built
    assert wait_for(lambda: api.get("/api/health").json()["offsets"] == built["offsets"], timeout_s=30), \
        "the live projector is as far as the rebuild went"
    code, comparison = _cli(system, "projections", "verify", "--against", into)
    assert code == 0 and comparison["equal"], comparison
    tables = {t["table"]: t for t in comparison["tables"]}
    assert tables["tasks"]["rows_a"] == len(everything) and tables["dlq_entries"]["rows_a"] == 1
