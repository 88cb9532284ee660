"""Projector, rebuild and verify against a real broker, on both backends, with synthetic histories.

(The whole system under faults, with a rebuild while tasks run, is in test_projection_system.py.)
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import orjson
import pytest

from eventstore.dlq import dlq_headers
from eventstore.producer import EventProducer
from eventstore.topics import TopicLayout
from projections.rebuild import (
    Replayer,
    rebuild_into,
    rebuild_live,
    until_time,
    verify_against_replay,
    verify_stores,
)
from projections.replaying import sources
from projections.settings import StoreSpec
from projections.store import Store
from schemas.messages import StepStarted
from stepstream.cli import main
from stepstream.local.processes import ServiceProcesses
from tests.histories import histories, publish
from tests.kafka_helpers import wait_for


@pytest.fixture
def live(store_spec: StoreSpec) -> Iterator[Store]:
    store = store_spec.open()
    try:
        yield store
    finally:
        store.close()


def _applied(store: Store, layout: TopicLayout) -> int:
    return sum(store.offsets(layout.events).values())


def _dead_letter(producer: EventProducer, layout: TopicLayout, i: int) -> None:
    producer.send_raw(layout.dlq, f"poison-{i}", b"\x00not avro", dlq_headers(
        reason="corrupt", error_class="DecodeError", kind="corrupt", topic=layout.inbox, partition=0, offset=i,
        group=layout.scheduler_group))


@pytest.mark.kafka
def test_a_projector_sigkilled_mid_batch_restarts_and_applies_every_event_exactly_once(
    bootstrap: str, layout: TopicLayout, test_env: dict[str, str], store_spec: StoreSpec, tmp_path: Path,
) -> None:
    events = list(histories(1500, seed=11))
    publish(bootstrap, layout.events, events)
    producer = EventProducer(bootstrap)
    for i in range(5):
        _dead_letter(producer, layout, i)
    producer.flush()
    env = {**test_env, "STEPSTREAM_STORE_URL": str(store_spec), "STEPSTREAM_CONSUMER_BATCH_SIZE": "200"}
    procs = ServiceProcesses(env, tmp_path / "logs", cwd=Path(__file__).parent.parent)
    store = store_spec.open()
    try:
        procs.service("projector", "projector")
        procs.wait_started("projector")
        assert wait_for(lambda: _applied(store, layout) > len(events) // 4, timeout_s=60), procs.log("projector")
        procs.kill("projector")  # SIGKILL: no drain, a batch transaction cut off
        assert _applied(store, layout) < len(events), "killed while it still had batches to apply"
        # Restarted in a new consumer group, which has no offsets: it resumes from the store's (and does
        # not wait for the dead member's session to time out).
        procs.env["STEPSTREAM_STORE_PROJECTOR_GROUP"] = f"{layout.prefix}projector-restarted"
        procs.service("projector", "projector")
        assert wait_for(lambda: _applied(store, layout) == len(events), timeout_s=90), procs.log("projector")
        assert wait_for(lambda: sum(store.dlq_depth().values()) == 5, timeout_s=30)
        assert procs.terminate("projector") == 0
        assert store.projection_errors() == [], "an event applied twice would break a primary key"
        comparison = verify_against_replay(store, Replayer(bootstrap, sources(layout)))
        assert comparison.equal, comparison.as_json()
        assert {t.table: t.rows_a for t in comparison.tables}["task_history"] == len(events)
    finally:
        procs.terminate_all()
        store.close()


@pytest.mark.kafka
def test_rebuild_replays_into_a_fresh_store_and_swaps_it_in_with_the_offsets_the_live_one_had(
    bootstrap: str, layout: TopicLayout, live: Store,
) -> None:
    events = list(histories(600, seed=12))
    publish(bootstrap, layout.events, events[:3000])
    replayer = Replayer(bootstrap, sources(layout), batch_size=500)
    replayer.replay(live)
    # The live store drifts (a projection bug, a bad manual edit): the rebuild repairs it.
    with live._write() as db:
        db.execute("update tasks set status = 'completed' where status = 'error'")
        db.execute("delete from task_history where sequence = 1")
    assert not verify_against_replay(live, replayer).equal
    publish(bootstrap, layout.events, events[3000:])

    report = rebuild_live(live, replayer)
    assert report.swapped and report.records >= len(events)
    assert live.offsets(layout.events) == {p: o for p, o in report.offsets[layout.events].items()}
    assert _applied(live, layout) == len(events)
    assert verify_against_replay(live, replayer).equal


@pytest.mark.kafka
def test_a_rebuild_until_a_point_in_the_log_shows_the_store_as_it_stood_then(
    bootstrap: str, layout: TopicLayout, live: Store,
) -> None:
    replayer = Replayer(bootstrap, sources(layout))
    publish(bootstrap, layout.events, histories(100, seed=13, prefix="early"))
    replayer.replay(live)
    counts_then, offsets_then = live.counts_by_status(), live.offsets(layout.events)
    time.sleep(0.05)
    moment = datetime.now(UTC)
    time.sleep(0.05)
    publish(bootstrap, layout.events, histories(100, seed=14, prefix="late"))
    replayer.replay(live)
    assert live.counts_by_status() != counts_then

    by_offset = live.sibling("by_offset")
    by_time = live.sibling("by_time")
    try:
        rebuild_into(by_offset, replayer, {layout.events: offsets_then})
        rebuild_into(by_time, replayer, until_time(bootstrap, [layout.events, layout.dlq], moment))
        for store in (by_offset, by_time):
            assert store.counts_by_status() == counts_then
            assert store.offsets(layout.events) == offsets_then
        assert verify_stores(by_offset, by_time).equal
    finally:
        by_offset.discard()
        by_time.discard()


@pytest.mark.kafka
def test_verify_reports_each_difference_and_exits_1(
    bootstrap: str, layout: TopicLayout, test_env: dict[str, str], store_spec: StoreSpec,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    for key in ("STEPSTREAM_BOOTSTRAP_SERVERS", "STEPSTREAM_TOPIC_PREFIX", "STEPSTREAM_HOME"):
        monkeypatch.setenv(key, test_env[key])
    monkeypatch.setenv("STEPSTREAM_STORE_URL", str(store_spec))
    events = list(histories(50, seed=15))
    publish(bootstrap, layout.events, events)
    reserved = {e.task_id for e in events if isinstance(e, StepStarted) and e.step == "reserve"}
    assert main(["projections", "rebuild", "--no-progress", "--json"]) == 0
    assert main(["projections", "verify", "--no-progress"]) == 0
    assert "stores are equal" in capsys.readouterr().out

    store = store_spec.open()
    try:
        with store._write() as db:
            db.execute("update steps set calls_used = calls_used + 1 where step = 'reserve'")
            db.execute("delete from alerts")
    finally:
        store.close()
    assert main(["projections", "verify", "--no-progress", "--json"]) == 1
    report = orjson.loads(capsys.readouterr().out)
    tables = {t["table"]: t for t in report["tables"]}
    assert not report["equal"]
    assert tables["steps"]["differing"] == len(reserved) and "calls_used" in tables["steps"]["samples"][0]
    assert tables["alerts"]["only_b"] == tables["alerts"]["rows_b"] > 0
    assert tables["tasks"]["equal"]


@pytest.mark.parametrize(("argv", "message"), [
    (["--until-time", "2026-01-01T00:00:00Z"], "--into STORE"),
    (["--into", "x.db", "--until-time", "yesterday"], "--until-time 'yesterday'"),
    (["--into", "x.db", "--until-offset", "0-12"], "--until-offset '0-12'"),
    (["--into", "mysql://h/db"], "--into"),
    (["--batch-size", "0"], "--batch-size 0"),
    (["--workers", "0"], "--workers 0"),
])
def test_rebuild_refuses_bad_options_naming_them(
    argv: list[str], message: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    monkeypatch.setenv("STEPSTREAM_BOOTSTRAP_SERVERS", "127.0.0.1:1")
    monkeypatch.setenv("STEPSTREAM_HOME", str(tmp_path))
    assert main(["projections", "rebuild", "--no-progress", *argv]) == 1
    assert message in capsys.readouterr().err
