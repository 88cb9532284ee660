"""``/metrics``: the process's own metrics and gauges read at scrape time from the store and the broker.

The gauges count what the dashboard shows, so alerts and the page never disagree; reading them at scrape
time keeps them as fresh as the store without a thread of their own.
"""

from __future__ import annotations

from collections.abc import Iterable

import structlog
from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from projections.agent_groups import AgentGroups
from projections.lag import LagReader
from projections.store import Store

log = structlog.get_logger("stepstream.api")


class DashboardCollector(Collector):
    """Gauges read at scrape time from the store and the broker: what the dashboard shows, for alerting."""

    def __init__(self, store: Store, lag: LagReader | None, topics: list[str],
                 agents: AgentGroups | None = None) -> None:
        self.store = store
        self.lag = lag
        self.topics = topics
        self.agents = agents

    def collect(self) -> Iterable[Metric]:
        depth = GaugeMetricFamily("stepstream_dlq_depth",
                                  "Dead letters neither replayed nor discarded yet, by error kind", labels=["kind"])
        for kind, count in sorted(self.store.dlq_depth().items()):
            depth.add_metric([kind], count)
        yield depth
        tasks = GaugeMetricFamily("stepstream_tasks", "Tasks in the state store, by state", labels=["state"])
        for state, count in sorted(self.store.counts_by_status().items()):
            tasks.add_metric([state], count)
        yield tasks
        steps = GaugeMetricFamily("stepstream_steps", "Steps in the state store, by state (queued: waiting for an "
                                  "agent; waiting: for a timer before the next attempt)", labels=["state"])
        for state, count in sorted(self.store.step_counts_by_status().items()):
            steps.add_metric([state], count)
        yield steps
        yield from self._agents()
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


    def _agents(self) -> Iterable[Metric]:
        if self.agents is None:
            return
        members = GaugeMetricFamily("stepstream_agent_group_members", "Consumers in each agent's group (0: no "
                                    "process of that agent runs; the steps handed to it wait for nobody)",
                                    labels=["agent"])
        try:
            for agent, count in sorted(self.agents.members().items()):
                members.add_metric([agent], count)
        except Exception as exc:  # the broker is down: say nothing rather than "no agent"
            log.warning("agent groups not measured", error=repr(exc))
            return
        yield members


def metrics_router(store: Store, lag: LagReader | None, topics: list[str],
                   agents: AgentGroups | None = None) -> APIRouter:
    """``/metrics``: the process registry (every module's counters) and the store's and broker's gauges."""
    router = APIRouter()
    metrics = CollectorRegistry(auto_describe=False)
    metrics.register(DashboardCollector(store, lag, topics, agents))

    @router.get("/metrics", include_in_schema=False)
    def prometheus() -> Response:
        return Response(generate_latest(REGISTRY) + generate_latest(metrics),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    return router
