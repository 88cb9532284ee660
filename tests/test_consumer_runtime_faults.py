"""The consumer runtime under SIGTERM and SIGKILL, as a real process against a real broker."""

from __future__ import annotations

import signal
import subprocess
import sys
import uuid
from collections import Counter
from pathlib import Path

import pytest
from confluent_kafka import Consumer, TopicPartition

from eventstore.producer import EventProducer
from eventstore.topics import TopicLayout
from schemas.messages import OperatorAlert
from tests.kafka_helpers import wait_for

pytestmark = pytest.mark.kafka

MESSAGES = 60


def _alert(i: int) -> OperatorAlert:
    return OperatorAlert(task_id=f"task-{i % 7}", sequence=i + 1, workflow="w", workflow_version=1,
                         causation_id="c", reason=f"message {i}")


def _produce(bootstrap: str, topic: str, count: int) -> None:
    producer = EventProducer(bootstrap)
    for i in range(count):
        producer.send(topic, _alert(i))
    producer.flush()


def _lines(path: Path) -> list[tuple[int, int]]:
    if not path.exists():
        return []
    return [(int(p), int(o)) for p, o, _k in (line.split() for line in path.read_text().splitlines())]


def _start(env: dict[str, str], topic: str, group: str, log: Path, work_s: float) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.workers.recording_consumer", "--topic", topic, "--group", group,
         "--log", str(log), "--work-s", str(work_s)],
        env=env, cwd=Path(__file__).parent.parent,
    )


def _committed(bootstrap: str, group: str, topic: str, partitions: int) -> dict[int, int]:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group})
    try:
        tps = consumer.committed([TopicPartition(topic, p) for p in range(partitions)], timeout=10)
        return {tp.partition: max(tp.offset, 0) for tp in tps}
    finally:
        consumer.close()


def test_sigterm_finishes_in_flight_work_commits_and_exits_zero_then_restart_processes_each_rest_once(
    bootstrap: str, layout: TopicLayout, test_env: dict[str, str], tmp_path: Path
) -> None:
    topic, group, log = layout.inbox, f"g-{uuid.uuid4().hex}", tmp_path / "handled.log"
    _produce(bootstrap, topic, MESSAGES)
    proc = _start(test_env, topic, group, log, work_s=0.3)
    started = Path(str(log) + ".started")
    assert wait_for(lambda: len(_lines(started)) >= 5, timeout_s=60)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    first_run = _lines(log)
    # The message in flight at SIGTERM was finished, not abandoned.
    assert _lines(started) == first_run
    assert 0 < len(first_run) < MESSAGES

    proc = _start(test_env, topic, group, log, work_s=0.0)
    assert wait_for(lambda: len(_lines(log)) >= MESSAGES, timeout_s=60)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    counts = Counter(_lines(log))
    assert len(counts) == MESSAGES, "every message was processed"
    assert max(counts.values()) == 1, "nothing was processed twice"


def test_sigkill_mid_work_reprocesses_only_uncommitted_messages(
    bootstrap: str, layout: TopicLayout, test_env: dict[str, str], tmp_path: Path
) -> None:
    topic, group, log = layout.inbox, f"g-{uuid.uuid4().hex}", tmp_path / "handled.log"
    _produce(bootstrap, topic, MESSAGES)
    proc = _start(test_env, topic, group, log, work_s=0.05)
    assert wait_for(lambda: len(_lines(log)) >= 20, timeout_s=60)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    committed = _committed(bootstrap, group, topic, layout.partitions)
    before_restart = len(_lines(log))

    proc = _start(test_env, topic, group, log, work_s=0.0)
    assert wait_for(lambda: len(set(_lines(log))) >= MESSAGES, timeout_s=60)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    handled = _lines(log)
    counts = Counter(handled)
    assert len(counts) == MESSAGES, "nothing was lost"
    for (partition, offset), times in counts.items():
        if offset < committed[partition]:
            assert times == 1, f"committed message {partition}/{offset} was processed again"
    repeated = [m for m in handled[before_restart:] if counts[m] > 1]
    assert all(offset >= committed[partition] for partition, offset in repeated)
