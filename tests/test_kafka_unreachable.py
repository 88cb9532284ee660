"""A broker that is down, or a wrong STEPSTREAM_BOOTSTRAP_SERVERS: every command that needs Kafka answers
with one line saying where it looked and exits 69 within seconds (no traceback, no librdkafka chatter);
``status`` reads only the state store and answers without any broker. These need no broker: the point
is its absence (a port nobody listens on)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from confluent_kafka import KafkaError, KafkaException

from projections.store import Positioned, SqliteStore
from tests.histories import histories

ROOT = Path(__file__).parent.parent
TIMEOUT_S = 2  # STEPSTREAM_CONNECT_TIMEOUT_S for these runs


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _stepstream(env: dict[str, str], *args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "stepstream", *args], env=env, capture_output=True, text=True,
                          timeout=60, check=False, cwd=ROOT)
    return done, time.monotonic() - started


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "STEPSTREAM_HOME": str(tmp_path / "home"), "STEPSTREAM_CONNECT_TIMEOUT_S": str(TIMEOUT_S)}


@pytest.mark.parametrize("command", [
    ["submit", "orders", "--input", '{"order_id": "o-1"}'],
    ["submit", "orders", "--input", '{"order_id": "o-1"}', "--wait"],
    ["task", "cancel", "some-task"],
    ["dlq", "list"],
    ["topics", "create"],
    ["projections", "verify"],
], ids=lambda c: " ".join(c[:2]))
def test_a_command_against_a_broker_that_is_down_says_where_it_looked_in_one_line_and_exits_69(
    env: dict[str, str], command: list[str],
) -> None:
    port = _closed_port()
    done, took = _stepstream({**env, "STEPSTREAM_BOOTSTRAP_SERVERS": f"127.0.0.1:{port}"}, *command)
    assert (done.returncode, done.stdout) == (69, ""), done.stderr
    assert done.stderr.splitlines() == [
        f"stepstream: no Kafka cluster answered at 127.0.0.1:{port} (STEPSTREAM_BOOTSTRAP_SERVERS) within "
        f"{TIMEOUT_S}s: Failed to get metadata: Local: Broker transport failure"]
    assert took < TIMEOUT_S + 10


def test_a_command_with_no_cluster_configured_and_no_local_broker_says_how_to_start_one(
    env: dict[str, str], tmp_path: Path,
) -> None:
    done, _took = _stepstream({k: v for k, v in env.items() if k != "STEPSTREAM_BOOTSTRAP_SERVERS"},
                              "submit", "orders", "--input", "{}")
    assert done.returncode == 69 and done.stderr.splitlines() == [
        f"stepstream: no Kafka cluster configured (STEPSTREAM_BOOTSTRAP_SERVERS) and no local broker running in "
        f"{tmp_path / 'home'}: start it with `stepstream broker start`"]


def test_status_reads_the_store_and_answers_with_the_broker_down(env: dict[str, str], tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "state.db")
    store.apply_events("stepstream.events", [Positioned(0, i, e) for i, e in enumerate(histories(1, seed=3))])
    store.close()
    down = {**env, "STEPSTREAM_BOOTSTRAP_SERVERS": f"127.0.0.1:{_closed_port()}",
            "STEPSTREAM_STORE_PATH": str(tmp_path / "state.db")}
    done, took = _stepstream(down, "status", "task-0000000")
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.startswith("task-0000000: ") and took < 10
    missing, _took = _stepstream(down, "status", "nope")
    assert (missing.returncode, missing.stderr.strip()) == (3, "stepstream status: no task 'nope' in the state store")


def test_status_without_a_store_says_where_it_looked_and_creates_none(env: dict[str, str], tmp_path: Path) -> None:
    done, _took = _stepstream(env, "status", "nope")
    state = tmp_path / "home" / "state.db"
    assert (done.returncode, done.stderr.strip()) == (
        3, f"stepstream status: no state store at {state} yet (has the projector run?)")
    assert not state.exists()


@pytest.mark.parametrize(("error", "code"), [
    (KafkaError(KafkaError._FATAL, "Unable to produce message: Local: Fatal error"), 75),
    (KafkaError(KafkaError.PRODUCER_FENCED, "fenced", fatal=True), 75),
    (KafkaError(KafkaError._TRANSPORT, "broker down"), 69),
])
def test_a_service_whose_kafka_client_broke_for_good_exits_75_for_a_restart_and_a_lost_broker_69(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], error: KafkaError, code: int,
) -> None:
    """A fenced producer is mended by a fresh process (75, which ``up`` and compose restart), wherever the error
    surfaces; a broker lost mid-command is said as such (69)."""
    import argparse

    import stepstream.cli as cli

    def broken(_args: argparse.Namespace) -> int:
        raise KafkaException(error)

    parser = argparse.ArgumentParser()
    parser.add_argument("command")
    parser.set_defaults(func=broken)
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    assert cli.main(["scheduler"]) == code
    assert capsys.readouterr().err.splitlines() == [f"stepstream: Kafka: {error.str()}"]
