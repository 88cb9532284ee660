"""The dashboard API over a state store, on both backends: filters, keyset pages, a task's timeline,
counts, stuck and failed steps, alerts, dead letters, throughput, lag, metrics and 422s."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from confluent_kafka import Consumer, TopicPartition
from fastapi.testclient import TestClient

from eventstore.dlq import (
    DISCARD_OF,
    DISCARD_SHREDDED,
    DISCARD_TIME,
    HEADER_PREFIX,
    REPLAY_OF,
    REPLAY_TIME,
    REPLAY_TO,
    DeadLetter,
    dlq_headers,
)
from eventstore.topics import TopicLayout
from projections.dlq_rows import project_dead_letter
from projections.lag import PROJECTION, LagReader
from projections.settings import StoreSpec
from projections.store import Positioned, Store
from schemas.messages import (
    Event,
    OperatorAlert,
    StepAccepted,
    StepFailed,
    StepStarted,
    TaskAccepted,
    TaskCompleted,
)
from stepstream.http.app import create_app
from tests.histories import histories, publish

LAYOUT = TopicLayout(prefix="api.", partitions=3)
START = datetime.now(UTC) - timedelta(minutes=20)


@pytest.fixture
def events() -> list[Event]:
    return list(histories(300, seed=21, in_flight_every=15, start=START))


@pytest.fixture
def store(store_spec: StoreSpec, events: list[Event]) -> Iterator[Store]:
    opened = store_spec.open()
    opened.apply_events(LAYOUT.events, [Positioned(0, i, e) for i, e in enumerate(events)])
    letters = [_letter(0, 0, "corrupt"), _letter(0, 1, "schema_invalid"), _letter(1, 0, "corrupt"),
               _marker(0, 2, replays=(0, 0)), _letter(1, 1, "poison"), _discard(1, 2, discards=(1, 1)),
               _discard(1, 3, discards=(1, 1), shredded=b"")]
    opened.apply_batch(LAYOUT.dlq, [Positioned(d.partition, d.offset, d) for d in letters], project_dead_letter)
    try:
        yield opened
    finally:
        opened.close()


def _letter(partition: int, offset: int, kind: str) -> DeadLetter:
    headers = dlq_headers(reason=f"{kind} bytes", error_class="DecodeError", kind=kind, topic=LAYOUT.inbox,
                          partition=partition, offset=100 + offset, group="api.scheduler")
    return DeadLetter(partition, offset, b"task-x", b"\x00bad", tuple(headers), 0)


def _marker(partition: int, offset: int, replays: tuple[int, int]) -> DeadLetter:
    headers = ((HEADER_PREFIX + REPLAY_OF, f"{replays[0]}:{replays[1]}".encode()),
               (HEADER_PREFIX + REPLAY_TO, b"api.inbox[0]@7"),
               (HEADER_PREFIX + REPLAY_TIME, b"2026-01-01T00:00:00+00:00"))
    return DeadLetter(partition, offset, b"task-x", None, headers, 0)


def _discard(partition: int, offset: int, discards: tuple[int, int], shredded: bytes = b"task-x#ref") -> DeadLetter:
    headers = ((HEADER_PREFIX + DISCARD_OF, f"{discards[0]}:{discards[1]}".encode()),
               (HEADER_PREFIX + DISCARD_TIME, b"2026-01-02T00:00:00+00:00"),
               (HEADER_PREFIX + DISCARD_SHREDDED, shredded))
    return DeadLetter(partition, offset, b"task-x", None, headers, 0)


@pytest.fixture
def client(store: Store) -> TestClient:
    return TestClient(create_app(store, LAYOUT))


def _walk(client: TestClient, query: str, limit: int) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    cursor = None
    while True:
        page = client.get(f"/api/tasks?{query}&limit={limit}" + (f"&cursor={cursor}" if cursor else "")).json()
        assert len(page["items"]) <= limit
        items.extend(page["items"])
        cursor = page["next_cursor"]
        if cursor is None:
            return items


def test_tasks_are_filtered_by_state_workflow_and_time_and_pages_walk_every_match_once(
    client: TestClient, events: list[Event],
) -> None:
    everything = _walk(client, "", 40)
    assert len(everything) == len({e.task_id for e in events}) == 300
    assert [t["created_at"] for t in everything] == sorted((t["created_at"] for t in everything), reverse=True)

    errors = _walk(client, "state=error", 7)
    assert errors and {t["status"] for t in errors} == {"error"}
    assert len(errors) == client.get("/api/counts").json()["tasks"]["error"]

    refunds = _walk(client, "workflow=refunds", 25)
    assert {t["workflow"] for t in refunds} == {"refunds"}
    assert len(refunds) == len({e.task_id for e in events if e.workflow == "refunds"})

    created = everything[150]["created_at"]
    since = (datetime(1970, 1, 1, tzinfo=UTC) + timedelta(milliseconds=created)).isoformat()
    later = _walk(client, f"since={since.replace('+', '%2B')}", 33)
    assert len(later) == 151 and all(t["created_at"] >= everything[150]["created_at"] for t in later)
    earlier = _walk(client, f"until={since.replace('+', '%2B')}", 50)
    assert len(earlier) == 149


def test_the_task_list_searches_by_id_prefix_submitter_and_version_and_says_how_many_match(
    store: Store, client: TestClient, events: list[Event],
) -> None:
    extra = [TaskAccepted(task_id=task_id, sequence=1, workflow="orders", workflow_version=version,
                          causation_id="c", input={}, input_digest="d", submitter=submitter)
             for task_id, version, submitter in (("shop-a1", 2, "shop"), ("shop-a2", 1, "shop"),
                                                 ("shop-b1", 2, "back-office"), ("shop-\U0010ffff", 2, "shop"))]
    store.apply_events(LAYOUT.events, [Positioned(1, i, e) for i, e in enumerate(extra)])

    def ids(query: str, limit: int = 2) -> list[str]:
        found = _walk(client, query, limit)
        assert client.get(f"/api/tasks?{query}&limit={limit}").json()["total"] == len(found)
        return sorted(t["task_id"] for t in found)

    assert ids("q=shop-a") == ["shop-a1", "shop-a2"]
    assert ids("q=shop-") == ["shop-a1", "shop-a2", "shop-b1", "shop-\U0010ffff"]
    assert ids("q=Shop-a") == [], "ids are case-sensitive"
    assert ids("q=task-000001", 7) == [f"task-000001{i}" for i in range(10)]
    assert ids("submitter=shop") == ["shop-a1", "shop-a2", "shop-\U0010ffff"]
    assert ids("submitter=shop&q=shop-a&workflow=orders&version=2") == ["shop-a1"]
    assert ids("state=error&q=shop") == []
    everything = client.get("/api/tasks?limit=1").json()
    assert everything["total"] == 304 and len(everything["items"]) == 1
    assert all(t["submitter"] is None for t in _walk(client, "q=task-", 100))
    store.NARROW_PREFIX = 2  # SQLite walks tasks newest first for a prefix many share
    assert ids("q=shop-") == ["shop-a1", "shop-a2", "shop-b1", "shop-\U0010ffff"]
    assert ids("q=task-000001", 7) == [f"task-000001{i}" for i in range(10)]


def test_a_task_shows_its_steps_and_its_whole_timeline_in_order(client: TestClient, events: list[Event]) -> None:
    task_id = next(e.task_id for e in events if isinstance(e, StepFailed))
    body = client.get(f"/api/tasks/{task_id}").json()
    mine = [e for e in events if e.task_id == task_id]
    assert [e["sequence"] for e in body["timeline"]] == [e.sequence for e in mine]
    assert [e["event_type"] for e in body["timeline"]] == [type(e).__name__ for e in mine]
    assert body["timeline"][0]["event"]["task_id"] == task_id
    assert [s["step"] for s in body["steps"]] == list(dict.fromkeys(
        e.step for e in mine if isinstance(e, StepStarted)))
    missing = client.get("/api/tasks/no-such-task")
    assert missing.status_code == 404 and "no-such-task" in missing.json()["detail"]


def test_counts_stuck_and_failed_steps_alerts_dead_letters_and_throughput_agree_with_the_store(
    client: TestClient, store: Store, events: list[Event],
) -> None:
    counts = client.get("/api/counts").json()
    assert counts["tasks"] == store.counts_by_status() and counts["total"] == 300
    last = {e.task_id: e for e in events}
    in_flight = sum(isinstance(e, StepStarted | StepAccepted) for e in last.values())
    stuck = client.get("/api/steps/stuck?limit=500").json()["items"]
    assert len(stuck) == in_flight > 0 and {s["status"] for s in stuck} == {"processing"}
    failed = client.get("/api/steps/failed?limit=500").json()["items"]
    assert {s["status"] for s in failed} <= {"failed", "compensation_failed"} and failed
    assert [s["updated_at"] for s in failed] == sorted((s["updated_at"] for s in failed), reverse=True)
    alerts = client.get("/api/alerts?limit=5").json()["items"]
    assert len(alerts) == 5 and [a["id"] for a in alerts] == sorted((a["id"] for a in alerts), reverse=True)
    older = client.get(f"/api/alerts?limit=500&before_id={alerts[-1]['id']}").json()["items"]
    assert len(older) + 5 == sum(isinstance(e, OperatorAlert) for e in events)

    assert client.get("/api/dlq/summary").json() == {"depth": 2, "by_kind": {"corrupt": 1, "schema_invalid": 1}}
    dead = client.get("/api/dlq?limit=2").json()
    more = client.get(f"/api/dlq?limit=3&cursor={dead['next_cursor']}").json()
    entries = {(d["partition"], d["dlq_offset"]): d for d in dead["items"] + more["items"]}
    assert set(entries) == {(0, 0), (0, 1), (1, 0), (1, 1)} and more["next_cursor"] is None
    assert entries[(0, 0)]["replayed_to"] == "api.inbox[0]@7" and entries[(0, 1)]["replayed_at"] is None
    assert [d["dlq_offset"] for d in client.get("/api/dlq?replayed=true").json()["items"]] == [0]
    discarded = client.get("/api/dlq?discarded=true").json()["items"]
    assert [(d["partition"], d["dlq_offset"], d["discard_shredded"]) for d in discarded] == [(1, 1, "task-x#ref")], \
        "discarded once: a second discard (nothing left to shred) changes nothing"
    assert entries[(1, 1)]["discarded_at"] == 1767312000000 and entries[(1, 0)]["discarded_at"] is None

    series = client.get("/api/throughput?minutes=60").json()
    assert series["total"] == len(events) and len(series["series"]) == 60
    assert sum(p["events"] for p in series["series"]) == len(events)


def test_a_task_lists_every_attempt_classified_and_the_charts_count_what_the_history_holds(
    client: TestClient, events: list[Event],
) -> None:
    task_id = next(e.task_id for e in events if isinstance(e, StepFailed))
    mine = [e for e in events if e.task_id == task_id]
    found = client.get(f"/api/tasks/{task_id}").json()["attempts"]
    assert [a["attempt_id"] for a in found] == [e.attempt_id for e in mine if isinstance(e, StepStarted)]
    failures = {e.attempt_id: e for e in mine if isinstance(e, StepFailed)}
    assert {a["attempt_id"] for a in found if a["error"]} == set(failures)
    assert all(a["outcome"] in {"failed", "timed out", "refused", "throttled"} for a in found if a["error"])

    series = client.get("/api/charts?minutes=60").json()["series"]
    assert len(series) == 60
    assert sum(p["completed"] for p in series) == sum(isinstance(e, TaskCompleted) for e in events) > 0
    assert any(p["latency_p50_ms"] is not None for p in series)
    assert client.get("/api/charts?minutes=0").status_code == 422


@pytest.mark.parametrize(("query", "parameter"), [
    ("/api/tasks?state=bogus", "state"),
    ("/api/tasks?limit=0", "limit"),
    ("/api/tasks?limit=501", "limit"),
    ("/api/tasks?since=yesterday", "since"),
    ("/api/tasks?cursor=garbage!", "cursor"),
    ("/api/tasks?cursor=WzEsMiwzXQ", "cursor"),  # a well-formed cursor of another list
    ("/api/tasks?since=2026-01-02T00:00:00Z&until=2026-01-01T00:00:00Z", "until"),
    ("/api/dlq?replayed=perhaps", "replayed"),
    ("/api/alerts?before_id=0", "before_id"),
    ("/api/throughput?minutes=0", "minutes"),
    ("/api/tasks?q=", "q"),
    ("/api/tasks?submitter=", "submitter"),
    ("/api/tasks?workflow=orders&version=0", "version"),
    ("/api/tasks?version=2", "version"),  # a version without its workflow means nothing
])
def test_an_invalid_parameter_gets_a_422_naming_it(client: TestClient, query: str, parameter: str) -> None:
    response = client.get(query)
    assert response.status_code == 422
    assert [d["loc"] for d in response.json()["detail"]] == [["query", parameter]]


def test_openapi_describes_every_endpoint(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    assert set(paths) == {"/api/tasks", "/api/tasks/{task_id}", "/api/counts", "/api/steps/stuck",
                          "/api/steps/queued", "/api/steps/waiting", "/api/steps/failed", "/api/alerts", "/api/dlq",
                          "/api/dlq/summary", "/api/lag", "/api/throughput", "/api/health", "/api/agents",
                          "/api/charts", "/api/dependencies"}
    assert {p["name"] for p in paths["/api/tasks"]["get"]["parameters"]} == {
        "state", "workflow", "version", "q", "submitter", "since", "until", "limit", "cursor"}


@pytest.mark.kafka
def test_lag_is_committed_offsets_against_the_end_of_the_log_per_group_and_partition(
    bootstrap: str, layout: TopicLayout, store_spec: StoreSpec,
) -> None:
    sent = publish(bootstrap, layout.events, histories(40, seed=22))
    group = f"{layout.prefix}reader"
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False})
    consumer.commit(offsets=[TopicPartition(layout.events, 0, 3)], asynchronous=False)
    consumer.close()
    store = store_spec.open()
    try:
        store.apply_events(layout.events, [Positioned(1, 0, e) for e in histories(1, seed=23)][:1])
        reader = LagReader(bootstrap, layout.prefix)
        ends = reader.ends((layout.events, p) for p in range(3))
        assert sum(ends.values()) == sent
        rows = {(r.group, r.partition): r for r in reader.groups()}
        assert rows[(group, 0)].lag == ends[(layout.events, 0)] - 3 and rows[(group, 0)].position == 3
        projection = {r.partition: r for r in reader.projection({layout.events: store.offsets(layout.events)})}
        assert {p: r.lag for p, r in projection.items()} == {0: ends[(layout.events, 0)],
                                                            1: ends[(layout.events, 1)] - 1,
                                                            2: ends[(layout.events, 2)]}
        assert {r.group for r in projection.values()} == {PROJECTION}

        client = TestClient(create_app(store, layout, reader))
        body = client.get("/api/lag").json()
        assert {(g["group"], g["partition"], g["lag"]) for g in body["groups"]} == {
            (r.group, r.partition, r.lag) for r in rows.values()}
        metrics = client.get("/metrics").text
        assert f'stepstream_group_lag{{group="{group}",partition="0",topic="{layout.events}"}} ' \
               f'{float(ends[(layout.events, 0)] - 3)}' in metrics
        assert f'stepstream_projection_lag{{partition="1",topic="{layout.events}"}}' in metrics
    finally:
        store.close()


def test_queued_steps_show_how_long_they_have_waited_and_taken_ones_how_long_they_waited(
    client: TestClient, store: Store,
) -> None:
    started = datetime.now(UTC) - timedelta(seconds=30)
    common = {"task_id": "waits", "workflow": "orders", "workflow_version": 1, "causation_id": "c",
              "occurred_at": started}
    store.apply_events(LAYOUT.events, [Positioned(2, i, e) for i, e in enumerate([
        TaskAccepted(**common, sequence=1, input={}, input_digest="d"),
        StepStarted(**common, sequence=2, step="reserve", step_index=0, attempt=1, attempt_id="waits:reserve:1",
                    calls_allowed=1, start_by=started + timedelta(seconds=300),
                    complete_by=started + timedelta(seconds=305)),
    ])])
    queued = client.get("/api/steps/queued").json()
    [item] = queued["items"]
    assert (item["task_id"], item["status"]) == ("waits", "queued") and 30_000 <= item["waiting_ms"] < 60_000
    waits = queued["waits"]  # the histories' steps were taken 20 minutes ago, out of the default window
    assert waits == {"accepted": 0, "mean_ms": None, "max_ms": None}
    hour = client.get("/api/steps/queued?minutes=60").json()["waits"]
    assert hour["accepted"] > 0 and 0 <= hour["mean_ms"] <= hour["max_ms"] <= 2000
    assert 'stepstream_steps{state="queued"} 1.0' in client.get("/metrics").text


def test_metrics_expose_dlq_depth_and_task_counts_without_a_broker(client: TestClient, store: Store) -> None:
    metrics = client.get("/metrics").text
    assert 'stepstream_dlq_depth{kind="corrupt"} 1.0' in metrics
    assert 'stepstream_dlq_depth{kind="schema_invalid"} 1.0' in metrics
    for state, count in store.counts_by_status().items():
        assert f'stepstream_tasks{{state="{state}"}} {float(count)}' in metrics
    assert client.get("/api/lag").status_code == 503


def test_the_dashboard_page_and_its_assets_are_served(client: TestClient) -> None:
    page = client.get("/")
    assert page.status_code == 200 and "/static/dashboard.js" in page.text
    assert client.get("/static/dashboard.js").status_code == 200
    assert client.get("/static/dashboard.css").status_code == 200
