"""A system of one's own, as docs/your-own-system.md walks a newcomer through it: the travel example
(examples/travel: its own service, its workflow, its stepstream.toml) run by the product's own commands
against a real broker, and what an operator sees when an agent of it is not running."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from demo.orders_client import free_port
from stepstream.local.processes import ServiceProcesses
from stepstream.local.up import API_MARKER, wait_until_up
from tests.kafka_helpers import wait_for

pytestmark = pytest.mark.kafka

TRAVEL = Path(__file__).parent.parent / "examples" / "travel"
AGENTS = {"flights", "hotels", "payments", "flights-cancel", "hotels-cancel", "payments-refund"}


def stepstream(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """A command as the newcomer types it in the example's folder."""
    return subprocess.run([sys.executable, "-m", "stepstream", *args], cwd=TRAVEL, env=env, capture_output=True,
                          text=True, timeout=150, check=False)


def trip(trip_id: str, card: str = "tok_visa") -> str:
    return json.dumps({"trip_id": trip_id, "flight": "LH 1234", "hotel": "Hotel Adlon", "nights": 2,
                       "amount": 480.0, "card": card})


def records(url: str, trip_id: str) -> dict[str, Any]:
    answer: dict[str, Any] = httpx.get(f"{url}/admin/records", params={"trip_id": trip_id}, timeout=10).json()
    return answer


def test_the_travel_example_under_up_completes_a_trip_and_undoes_a_declined_one_in_reverse_order(
    test_env: dict[str, str], tmp_path: Path,
) -> None:
    home = tmp_path / "home"
    env = {**test_env, "STEPSTREAM_HOME": str(home), "STEPSTREAM_API_PORT": "0"}
    port = free_port()  # the example's own 8300 may be taken on a shared machine
    output = tmp_path / "up.out"
    with output.open("wb") as out:
        up = subprocess.Popen([sys.executable, "-m", "stepstream", "up", "--service-port", str(port)], cwd=TRAVEL,
                              env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        state = wait_until_up(home, up, timeout_s=150)
        url = f"http://127.0.0.1:{port}"
        assert state["services"] == {"travel": url}
        assert set(state["pids"]) == {"travel-service", "projector", "scheduler", "supervisor", "api", "agents"}, \
            "one process for every agent, and no demo order service"
        api = str(state["api_url"]).rstrip("/")
        assert wait_for(lambda: {a["agent"]: a["members"] for a in httpx.get(f"{api}/api/agents", timeout=10).json()
                                 ["items"]} == dict.fromkeys(AGENTS, 1), timeout_s=60), \
            "the host runs every agent the workflow names, forward and compensation, each its own group member"

        done = stepstream("submit", "trip", "--input", trip("t-ok"), "--task-id", "t-ok", "--wait", env=env)
        assert done.returncode == 0 and done.stdout.startswith("t-ok: completed (trip v1)"), done.stdout + done.stderr
        held = records(url, "t-ok")
        assert {kind: len(items) for kind, items in held["held"].items()} == {"flights": 1, "hotels": 1,
                                                                             "payments": 1}
        assert {op: list(keys.values()) for op, keys in held["applied"].items()} == {
            "flights/book": [1], "hotels/book": [1], "payments/charge": [1]}, "each booking applied once"

        declined = stepstream("submit", "trip", "--input", trip("t-no", card="declined"), "--task-id", "t-no",
                              "--wait", env=env)
        assert declined.returncode == 4, declined.stdout + declined.stderr
        assert declined.stdout.startswith("t-no: compensated (trip v1)"), declined.stdout
        undone = records(url, "t-no")
        assert all(not items for items in undone["held"].values()), f"nothing held: {undone}"
        assert [entry["operation"] for entry in undone["log"]] == [
            "flights/book", "hotels/book", "hotels/cancel", "flights/cancel"], "undone in reverse order"

        # Each agent process that called its service reports it, and the console's API lists it.
        called = {"flights", "hotels", "payments", "hotels-cancel", "flights-cancel"}

        def reported() -> set[str]:
            items = httpx.get(f"{state['api_url']}/api/dependencies", timeout=10).json()["items"]
            return {item["agent"] for item in items if item["calls_total"] > 0}

        assert wait_for(lambda: reported() >= called, timeout_s=30), reported()
    finally:
        up.send_signal(signal.SIGTERM)
        code = up.wait(timeout=150)
    text = output.read_text()
    assert code == 0 and "Traceback" not in text, text
    stopped = next(line for line in text.splitlines() if line.startswith("stopped:"))
    assert stopped.count("exit 0") == len(state["pids"]), stopped


def test_run_agent_runs_a_declared_agent_and_a_task_waiting_on_a_stopped_one_says_so_within_30s(
    test_env: dict[str, str], tmp_path: Path,
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    procs = ServiceProcesses({**test_env, "STEPSTREAM_AGENT_SERVICE_URL": url}, tmp_path / "logs", cwd=TRAVEL)
    try:
        procs.launch("travel-service", (sys.executable, "-m", "travel.service", "--port", str(port)))
        assert wait_for(lambda: _answers(url), timeout_s=30), procs.log("travel-service")
        for name in ("projector", "scheduler"):
            procs.service(name, name)
        for agent in ("flights", "hotels"):
            procs.service(agent, "agent", agent)
        procs.start("api", "stepstream", "serve", "api", "--port", "0")
        for name in ("projector", "scheduler", "flights", "hotels"):
            procs.wait_started(name)
        procs.wait_started("api", API_MARKER)
        api = re.findall(API_MARKER + r" (http://\S+)", procs.log("api"))[0]

        assert procs.terminate("hotels") == 0, procs.log("hotels")
        submitted = stepstream("submit", "trip", "--input", trip("t-wait"), "--task-id", "t-wait", env=test_env)
        assert submitted.returncode == 0, submitted.stderr

        def status() -> dict[str, Any]:
            shown = stepstream("status", "t-wait", "--json", env=test_env)
            return json.loads(shown.stdout) if shown.returncode == 0 else {}

        assert wait_for(lambda: status().get("unattended") == [
            {"step": "hotel", "agent": "hotels", "reason": "no agent running for `hotels`"}], timeout_s=30), status()
        steps = {step["step"]: step["status"] for step in status()["steps"]}
        assert steps == {"flight": "succeeded", "hotel": "queued"}, "run agent flights ran the declared agent"
        said = stepstream("status", "t-wait", env=test_env).stdout.splitlines()
        assert "  hotel: queued, attempt 1, failures 0 — no agent running for `hotels`" in said, said

        task = httpx.get(f"{api}/api/tasks/t-wait", timeout=10).json()
        assert task["unattended"] == [{"step": "hotel", "agent": "hotels", "reason": "no agent running for `hotels`"}]
        agents = {a["agent"]: a["members"] for a in httpx.get(f"{api}/api/agents", timeout=10).json()["items"]}
        assert agents["hotels"] == 0 and agents["flights"] == 1 and set(agents) == AGENTS
        metrics = httpx.get(f"{api}/metrics", timeout=10).text
        assert 'stepstream_agent_group_members{agent="hotels"} 0.0' in metrics
        assert 'stepstream_agent_group_members{agent="flights"} 1.0' in metrics
    finally:
        codes = procs.terminate_all(last=["travel-service"])
    assert all(code == 0 for name, code in codes.items() if name != "travel-service"), "each drained: " + str(codes)


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False
