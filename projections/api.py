"""The query API for dashboards: JSON over HTTP (FastAPI, OpenAPI at /openapi.json), the dashboard page
itself (``/``), and Prometheus metrics (``/metrics``), all served from the state store by one process.

Every list is bounded (``limit``), and long ones are keyset-paginated: a response's ``next_cursor``,
passed back as ``cursor``, continues after its last item, stable while new rows arrive. Times are epoch
milliseconds in responses and ISO 8601 in query parameters. Invalid parameters get FastAPI's 422,
whose ``detail[].loc`` names the parameter.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime, timedelta
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import orjson
import structlog
from fastapi import APIRouter, FastAPI, HTTPException, Query
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from eventstore.topics import TopicLayout
from projections.lag import LagReader
from projections.rows import exact_ms
from projections.store import Store

log = structlog.get_logger("stepstream.api")
DASHBOARD = Path(__file__).parent / "dashboard"
MAX_INT64 = 2**63 - 1  # what both stores' integer columns hold: larger values are refused with a 422


class TaskState(str, Enum):
    accepted = "accepted"
    running = "running"
    completed = "completed"
    error = "error"
    compensating = "compensating"
    compensated = "compensated"
    compensation_failed = "compensation_failed"
    rejected = "rejected"


Limit = Annotated[int, Query(ge=1, le=500, description="at most this many items")]


def invalid(parameter: str, message: str, value: Any, where: str = "query") -> RequestValidationError:
    """A 422 shaped like FastAPI's own, naming the parameter (or body field, ``input.amount`` for a nested
    one) at fault."""
    return RequestValidationError([{"type": "value_error", "loc": (where, *parameter.split(".")), "msg": message,
                                    "input": value}])


def encode_cursor(*values: Any) -> str:
    return base64.urlsafe_b64encode(orjson.dumps(values)).decode().rstrip("=")


def decode_cursor(cursor: str | None, types: tuple[type, ...]) -> tuple[Any, ...] | None:
    if cursor is None:
        return None
    try:
        values = orjson.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
    except (binascii.Error, ValueError) as exc:
        raise invalid("cursor", "not a cursor this API returned", cursor) from exc
    if (not isinstance(values, list) or len(values) != len(types)
            or not all(isinstance(v, t) and not isinstance(v, bool) for v, t in zip(values, types, strict=True))
            or any(isinstance(v, int) and not -MAX_INT64 <= v <= MAX_INT64 for v in values)):
        raise invalid("cursor", "not a cursor this API returned", cursor)
    return tuple(values)


def _utc_ms(value: datetime | None) -> int | None:
    return None if value is None else exact_ms(value)


def _page(items: list[dict[str, Any]], limit: int, *cursor_columns: str) -> dict[str, Any]:
    last = items[-1] if len(items) == limit else None
    return {"items": items, "next_cursor": encode_cursor(*(last[c] for c in cursor_columns)) if last else None}


class DashboardCollector(Collector):
    """Gauges read at scrape time from the store and the broker: what the dashboard shows, for alerting."""

    def __init__(self, store: Store, lag: LagReader | None, topics: list[str]) -> None:
        self.store = store
        self.lag = lag
        self.topics = topics

    def collect(self) -> Iterable[Metric]:
        depth = GaugeMetricFamily("stepstream_dlq_depth", "Dead letters not replayed yet, by error kind",
                                  labels=["kind"])
        for kind, count in sorted(self.store.dlq_depth().items()):
            depth.add_metric([kind], count)
        yield depth
        tasks = GaugeMetricFamily("stepstream_tasks", "Tasks in the state store, by state", labels=["state"])
        for state, count in sorted(self.store.counts_by_status().items()):
            tasks.add_metric([state], count)
        yield tasks
        steps = GaugeMetricFamily("stepstream_steps", "Steps in the state store, by state (queued: waiting for an "
                                  "agent)", labels=["state"])
        for state, count in sorted(self.store.step_counts_by_status().items()):
            steps.add_metric([state], count)
        yield steps
        if self.lag is None:
            return
        groups = GaugeMetricFamily("stepstream_group_lag", "Records between a consumer group's committed "
                                   "offset and the last stable offset", labels=["group", "topic", "partition"])
        projection = GaugeMetricFamily("stepstream_projection_lag", "Records between the state store's "
                                       "offsets and the last stable offset", labels=["topic", "partition"])
        try:
            for row in self.lag.groups():
                groups.add_metric([row.group, row.topic, str(row.partition)], row.lag)
            for row in self.lag.projection({t: self.store.offsets(t) for t in self.topics}):
                projection.add_metric([row.topic, str(row.partition)], row.lag)
        except Exception as exc:  # the broker is down: the store's gauges still count
            log.warning("lag not measured", error=repr(exc))
            return
        yield groups
        yield projection


def create_app(store: Store, layout: TopicLayout, lag: LagReader | None = None,
               routers: Sequence[APIRouter] = ()) -> FastAPI:
    """The API over ``store``. ``lag`` reads the broker (None: lag endpoints answer 503); ``routers`` add
    endpoints served by the same process (the write side: ``stepstream.task_api``)."""
    app = FastAPI(title="stepstream", version="1", summary="Dashboards over the stepstream state store",
                  description=__doc__)
    for router in routers:
        app.include_router(router)
    topics = [layout.events, layout.dlq]
    metrics = CollectorRegistry(auto_describe=False)
    metrics.register(DashboardCollector(store, lag, topics))

    @app.get("/api/tasks", tags=["tasks"])
    def tasks(
        state: Annotated[TaskState | None, Query(description="only tasks in this state")] = None,
        workflow: Annotated[str | None, Query(min_length=1, max_length=200)] = None,
        since: Annotated[datetime | None, Query(description="created at or after (ISO 8601)")] = None,
        until: Annotated[datetime | None, Query(description="created before (ISO 8601)")] = None,
        limit: Limit = 50,
        cursor: Annotated[str | None, Query(description="next_cursor of the previous page")] = None,
    ) -> dict[str, Any]:
        """Tasks newest first (by creation time), filtered by state, workflow and creation time."""
        since_ms, until_ms = _utc_ms(since), _utc_ms(until)
        if since_ms is not None and until_ms is not None and until_ms <= since_ms:
            raise invalid("until", "must be after since", until)
        before = decode_cursor(cursor, (int, str))
        items = store.tasks(state=state.value if state else None, workflow=workflow, since_ms=since_ms,
                            until_ms=until_ms, before=(before[0], before[1]) if before else None, limit=limit)
        return _page(items, limit, "created_at", "task_id")

    @app.get("/api/tasks/{task_id}", tags=["tasks"], responses={404: {"description": "no such task in the store"}})
    def task(task_id: str) -> dict[str, Any]:
        """One task, its steps, and its full timeline (every event, decoded)."""
        found = store.task(task_id)
        if found is None:
            raise HTTPException(404, f"no task {task_id!r} in the state store")
        timeline = [{**{k: v for k, v in e.items() if k != "body"}, "event": orjson.loads(e["body"])}
                    for e in store.history(task_id)]
        return {**found, "timeline": timeline}

    @app.get("/api/counts", tags=["tasks"])
    def counts() -> dict[str, Any]:
        """Tasks and steps by state."""
        by_state = store.counts_by_status()
        return {"tasks": by_state, "steps": store.step_counts_by_status(), "total": sum(by_state.values())}

    @app.get("/api/steps/stuck", tags=["steps"])
    def stuck_steps(limit: Limit = 50) -> dict[str, Any]:
        """Steps processing or compensating past their deadline, oldest deadline first."""
        return {"items": store.stuck_steps(datetime.now(UTC), limit)}

    @app.get("/api/steps/queued", tags=["steps"])
    def queued_steps(limit: Limit = 50,
                     minutes: Annotated[int, Query(ge=1, le=7 * 24 * 60, description="the window of `waits`")] = 15,
                     ) -> dict[str, Any]:
        """Attempts waiting for an agent to take them, longest waiting first (``waiting_ms`` so far), and how
        long the attempts taken in the last ``minutes`` waited (``waits``: count, mean, longest)."""
        now = exact_ms(datetime.now(UTC))
        items = [{**row, "waiting_ms": max(0, now - row["queued_at"])} for row in store.queued_steps(limit)]
        return {"items": items, "waits": store.queue_waits(now - minutes * 60000)}

    @app.get("/api/steps/failed", tags=["steps"])
    def failed_steps(limit: Limit = 50) -> dict[str, Any]:
        """Steps that failed, or whose compensation failed, most recent first."""
        return {"items": store.failed_steps(limit)}

    @app.get("/api/alerts", tags=["operators"])
    def alerts(limit: Limit = 50, before_id: Annotated[int | None, Query(ge=1, le=MAX_INT64)] = None) -> dict[str, Any]:
        """Operator alerts, most recent first; ``before_id`` pages back."""
        return {"items": store.alerts(limit, before_id)}

    @app.get("/api/dlq", tags=["operators"])
    def dlq(limit: Limit = 50, replayed: bool | None = None,
            cursor: Annotated[str | None, Query(description="next_cursor of the previous page")] = None,
            ) -> dict[str, Any]:
        """Dead letters, newest first, with their reasons and whether they were replayed."""
        before = decode_cursor(cursor, (int, int, int))
        items = store.dlq_entries(limit=limit, before=(before[0], before[1], before[2]) if before else None,
                                  replayed=replayed)
        return _page(items, limit, "dead_at", "partition", "dlq_offset")

    @app.get("/api/dlq/summary", tags=["operators"])
    def dlq_summary() -> dict[str, Any]:
        """DLQ depth (dead letters not replayed), by error kind."""
        by_kind = store.dlq_depth()
        return {"depth": sum(by_kind.values()), "by_kind": by_kind}

    @app.get("/api/lag", tags=["operators"], responses={503: {"description": "the broker did not answer"}})
    def consumer_lag() -> dict[str, Any]:
        """Lag per consumer group and partition, and the state store's own, against the last stable offset."""
        if lag is None:
            raise HTTPException(503, "lag is not measured: no Kafka cluster configured for this API")
        try:
            groups = lag.groups()
            projection = lag.projection({t: store.offsets(t) for t in topics})
        except Exception as exc:
            raise HTTPException(503, f"the broker did not answer: {exc}") from exc
        return {"groups": [r.as_json() for r in groups], "projection": [r.as_json() for r in projection]}

    @app.get("/api/throughput", tags=["operators"])
    def throughput(minutes: Annotated[int, Query(ge=1, le=7 * 24 * 60)] = 60) -> dict[str, Any]:
        """Events per minute over the last ``minutes`` (from the task history); minutes without any are 0."""
        now = datetime.now(UTC).replace(second=0, microsecond=0) + timedelta(minutes=1)
        start = now - timedelta(minutes=minutes)
        first = _utc_ms(start) or 0
        seen = dict(store.throughput(first, first + minutes * 60000))
        series = [{"minute": first + i * 60000, "events": seen.get(first + i * 60000, 0)} for i in range(minutes)]
        return {"series": series, "total": sum(seen.values())}

    @app.get("/api/health", tags=["operators"])
    def health() -> dict[str, Any]:
        """The store this API reads and how far it is (its offsets)."""
        return {"store": store.describe(),
                "offsets": {t: {str(p): o for p, o in store.offsets(t).items()} for t in topics}}

    @app.get("/metrics", include_in_schema=False)
    def prometheus() -> Response:
        return Response(generate_latest(REGISTRY) + generate_latest(metrics),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/", include_in_schema=False)
    def dashboard() -> FileResponse:
        return FileResponse(DASHBOARD / "index.html")

    app.mount("/static", StaticFiles(directory=DASHBOARD), name="static")
    return app
