"""The state store on both backends: batches with their offsets, refused records, the supervisor's
index-backed scan, migrations, and how stores are named."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import orjson
import pytest

from projections.migrations import MIGRATIONS, statements
from projections.rows import ms
from projections.settings import StoreSpec
from projections.store import Positioned, Store
from schemas.messages import Event, StepAccepted, StepStarted, StepSucceeded, TaskAccepted, TaskRejected
from tests.histories import histories

TOPIC = "t.events"


@pytest.fixture
def store(store_spec: StoreSpec) -> Iterator[Store]:
    opened = store_spec.open()
    try:
        yield opened
    finally:
        opened.close()


def positioned(events: list[Event], partition: int = 0, first_offset: int = 0) -> list[Positioned[Event]]:
    return [Positioned(partition, first_offset + i, e) for i, e in enumerate(events)]


def test_a_batch_is_applied_with_its_offsets_and_records_below_them_are_skipped(store: Store) -> None:
    events = list(histories(20, seed=1))
    first = store.apply_events(TOPIC, positioned(events[:50]))
    assert (first.applied, first.skipped, first.rejected) == (50, 0, 0)
    assert store.offsets(TOPIC) == {0: 50}
    # A restart re-reads from an older position: what the store holds is skipped, the rest applied.
    again = store.apply_events(TOPIC, positioned(events[40:], first_offset=40))
    assert (again.applied, again.skipped) == (len(events) - 50, 10)
    assert store.offsets(TOPIC) == {0: len(events)}
    assert sum(store.counts_by_status().values()) == 20
    task_id = events[0].task_id
    assert [h["sequence"] for h in store.history(task_id)] == [e.sequence for e in events if e.task_id == task_id]


def test_a_record_a_constraint_refuses_is_recorded_once_and_the_rest_of_its_batch_applies(store: Store) -> None:
    accepted = TaskAccepted(task_id="dup", sequence=1, workflow="orders", workflow_version=1, causation_id="c",
                            input={}, input_digest="d")
    clash = accepted.model_copy(update={"sequence": 2, "message_id": "other"})  # a second TaskAccepted
    events = [accepted, clash, *histories(2, seed=2)]
    result = store.apply_events(TOPIC, positioned(events, partition=1))
    assert (result.applied, result.rejected) == (len(events) - 1, 1)
    assert store.offsets(TOPIC) == {1: len(events)}, "the offset moves past the refused record"
    [error] = store.projection_errors()
    assert (error["partition"], error["event_offset"], error["task_id"]) == (1, 1, "dup")
    assert error["event_type"] == "TaskAccepted"
    assert sum(store.counts_by_status().values()) == 3


def test_a_history_body_is_the_text_the_event_dumped_through_orjson_gave(store: Store) -> None:
    """Bodies are pydantic's JSON now: stores written before hold orjson's text of ``model_dump(mode="json")``,
    and verify compares them with a fresh replay byte for byte."""
    odd = {"float": 0.1, "big": 1e20, "tiny": 5e-324, "neg_zero": -0.0, "int": 2**63 - 1, "text": "é 😀 \u2028\x01",
           "nested": [1, [2.5, None, {"b": True}]], "empty": {}}
    accepted = TaskAccepted(task_id="odd", sequence=1, workflow="orders", workflow_version=1, causation_id="c",
                            input=odd, input_digest="d", retention_s=0.25)
    events = [accepted, *histories(30, seed=4)]
    store.apply_events(TOPIC, positioned(events))
    for event in events:
        [row] = [h for h in store.history(event.task_id) if h["sequence"] == event.sequence]
        assert row["body"] == orjson.dumps(event.model_dump(mode="json")).decode()


def test_a_rejected_task_admitted_on_a_later_submission_keeps_one_row_and_its_creation_time(store: Store) -> None:
    rejected = TaskRejected(task_id="r", sequence=1, workflow="orders", workflow_version=1, causation_id="c",
                            reason="admission control: full", input_digest="d",
                            occurred_at=datetime(2026, 1, 1, tzinfo=UTC))
    again = rejected.model_copy(update={"sequence": 2, "message_id": "m2",
                                        "occurred_at": datetime(2026, 1, 1, 0, 1, tzinfo=UTC)})
    admitted = TaskAccepted(task_id="r", sequence=3, workflow="orders", workflow_version=1, causation_id="c3",
                            input={"n": 1}, input_digest="d", occurred_at=datetime(2026, 1, 1, 0, 2, tzinfo=UTC))
    result = store.apply_events(TOPIC, positioned([rejected, again, admitted]))
    assert (result.applied, result.rejected) == (3, 0)
    task = store.task("r")
    assert task is not None and (task["status"], task["error"]) == ("accepted", None)
    assert task["created_at"] == int(rejected.occurred_at.timestamp() * 1000)
    assert [h["sequence"] for h in store.history("r")] == [1, 2, 3]
    assert store.counts_by_status() == {"accepted": 1}


def test_a_step_shows_queued_with_its_start_by_then_running_with_how_long_it_waited(store: Store) -> None:
    at = datetime(2026, 1, 1, tzinfo=UTC)
    common = {"task_id": "q", "workflow": "orders", "workflow_version": 1, "causation_id": "c"}
    attempt = {"step": "reserve", "attempt_id": "q:reserve:1"}
    events: list[Event] = [
        TaskAccepted(**common, sequence=1, occurred_at=at, input={}, input_digest="d"),
        StepStarted(**common, **attempt, sequence=2, occurred_at=at, step_index=0, attempt=1, calls_allowed=3,
                    start_by=at + timedelta(seconds=300), complete_by=at + timedelta(seconds=305)),
    ]
    store.apply_events(TOPIC, positioned(events))
    [queued] = store.queued_steps()
    assert (queued["status"], queued["queued_at"], queued["complete_by"], queued["accepted_at"]) == (
        "queued", ms(at), ms(at + timedelta(seconds=300)), None), "the deadline in force is the start-by"
    assert store.expired_steps(at + timedelta(seconds=299), not_before=at) == []
    taken = at + timedelta(seconds=42)
    more: list[Event] = [
        StepAccepted(**common, **attempt, sequence=3, occurred_at=taken, accepted_at=taken,
                     complete_by=taken + timedelta(seconds=5), waited_ms=42_000),
        StepSucceeded(**common, **attempt, sequence=4, occurred_at=taken, output={}, calls=1),
    ]
    store.apply_events(TOPIC, positioned(more[:1], first_offset=2))
    task = store.task("q")
    assert task is not None
    [step] = task["steps"]
    assert (step["status"], step["complete_by"], step["accepted_at"], step["waited_ms"]) == (
        "processing", ms(taken + timedelta(seconds=5)), ms(taken), 42_000)
    assert store.queued_steps() == []
    [expired] = store.expired_steps(taken + timedelta(seconds=5), not_before=at)
    assert expired.attempt_id == "q:reserve:1"
    store.apply_events(TOPIC, positioned(more[1:], first_offset=3))
    assert store.queue_waits(ms(at)) == {"accepted": 1, "mean_ms": 42_000, "max_ms": 42_000}


def _expired_fixture(store: Store, tasks: int) -> tuple[datetime, int]:
    """Many finished tasks and every 10th one left processing, its deadline 30 minutes ago.
    Returns the start and how many steps are left processing."""
    start = datetime.now(UTC) - timedelta(minutes=30)
    events = list(histories(tasks, seed=3, in_flight_every=10, start=start))
    for i in range(0, len(events), 2000):
        store.apply_events(TOPIC, positioned(events[i:i + 2000], first_offset=i))
    store.analyze()
    last = {e.task_id: e for e in events}
    return start, sum(isinstance(e, StepStarted | StepAccepted) for e in last.values())


def test_the_supervisor_scan_uses_the_expiry_index_and_pages_through_every_expired_step_once(store: Store) -> None:
    start, expired = _expired_fixture(store, 3000)
    now = datetime.now(UTC)
    plan = store.expired_steps_plan(now, not_before=now - timedelta(hours=1), limit=50)
    assert "steps_leased" in plan, plan
    for full_scan_or_sort in ("SCAN steps", "TEMP B-TREE", "Seq Scan", "Sort"):
        assert full_scan_or_sort not in plan, plan

    seen: list[tuple[str, str]] = []
    after = None
    pages = 0
    while True:
        page = store.expired_steps(now, not_before=now - timedelta(hours=1), after=after, limit=50)
        assert len(page) <= 50
        pages += 1
        seen.extend((s.task_id, s.step) for s in page)
        if len(page) < 50:
            break
        after = (page[-1].complete_by_ms, page[-1].task_id, page[-1].step)
    assert len(seen) == len(set(seen)) == expired > 200
    assert pages == expired // 50 + 1
    assert store.expired_steps(now, not_before=start + timedelta(minutes=5)) == [], "the window bounds the scan"


def test_migrations_translate_only_the_documented_dialect_differences() -> None:
    versions = [v for v, _ in MIGRATIONS]
    assert versions == sorted(set(versions)) and versions[0] == 1
    [sqlite_alerts] = [s for s in statements(MIGRATIONS[0][1], "sqlite") if "create table alerts" in s]
    [pg_alerts] = [s for s in statements(MIGRATIONS[0][1], "postgresql") if "create table alerts" in s]
    assert "id integer primary key autoincrement" in sqlite_alerts
    assert "id bigint generated by default as identity primary key" in pg_alerts
    assert "occurred_at bigint not null" in pg_alerts and "integer" not in pg_alerts


def test_stores_opened_at_once_by_several_processes_migrate_once(store_spec: StoreSpec) -> None:
    errors: list[BaseException] = []

    def open_and_close() -> None:
        try:
            store_spec.open().close()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=open_and_close) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    store = store_spec.open()
    try:
        assert store.offsets(TOPIC) == {}
    finally:
        store.close()


@pytest.mark.parametrize(("text", "expected"), [
    ("postgresql://u@h:5/db", StoreSpec("postgresql", "postgresql://u@h:5/db", "stepstream")),
    ("postgres://h/db?schema=pit_1&sslmode=disable", StoreSpec("postgresql", "postgres://h/db?sslmode=disable",
                                                               "pit_1")),
    ("sqlite:///var/lib/s.db", StoreSpec("sqlite", "/var/lib/s.db")),
    ("sqlite:rel/s.db", StoreSpec("sqlite", "rel/s.db")),
    ("state.db", StoreSpec("sqlite", "state.db")),
])
def test_a_store_is_named_by_one_spec_string(text: str, expected: StoreSpec) -> None:
    assert StoreSpec.parse(text) == expected


@pytest.mark.parametrize("text", ["mysql://h/db", "postgresql://h/db?schema=a;drop"])
def test_a_spec_naming_no_store_we_know_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="store"):
        StoreSpec.parse(text)
