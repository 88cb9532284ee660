"""``stepstream up`` as a new user runs it: a real process starting every service against the real broker,
from a folder where nothing was created before, stopped by SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from stepstream.up import READY_MARKER, wait_until_up

pytestmark = pytest.mark.kafka


def test_up_in_a_fresh_clone_creates_its_folders_starts_everything_and_stops_cleanly(
    test_env: dict[str, str], tmp_path: Path,
) -> None:
    home = tmp_path / "fresh" / ".stepstream"
    env = {**test_env, "STEPSTREAM_HOME": str(home), "STEPSTREAM_API_PORT": "0"}
    output = tmp_path / "up.out"
    with output.open("wb") as out:
        up = subprocess.Popen([sys.executable, "-m", "stepstream", "up"], env=env, cwd=tmp_path,
                              stdout=out, stderr=subprocess.STDOUT)
    try:
        state = wait_until_up(home, up, timeout_s=150)
        assert READY_MARKER in output.read_text()
        pids = state["pids"]
        assert isinstance(pids, dict) and {"projector", "scheduler", "supervisor", "api"} <= set(pids)
        assert (home / "logs" / "orders-service.log").exists() and (home / "logs" / "scheduler.log").exists()
    finally:
        up.send_signal(signal.SIGTERM)
        code = up.wait(timeout=150)
    text = output.read_text()
    assert "Traceback" not in text and code == 0, text
    stopped = next(line for line in text.splitlines() if line.startswith("stopped:"))
    assert stopped.count("exit 0") == len(pids), stopped
