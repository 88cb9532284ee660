"""The read routes: tasks, steps, alerts, dead letters, lag, throughput and health, queried from the store.

Only the HTTP shape lives here (parameters, bounds, cursors, 404s and 503s); every query is the store's.
"""

from __future__ import annotations

import base64
import binascii
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any

import orjson
import structlog
from fastapi import APIRouter, HTTPException, Query

from projections.attempts import Attempt, attempts
from projections.charts import per_minute
from projections.lag import LagReader
from projections.rows import exact_ms
from projections.store import Store
from schemas.states import StepStatus, TaskStatus
from stepstream.http.errors import invalid
from stepstream.presence import Presence, no_agent, step_agent

log = structlog.get_logger("stepstream.api")

MAX_INT64 = 2**63 - 1  # what both stores' integer columns hold: larger values are refused with a 422


Limit = Annotated[int, Query(ge=1, le=500, description="at most this many items")]


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


def _minute_window(minutes: int) -> int:
    """The start (epoch ms) of a window of whole minutes that ends with the current minute."""
    now = datetime.now(UTC).replace(second=0, microsecond=0) + timedelta(minutes=1)
    return exact_ms(now - timedelta(minutes=minutes))


def _page(items: list[dict[str, Any]], limit: int, *cursor_columns: str) -> dict[str, Any]:
    last = items[-1] if len(items) == limit else None
    return {"items": items, "next_cursor": encode_cursor(*(last[c] for c in cursor_columns)) if last else None}


def read_router(store: Store, topics: list[str], lag: LagReader | None,
                presence: Presence | None = None) -> APIRouter:
    """The query endpoints over ``store``; ``topics`` are the ones whose offsets the store keeps, ``lag``
    reads the broker (None: the lag endpoint answers 503), and ``presence`` the agents' groups (None: the
    agents endpoint answers 503, and a task does not say which of its steps no agent runs for)."""
    router = APIRouter()

    @router.get("/api/tasks", tags=["tasks"])
    def tasks(
        state: Annotated[TaskStatus | None, Query(description="only tasks in this state")] = None,
        workflow: Annotated[str | None, Query(min_length=1, max_length=200)] = None,
        version: Annotated[int | None, Query(ge=1, le=MAX_INT64, description="only this workflow version")] = None,
        q: Annotated[str | None, Query(min_length=1, max_length=200,
                                       description="only tasks whose id starts with this (case-sensitive)")] = None,
        submitter: Annotated[str | None, Query(min_length=1, max_length=200,
                                               description="only tasks this submitter submitted")] = None,
        since: Annotated[datetime | None, Query(description="created at or after (ISO 8601)")] = None,
        until: Annotated[datetime | None, Query(description="created before (ISO 8601)")] = None,
        limit: Limit = 50,
        cursor: Annotated[str | None, Query(description="next_cursor of the previous page")] = None,
    ) -> dict[str, Any]:
        """Tasks newest first (by creation time), filtered by state, workflow (and version), submitter, creation
        time and task id prefix; ``total`` is how many match, over every page."""
        since_ms, until_ms = _utc_ms(since), _utc_ms(until)
        if since_ms is not None and until_ms is not None and until_ms <= since_ms:
            raise invalid("until", "must be after since", until)
        if version is not None and workflow is None:
            raise invalid("version", "needs workflow: a version number belongs to one workflow", version)
        before = decode_cursor(cursor, (int, str))
        filters: dict[str, Any] = {"state": state, "workflow": workflow, "version": version, "prefix": q,
                                   "submitter": submitter, "since_ms": since_ms, "until_ms": until_ms}
        items = store.tasks(**filters, before=(before[0], before[1]) if before else None, limit=limit)
        return {**_page(items, limit, "created_at", "task_id"), "total": store.count_tasks(**filters)}

    @router.get("/api/tasks/{task_id}", tags=["tasks"], responses={404: {"description": "no such task in the store"}})
    def task(task_id: str) -> dict[str, Any]:
        """One task, its steps, its full timeline (every event, decoded), ``attempts``: every attempt of its steps
        and their undos with its outcome classified (``projections.attempts``) and its agent, and
        ``unattended``: its steps in progress whose agent has no process running ("no agent running for `NAME`")."""
        found = store.task(task_id)
        if found is None:
            raise HTTPException(404, f"no task {task_id!r} in the state store")
        timeline = [{**{k: v for k, v in e.items() if k != "body"}, "event": orjson.loads(e["body"])}
                    for e in store.history(task_id)]
        return {**found, "unattended": _unattended(found), "timeline": timeline,
                "attempts": [{**a.as_json(), "agent": _agent(found, a)} for a in attempts(timeline)]}

    def _agent(task: dict[str, Any], attempt: Attempt) -> str | None:
        if presence is None:
            return None
        status = StepStatus.COMPENSATING if attempt.compensation else StepStatus.PROCESSING
        return step_agent(presence.registry, task["workflow"], task["workflow_version"], attempt.step, status)

    def _unattended(task: dict[str, Any]) -> list[dict[str, str]]:
        if presence is None:
            return []
        try:
            return presence.unattended(task)
        except Exception as exc:  # the broker is down: the task is still served from the store
            log.warning("agents not checked", error=repr(exc))
            return []

    @router.get("/api/agents", tags=["operators"], responses={503: {"description": "the broker did not answer"}})
    def agents() -> dict[str, Any]:
        """Every agent the workflows name, with its consumer group's members (0: no process of it runs, and
        the steps handed to it wait for nobody)."""
        if presence is None:
            raise HTTPException(503, "agents are not checked: no Kafka cluster configured for this API")
        try:
            members = presence.groups.members()
        except Exception as exc:
            raise HTTPException(503, f"the broker did not answer: {exc}") from exc
        return {"items": [{"agent": agent, "members": count, "reason": no_agent(agent) if count == 0 else None}
                          for agent, count in sorted(members.items())]}

    @router.get("/api/counts", tags=["tasks"])
    def counts() -> dict[str, Any]:
        """Tasks and steps by state."""
        by_state = store.counts_by_status()
        return {"tasks": by_state, "steps": store.step_counts_by_status(), "total": sum(by_state.values())}

    @router.get("/api/steps/stuck", tags=["steps"])
    def stuck_steps(limit: Limit = 50) -> dict[str, Any]:
        """Steps processing or compensating past their deadline, oldest deadline first."""
        return {"items": store.stuck_steps(datetime.now(UTC), limit)}

    @router.get("/api/steps/queued", tags=["steps"])
    def queued_steps(limit: Limit = 50,
                     minutes: Annotated[int, Query(ge=1, le=7 * 24 * 60, description="the window of `waits`")] = 15,
                     ) -> dict[str, Any]:
        """Attempts waiting for an agent to take them, longest waiting first (``waiting_ms`` so far), and how
        long the attempts taken in the last ``minutes`` waited (``waits``: count, mean, longest)."""
        now = exact_ms(datetime.now(UTC))
        items = [{**row, "waiting_ms": max(0, now - row["queued_at"])} for row in store.queued_steps(limit)]
        return {"items": items, "waits": store.queue_waits(now - minutes * 60000)}

    @router.get("/api/steps/waiting", tags=["steps"])
    def waiting_steps(limit: Limit = 50) -> dict[str, Any]:
        """Steps waiting for a timer before their next attempt, soonest first: ``retry_at``, ``wait_reason``,
        and ``retry_in_ms`` from now (negative: due, about to be fired)."""
        now = exact_ms(datetime.now(UTC))
        return {"items": [{**row, "retry_in_ms": row["retry_at"] - now} for row in store.waiting_steps(limit)]}

    @router.get("/api/steps/failed", tags=["steps"])
    def failed_steps(limit: Limit = 50) -> dict[str, Any]:
        """Steps that failed, or whose compensation failed, most recent first."""
        return {"items": store.failed_steps(limit)}

    @router.get("/api/alerts", tags=["operators"])
    def alerts(limit: Limit = 50, before_id: Annotated[int | None, Query(ge=1, le=MAX_INT64)] = None) -> dict[str, Any]:
        """Operator alerts, most recent first; ``before_id`` pages back."""
        return {"items": store.alerts(limit, before_id)}

    @router.get("/api/dlq", tags=["operators"])
    def dlq(limit: Limit = 50, replayed: bool | None = None, discarded: bool | None = None,
            cursor: Annotated[str | None, Query(description="next_cursor of the previous page")] = None,
            ) -> dict[str, Any]:
        """Dead letters, newest first, with their reasons and whether they were replayed or discarded."""
        before = decode_cursor(cursor, (int, int, int))
        items = store.dlq_entries(limit=limit, before=(before[0], before[1], before[2]) if before else None,
                                  replayed=replayed, discarded=discarded)
        return _page(items, limit, "dead_at", "partition", "dlq_offset")

    @router.get("/api/dlq/summary", tags=["operators"])
    def dlq_summary() -> dict[str, Any]:
        """DLQ depth (dead letters neither replayed nor discarded), by error kind."""
        by_kind = store.dlq_depth()
        return {"depth": sum(by_kind.values()), "by_kind": by_kind}

    @router.get("/api/lag", tags=["operators"], responses={503: {"description": "the broker did not answer"}})
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

    @router.get("/api/throughput", tags=["operators"])
    def throughput(minutes: Annotated[int, Query(ge=1, le=7 * 24 * 60)] = 60) -> dict[str, Any]:
        """Events per minute over the last ``minutes`` (from the task history); minutes without any are 0."""
        first = _minute_window(minutes)
        seen = dict(store.throughput(first, first + minutes * 60000))
        series = [{"minute": first + i * 60000, "events": seen.get(first + i * 60000, 0)} for i in range(minutes)]
        return {"series": series, "total": sum(seen.values())}

    @router.get("/api/charts", tags=["operators"])
    def charts(minutes: Annotated[int, Query(ge=1, le=24 * 60)] = 60) -> dict[str, Any]:
        """Per minute over the last ``minutes``: tasks completed and compensated, step latency p50/p99 (hand-over
        to result, ms; null: no attempt ended that minute) and queue depth (``projections.charts``)."""
        first = _minute_window(minutes)
        return {"series": per_minute(store.chart_rows(first, first + minutes * 60000), first, minutes)}

    @router.get("/api/health", tags=["operators"])
    def health() -> dict[str, Any]:
        """The store this API reads and how far it is (its offsets)."""
        return {"store": store.describe(),
                "offsets": {t: {str(p): o for p, o in store.offsets(t).items()} for t in topics}}

    return router
