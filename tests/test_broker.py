"""The local broker command, and the consumer runtime riding out a broker crash and restart.

These start a second broker of their own, so killing it disturbs no other test.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient

from eventstore.broker import LocalBroker
from eventstore.producer import EventProducer
from eventstore.runtime import Record
from eventstore.topics import TopicLayout, ensure_topics
from schemas.messages import OperatorAlert
from tests.kafka_helpers import read_all, wait_for
from tests.runtime_harness import running

pytestmark = pytest.mark.kafka


@pytest.fixture(scope="module")
def own_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    home = tmp_path_factory.mktemp("own-broker")
    yield home
    LocalBroker(home).stop()


def _cli(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "STEPSTREAM_HOME": str(home)}
    env.pop("STEPSTREAM_BOOTSTRAP_SERVERS", None)
    return subprocess.run([sys.executable, "-m", "stepstream", "broker", *args], env=env, capture_output=True,
                          text=True, timeout=120, check=False)


def test_broker_command_starts_idempotently_reports_status_and_stops_cleanly(own_home: Path) -> None:
    first = _cli(own_home, "start")
    assert first.returncode == 0, first.stderr
    pid = LocalBroker(own_home).status()
    assert pid is not None
    again = _cli(own_home, "start")
    assert again.returncode == 0 and LocalBroker(own_home).status() == pid, "a second start reuses the broker"
    status = _cli(own_home, "status")
    assert status.returncode == 0 and pid.bootstrap_servers in status.stdout
    assert (own_home / "broker" / "logs" / "server.log").stat().st_size > 0, "the broker logs to a file"
    stop = _cli(own_home, "stop")
    assert stop.returncode == 0
    assert _cli(own_home, "status").returncode == 3
    assert "shut down completely" in (own_home / "broker" / "logs" / "server.log").read_text()


def _alert(i: int) -> OperatorAlert:
    return OperatorAlert(task_id=f"t{i % 5}", sequence=i, workflow="w", workflow_version=1, causation_id="c",
                         reason=str(i))


def test_consumer_rides_out_a_broker_crash_and_restart_without_dead_letters(own_home: Path) -> None:
    broker = LocalBroker(own_home)
    bootstrap = broker.start().bootstrap_servers
    layout = TopicLayout(prefix="crash.", partitions=2)
    ensure_topics(AdminClient({"bootstrap.servers": bootstrap}), layout.core_specs())
    producer = EventProducer(bootstrap)
    for i in range(1, 11):
        producer.send(layout.inbox, _alert(i))
    producer.flush()
    seen: set[int] = set()

    def handle(record: Record, _out: EventProducer) -> None:
        seen.add(int(record.message.reason))  # type: ignore[attr-defined]

    with running(bootstrap, layout, layout.inbox, handle):
        assert wait_for(lambda: len(seen) == 10)
        broker.kill()
        assert broker.start().bootstrap_servers == bootstrap, "the broker comes back on the same address"
        producer = EventProducer(bootstrap)
        for i in range(11, 21):
            producer.send(layout.inbox, _alert(i))
        producer.flush()
        assert wait_for(lambda: len(seen) == 20, timeout_s=60)
    assert seen == set(range(1, 21))
    assert read_all(bootstrap, layout.dlq, expect=1, timeout_s=3) == []
