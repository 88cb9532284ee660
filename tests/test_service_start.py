"""An agent's policy file: invalid at start, the agent says why in one line naming the field and exits 1
(it once printed a 47-line chained traceback); edited while the agent runs idle, it is re-read every
poll interval as documented (it was only re-read when a call came)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from stepstream.local.processes import ServiceProcesses

ROOT = Path(__file__).parent.parent


def test_an_agent_with_an_invalid_policy_file_at_start_exits_1_naming_the_field_in_one_line(tmp_path: Path) -> None:
    policy = tmp_path / "policy.toml"
    policy.write_text("[defaults.retry]\nmax_retries = -1\n")
    env = {**os.environ, "STEPSTREAM_HOME": str(tmp_path / "home"), "STEPSTREAM_BOOTSTRAP_SERVERS": "127.0.0.1:1",
           "STEPSTREAM_AGENT_POLICY_FILE": str(policy)}
    done = subprocess.run([sys.executable, "-m", "stepstream", "run", "agent", "payments"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.splitlines()[-1] == (
        f"stepstream: agent payments not started: policy file {policy}: defaults.retry.max_retries: "
        "Input should be greater than or equal to 0")


def test_the_agent_host_with_an_invalid_policy_file_exits_1_and_run_agent_takes_one_name(tmp_path: Path) -> None:
    policy = tmp_path / "policy.toml"
    policy.write_text("[defaults.retry]\nmax_retries = -1\n")
    env = {**os.environ, "STEPSTREAM_HOME": str(tmp_path / "home"), "STEPSTREAM_BOOTSTRAP_SERVERS": "127.0.0.1:1",
           "STEPSTREAM_AGENT_POLICY_FILE": str(policy)}
    host = subprocess.run([sys.executable, "-m", "stepstream", "run", "agents"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=False)
    assert host.returncode == 1 and "Traceback" not in host.stderr
    assert host.stderr.splitlines()[-1] == (
        f"stepstream: agents not started: policy file {policy}: defaults.retry.max_retries: "
        "Input should be greater than or equal to 0")
    two = subprocess.run([sys.executable, "-m", "stepstream", "run", "agent", "payments", "shipping"], env=env,
                         cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert two.returncode == 1 and "one NAME is required" in two.stderr and "stepstream run agents" in two.stderr


@pytest.mark.kafka
def test_an_idle_agent_rereads_its_policy_file_every_poll_interval_and_reports_a_bad_edit(
    test_env: dict[str, str], tmp_path: Path,
) -> None:
    policy = tmp_path / "policy.toml"
    policy.write_text("[defaults.retry]\nmax_retries = 2\n")
    env = {**test_env, "STEPSTREAM_AGENT_POLICY_FILE": str(policy), "STEPSTREAM_AGENT_POLICY_POLL_S": "0.5"}
    procs = ServiceProcesses(env, tmp_path / "logs", cwd=ROOT)
    procs.service("payments", "agent", "payments")
    try:
        procs.wait_started("payments", "policy loaded")
        policy.write_text("[defaults.retry]\nmax_retries = -1\n")  # no call comes: only the watch can see it
        procs.wait_started("payments", "policy refused", timeout_s=10)
        assert "defaults.retry.max_retries" in procs.log("payments")
        policy.write_text("[defaults.retry]\nmax_retries = 4\n")
        procs.wait_started("payments", "policy reloaded", timeout_s=10)
    finally:
        assert procs.terminate_all() == {"payments": 0}
