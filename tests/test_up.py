"""``stepstream up`` as a new user runs it: a real process starting every service against the real broker,
from a folder where nothing was created before, stopped by SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from stepstream.local.up import READY_MARKER, wait_until_up
from tests.kafka_helpers import wait_for

pytestmark = pytest.mark.kafka


def start_up(env: dict[str, str], cwd: Path, output: Path) -> subprocess.Popen[bytes]:
    with output.open("wb") as out:
        return subprocess.Popen([sys.executable, "-m", "stepstream", "up"], env=env, cwd=cwd,
                                stdout=out, stderr=subprocess.STDOUT)


def test_up_in_a_fresh_clone_starts_everything_restarts_a_killed_service_and_the_run_completes(
    test_env: dict[str, str], tmp_path: Path,
) -> None:
    home = tmp_path / "fresh" / ".stepstream"
    env = {**test_env, "STEPSTREAM_HOME": str(home), "STEPSTREAM_API_PORT": "0"}
    output = tmp_path / "up.out"
    up = start_up(env, tmp_path, output)
    try:
        state = wait_until_up(home, up, timeout_s=150)
        assert READY_MARKER in output.read_text()
        pids = state["pids"]
        assert isinstance(pids, dict) and {"projector", "scheduler", "supervisor", "api"} <= set(pids)
        assert (home / "logs" / "orders-service.log").exists() and (home / "logs" / "scheduler.log").exists()

        os.kill(pids["agents"], signal.SIGKILL)  # the one process running every agent of the project
        assert wait_for(lambda: "agents started again" in output.read_text(), timeout_s=60), output.read_text()
        assert "agents exited unexpectedly (killed by signal 9); starting it again in 0.5s" in output.read_text()
        # The latest orders version marks card_token: the CLI seals it with the key up made in the home.
        order = {"order_id": "after-kill", "sku": "A-1", "qty": 1, "amount": 10, "card_token": "tok_after_kill"}
        submitted = subprocess.run([sys.executable, "-m", "stepstream", "submit", "orders", "--input",
                                    json.dumps(order), "--task-id", "after-kill", "--wait"], env=env, cwd=tmp_path,
                                   capture_output=True, text=True, timeout=150, check=False)
        assert submitted.returncode == 0, submitted.stdout + submitted.stderr
        restarted = json.loads((home / "up.json").read_text())["pids"]["agents"]
        assert restarted != pids["agents"], "up.json names the running process"
    finally:
        up.send_signal(signal.SIGTERM)
        code = up.wait(timeout=150)
    text = output.read_text()
    assert "Traceback" not in text and code == 0, text
    stopped = next(line for line in text.splitlines() if line.startswith("stopped:"))
    assert stopped.count("exit 0") == len(pids), stopped


def test_up_stops_everything_with_exit_1_naming_a_service_that_keeps_crashing(
    test_env: dict[str, str], tmp_path: Path,
) -> None:
    home = tmp_path / ".stepstream"
    env = {**test_env, "STEPSTREAM_HOME": str(home), "STEPSTREAM_API_PORT": "0", "STEPSTREAM_UP_MAX_RESTARTS": "1"}
    output = tmp_path / "up.out"
    up = start_up(env, tmp_path, output)
    try:
        state = wait_until_up(home, up, timeout_s=150)
        os.kill(state["pids"]["supervisor"], signal.SIGKILL)
        assert wait_for(lambda: "supervisor started again" in output.read_text(), timeout_s=60), output.read_text()
        assert wait_for(lambda: json.loads((home / "up.json").read_text())["pids"]["supervisor"]
                        != state["pids"]["supervisor"], timeout_s=30)
        os.kill(json.loads((home / "up.json").read_text())["pids"]["supervisor"], signal.SIGKILL)
        code = up.wait(timeout=150)
    finally:
        if up.poll() is None:
            up.kill()
    text = output.read_text()
    assert code == 1, text
    assert "supervisor died 2 times within 60s: it keeps crashing, so up stops everything" in text
    assert not (home / "up.json").exists() and "Traceback" not in text


def test_up_with_a_metrics_port_gives_each_service_its_own_with_health_probes_and_says_which(
    test_env: dict[str, str], tmp_path: Path,
) -> None:
    home = tmp_path / ".stepstream"
    env = {**test_env, "STEPSTREAM_HOME": str(home), "STEPSTREAM_API_PORT": "0", "STEPSTREAM_METRICS_PORT": "0"}
    output = tmp_path / "up.out"
    up = start_up(env, tmp_path, output)
    try:
        state = wait_until_up(home, up, timeout_s=150)
        ports = state["metrics_ports"]
        assert isinstance(ports, dict) and {"projector", "scheduler", "supervisor"} <= set(ports)
        assert len(set(ports.values())) == len(ports), "one port each"
        said = next(line for line in output.read_text().splitlines() if line.startswith("metrics ("))
        for name, port in ports.items():
            assert f"{name} http://127.0.0.1:{port}/metrics" in said
            assert "python_info" in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
            assert httpx.get(f"http://127.0.0.1:{port}/livez", timeout=10).status_code == 200, name
            readyz = f"http://127.0.0.1:{port}/readyz"
            assert wait_for(lambda url=readyz: httpx.get(url, timeout=10).status_code == 200,
                            timeout_s=30), f"{name} is ready once its loop turns"
    finally:
        up.send_signal(signal.SIGTERM)
        code = up.wait(timeout=150)
    assert code == 0, output.read_text()


def test_up_with_a_metrics_port_in_use_refuses_before_starting_anything(
    test_env: dict[str, str], tmp_path: Path,
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**test_env, "STEPSTREAM_HOME": str(tmp_path / "home"), "STEPSTREAM_METRICS_PORT": str(port)}
        done = subprocess.run([sys.executable, "-m", "stepstream", "up"], env=env, cwd=tmp_path, capture_output=True,
                              text=True, timeout=60, check=False)
    assert done.returncode == 1 and done.stderr.startswith(
        f"stepstream: STEPSTREAM_METRICS_PORT={port}: port {port} for projector (ports {port}-")
    assert "choose another base, or 0 for any free ports" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "home").exists(), "nothing started, nothing written"


def test_a_second_up_or_a_demo_while_a_system_is_up_is_refused_and_the_running_one_is_untouched(
    test_env: dict[str, str], tmp_path: Path,
) -> None:
    home = tmp_path / ".stepstream"
    env = {**test_env, "STEPSTREAM_HOME": str(home), "STEPSTREAM_API_PORT": "0"}
    output = tmp_path / "up.out"
    with output.open("wb") as out:
        up = subprocess.Popen([sys.executable, "-m", "stepstream", "up"], env=env, cwd=tmp_path,
                              stdout=out, stderr=subprocess.STDOUT)
    try:
        state = wait_until_up(home, up, timeout_s=150)
        for command in (["up"], ["demo", "--tasks", "1"]):
            done = subprocess.run([sys.executable, "-m", "stepstream", *command], env=env, cwd=tmp_path,
                                  capture_output=True, text=True, timeout=60, check=False)
            assert done.returncode == 1 and done.stderr.splitlines() == [
                f"stepstream: a system is already up in {home} (stepstream up, pid {up.pid}, dashboard "
                f"{state['api_url']}): stop it first (Ctrl-C where it runs, or kill -TERM {up.pid}), "
                "or use another STEPSTREAM_HOME"], command
        assert up.poll() is None and wait_until_up(home, up, timeout_s=1) == state
    finally:
        up.send_signal(signal.SIGTERM)
        code = up.wait(timeout=150)
    assert code == 0, output.read_text()
