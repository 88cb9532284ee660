"""The supervisor asks to recover an expired attempt once, then again only after a growing back-off."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from eventstore.keys import ROLL, ROLL_RECORD
from eventstore.topics import TopicLayout
from projections.store import Positioned, SqliteStore
from schemas.codec import default_codec
from schemas.messages import RecoverStep, StepStarted, TaskAccepted
from supervisor.asks import RecoveryAsks
from supervisor.service import Supervisor
from tests.kafka_helpers import read_all


def test_an_attempt_is_asked_at_once_then_after_back_offs_that_double_up_to_the_maximum() -> None:
    asks = RecoveryAsks(first_s=2, max_s=10)
    asked_at = []
    for second in range(60):
        if asks.due("a:s:1", second):
            asks.asked("a:s:1", second)
            asked_at.append(second)
    assert asked_at == [0, 2, 6, 14, 24, 34, 44, 54]


def test_attempts_are_remembered_apart_and_forgotten_once_a_scan_no_longer_finds_them() -> None:
    asks = RecoveryAsks(first_s=5, max_s=60)
    asks.asked("a:s:1", 0)
    assert not asks.due("a:s:1", 1) and asks.due("b:s:1", 1)
    asks.asked("b:s:1", 1)
    asks.keep_only({"b:s:1"})
    assert asks.due("a:s:1", 2) and not asks.due("b:s:1", 2)
    assert len(asks) == 1


@pytest.mark.kafka
def test_while_the_projection_lags_scans_every_second_ask_for_an_expired_attempt_only_after_each_back_off(
    bootstrap: str, layout: TopicLayout, tmp_path: Path,
) -> None:
    store = SqliteStore(tmp_path / "state.db")
    started = datetime.now(UTC) - timedelta(minutes=1)
    events = [
        TaskAccepted(task_id="t-1", sequence=1, workflow="orders", workflow_version=1, causation_id="c",
                     input={}, input_digest="d"),
        StepStarted(task_id="t-1", sequence=2, workflow="orders", workflow_version=1, causation_id="c",
                    step="reserve", step_index=0, attempt=1, attempt_id="t-1:reserve:1",
                    complete_by=started + timedelta(seconds=5), calls_allowed=3),
    ]
    store.apply_events("events", [Positioned(0, i, e) for i, e in enumerate(events)])
    clock = [0.0]
    supervisor = Supervisor(bootstrap=bootstrap, layout=layout, store=store, resend_after_s=2, resend_max_s=8,
                            clock=lambda: clock[0])
    try:
        sent = []
        for second in range(30):  # the projection never catches up: the attempt stays expired
            clock[0] = float(second)
            sent.append(supervisor.scan())
    finally:
        supervisor.stop()
        store.close()

    assert [second for second, count in enumerate(sent) if count] == [0, 2, 6, 14, 22]
    recoveries = [default_codec().decode(m.value()) for m in read_all(bootstrap, layout.inbox, expect=6,
                                                                      timeout_s=5)]
    assert len(recoveries) == 5
    assert all(isinstance(r, RecoverStep) and r.attempt_id == "t-1:reserve:1" for r in recoveries)


@pytest.mark.kafka
def test_the_leaders_scan_appends_the_roll_marker_to_every_keys_partition_once_per_roll_interval(
    bootstrap: str, layout: TopicLayout, tmp_path: Path,
) -> None:
    store = SqliteStore(tmp_path / "state.db")
    clock = [0.0]
    supervisor = Supervisor(bootstrap=bootstrap, layout=layout, store=store, clock=lambda: clock[0], keys_roll_s=10)
    try:
        for second in range(25):  # rolls at 0, 10 and 20
            clock[0] = float(second)
            supervisor.scan()
    finally:
        supervisor.stop()
        store.close()

    markers = read_all(bootstrap, layout.keys, expect=3 * layout.partitions + 1, timeout_s=5)
    assert sorted(m.partition() for m in markers) == sorted(list(range(layout.partitions)) * 3)
    assert all(m.key() == ROLL_RECORD.encode() and m.value() is None and ROLL in m.headers() for m in markers)
