"""The operator's kit in ``deploy/``: alert rules checked and unit-tested by promtool, and every alert and
dashboard query over a metric the services really export (a renamed metric must not silence an alert)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Mapping
from pathlib import Path

import pytest
import yaml
from prometheus_client import REGISTRY
from prometheus_client.core import Metric

import agents.dependencies
import agents.policy
import agents.runtime
import eventstore.metrics
import scheduler.service
import stepstream.client.outbox
import stepstream.http.writes
import supervisor.service
from projections.agent_groups import AgentGroups
from projections.lag import LagReader, PartitionLag
from projections.store import SqliteStore
from stepstream.http.metrics import DashboardCollector

ROOT = Path(__file__).parent.parent
RULES = ROOT / "deploy" / "prometheus" / "alerts.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "alerts_test.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "stepstream.json"
PROMTOOL = Path(os.environ.get("STEPSTREAM_PROMTOOL", Path.home() / ".cache" / "stepstream" / "bin" / "promtool"))
# importing them registers their metrics
SERVICES = (agents.dependencies, agents.policy, agents.runtime, eventstore.metrics, scheduler.service,
            stepstream.client.outbox, stepstream.http.writes, supervisor.service)
METRIC = re.compile(r"\bstepstream_[a-z_]+\b")


class OnePartitionLag(LagReader):
    """The API's lag gauges without a broker: one partition each, enough to learn the gauges' names."""

    def __init__(self) -> None:
        pass

    def groups(self) -> list[PartitionLag]:
        return [PartitionLag("g", "t", 0, 0, 1, 1)]

    def projection(self, stored: Mapping[str, Mapping[int, int]]) -> list[PartitionLag]:
        return self.groups()


class OneAgent(AgentGroups):
    """The API's agent gauge without a broker: one agent, enough to learn the gauge's name."""

    def __init__(self) -> None:
        pass

    def members(self) -> dict[str, int]:
        return {"a": 0}


def sample_names(metric: Metric) -> set[str]:
    """The series names a metric family is scraped as."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count")}
    return {metric.name + suffix for suffix in suffixes.get(metric.type, ("",))}


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    assert SERVICES
    names = {name for metric in REGISTRY.collect() for name in sample_names(metric)}
    store = SqliteStore(tmp_path_factory.mktemp("store") / "state.db")
    try:
        collector = DashboardCollector(store, OnePartitionLag(), ["events"], OneAgent())
        names |= {name for metric in collector.collect() for name in sample_names(metric)}
    finally:
        store.close()
    return names


def alert_expressions() -> dict[str, str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {rule["alert"]: rule["expr"] for group in groups for rule in group["rules"]}


def dashboard_expressions() -> dict[str, str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return {panel["title"]: target["expr"] for panel in panels for target in panel["targets"]}


@pytest.mark.parametrize("source", ["alerts", "dashboard"])
def test_every_query_of_the_kit_names_only_metrics_the_services_export(exported: set[str], source: str) -> None:
    expressions = alert_expressions() if source == "alerts" else dashboard_expressions()
    assert expressions
    unknown = {where: sorted(set(METRIC.findall(expr)) - exported) for where, expr in expressions.items()}
    assert not {where: names for where, names in unknown.items() if names}, f"not exported: {unknown}"
    assert all(METRIC.search(expr) for expr in expressions.values()), "each query reads a stepstream metric"


def test_the_alerts_cover_every_condition_an_operator_must_hear_of() -> None:
    assert set(alert_expressions()) == {
        "StepstreamConsumerLagGrowing", "StepstreamConsumerLagFrozen", "StepstreamDeadLetters",
        "StepstreamCircuitBreakerOpen", "StepstreamStuckSteps", "StepstreamCompensationFailed",
        "StepstreamNoSupervisorLeader", "StepstreamProjectionBehind", "StepstreamNoAgentRunning"}


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    if not PROMTOOL.exists():
        pytest.skip(f"promtool not built at {PROMTOOL}: `make test` builds it (Go module proxy)")
    return subprocess.run([str(PROMTOOL), *args], capture_output=True, text=True, timeout=120, check=False,
                          cwd=RULES.parent)


def test_promtool_accepts_the_alert_rules() -> None:
    checked = promtool("check", "rules", RULES.name)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_each_alert_fires_on_its_condition_and_not_when_healthy_under_promtool() -> None:
    tested = promtool("test", "rules", RULE_TESTS.name)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    fired = set(re.findall(r"alertname: (\w+)", RULE_TESTS.read_text()))
    assert fired == set(alert_expressions()), "every alert has a unit test"
