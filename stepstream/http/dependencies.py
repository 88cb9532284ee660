"""``GET /api/dependencies``: each agent's dependencies as their processes last reported them (``agents.reporting``
on the compacted ``dependencies`` topic), the ones in trouble first.

A follower thread reads the topic from its beginning and keeps the newest report of each agent, dependency and
process (a tombstone: the process stopped); a request reads that map, never the broker. A report that does not
decode is skipped with a warning: a reader that trusts no producer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import structlog
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition
from fastapi import APIRouter, HTTPException
from pydantic import ValidationError

from eventstore.kafka_config import connection_config
from eventstore.topics import reader_group
from schemas.snapshots import DependencySnapshot

log = structlog.get_logger("stepstream.api")

STALE_AFTER = 3  # reports missed: the process is gone or stuck


def trouble(snapshot: DependencySnapshot, age_s: float) -> list[str]:
    """Why a dependency needs an operator's eye, worst first; empty when it is well."""
    reasons = []
    if age_s > STALE_AFTER * snapshot.interval_s:
        reasons.append(f"no report for {age_s:.0f} s")
    if snapshot.breaker == "open":
        reasons.append("breaker open: calls fail fast")
    elif snapshot.breaker == "half_open":
        reasons.append("breaker half-open: probing")
    if snapshot.budget_remaining is not None and snapshot.budget_remaining < 1:
        reasons.append("retry budget spent")
    if snapshot.failures_per_s > 0:
        reasons.append(f"failing: {snapshot.failures_per_s:g}/s")
    if snapshot.throttles_per_s > 0:
        reasons.append(f"throttled: {snapshot.throttles_per_s:g}/s")
    return reasons


class DependencyBoard:
    """The newest report of each agent/dependency/process, followed from the topic by a daemon thread."""

    def __init__(self, bootstrap: str, topic: str, *, clock: Callable[[], float] = time.time) -> None:
        self.topic = topic
        self._clock = clock
        self._lock = threading.Lock()
        self._reports: dict[str, DependencySnapshot] = {}
        self._stop = threading.Event()
        self._consumer = Consumer({**connection_config(bootstrap), "group.id": reader_group("dependencies"),
                                   "enable.auto.commit": False, "enable.partition.eof": False})
        self._consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
        self._thread = threading.Thread(target=self._follow, name="dependency-board", daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        while not self._stop.is_set():
            for message in self._consumer.consume(500, timeout=0.5):
                if message.error() is not None:
                    continue  # the topic not created yet, a broker restarting: the next poll retries
                self._take(message.key(), message.value())

    def _take(self, key: bytes | None, value: bytes | None) -> None:
        name = (key or b"").decode(errors="replace")
        if value is None:
            with self._lock:
                self._reports.pop(name, None)
            return
        try:
            report = DependencySnapshot.decode(value)
        except (ValidationError, ValueError) as exc:
            log.warning("dependency report skipped", key=name, error=str(exc)[:300])
            return
        with self._lock:
            self._reports[report.key] = report

    def items(self) -> list[dict[str, Any]]:
        """Every report with its age and its trouble, the ones in trouble first (most reasons first)."""
        now = self._clock()
        with self._lock:
            reports = list(self._reports.values())
        items = []
        for report in reports:
            age_s = max(0.0, now - report.at.timestamp())
            items.append({**report.model_dump(mode="json"), "age_s": round(age_s, 1),
                          "trouble": trouble(report, age_s)})
        return sorted(items, key=lambda i: (-len(i["trouble"]), i["agent"], i["dependency"], i["instance"]))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._consumer.close()


def dependencies_router(board: DependencyBoard | None) -> APIRouter:
    router = APIRouter(tags=["operators"])

    @router.get("/api/dependencies", responses={503: {"description": "no Kafka cluster configured for this API"}})
    def dependencies() -> dict[str, Any]:
        """Each agent's dependencies as its processes last reported them: calls, throttles, failures and
        refusals per second, call latency p50/p99 (ms), breaker state, retry budget left, attempts in flight and
        the agent's concurrency, the report's age; ``trouble`` says why one needs an operator (first)."""
        if board is None:
            raise HTTPException(503, "dependencies are not followed: no Kafka cluster configured for this API")
        return {"items": board.items()}

    return router
