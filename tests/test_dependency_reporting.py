"""An agent process's report on its dependencies, read from its Prometheus metrics: rates over a window,
latency percentiles from the call histogram, attempts in flight, breaker and budget; and how the console judges
a dependency in trouble."""

from __future__ import annotations

from datetime import UTC, datetime

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from agents.reporting import Reading, Reporter, prometheus_readings, quantile, snapshot
from schemas.snapshots import DependencySnapshot
from stepstream.http.dependencies import trouble

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def test_quantiles_interpolate_in_the_bucket_they_fall_in() -> None:
    assert quantile({}, 0.5) is None and quantile({0.1: 0.0, float("inf"): 0.0}, 0.5) is None
    buckets = {0.1: 50.0, 0.5: 90.0, 1.0: 100.0, float("inf"): 100.0}
    assert quantile(buckets, 0.5) == 0.1
    assert quantile(buckets, 0.7) == 0.1 + 0.4 * (20 / 40)
    assert quantile(buckets, 0.99) == 0.5 + 0.5 * (9 / 10)
    assert quantile({0.1: 1.0, float("inf"): 2.0}, 0.99) == 0.1, "past the last bound: that bound"


def test_the_metrics_of_each_agent_and_dependency_are_read_from_the_registry() -> None:
    registry = CollectorRegistry()
    calls = Counter("stepstream_agent_calls_total", "", ["agent", "dependency", "outcome"], registry=registry)
    seconds = Histogram("stepstream_agent_call_seconds", "", ["agent", "dependency"], buckets=(0.1, 1),
                        registry=registry)
    steps = Histogram("stepstream_agent_step_seconds", "", ["agent", "dependency", "outcome"], registry=registry)
    breaker = Gauge("stepstream_agent_breaker_state", "", ["dependency"], registry=registry)
    budget = Gauge("stepstream_agent_retry_budget_remaining", "", ["dependency"], registry=registry)
    calls.labels("payments", "bank", "ok").inc(7)
    calls.labels("payments", "bank", "failed").inc(3)
    calls.labels("payments", "bank", "timed_out").inc(1)
    calls.labels("payments", "bank", "rejected").inc(1)
    calls.labels("payments", "bank", "throttled").inc(2)
    seconds.labels("payments", "bank").observe(0.05)
    seconds.labels("payments", "bank").observe(0.5)
    steps.labels("payments", "bank", "ok").observe(2.0)
    steps.labels("payments", "bank", "failed").observe(1.0)
    breaker.labels("bank").set(2)
    budget.labels("bank").set(4)
    calls.labels("shipping", "carrier", "ok").inc()

    readings = {r.agent: r for r in prometheus_readings(registry)}
    bank = readings["payments"]
    assert (bank.ok, bank.throttled, bank.failed, bank.timed_out, bank.rejected) == (7, 2, 3, 1, 1)
    assert (bank.calls, bank.failures) == (14, 4), "throttles are calls, but not failures"
    assert bank.buckets == {0.1: 1, 1.0: 2, float("inf"): 2} and bank.step_seconds == 3.0
    assert (bank.breaker, bank.budget_remaining) == ("open", 4)
    assert (readings["shipping"].breaker, readings["shipping"].budget_remaining) == (None, None)


def test_a_snapshot_gives_rates_latency_and_attempts_in_flight_over_its_window() -> None:
    before = Reading("payments", "bank", ok=10, failed=1, throttled=1, buckets={0.1: 10, float("inf"): 12},
                     step_seconds=5.0, breaker="closed", budget_remaining=10)
    after = Reading("payments", "bank", ok=30, failed=3, timed_out=3, rejected=2, throttled=6,
                    buckets={0.1: 20, float("inf"): 24 + 20}, step_seconds=45.0, breaker="half_open",
                    budget_remaining=0.5)
    shot = snapshot((100.0, before), (120.0, after), instance="h:1", interval_s=5, concurrency=8, now=NOW)
    assert (shot.window_s, shot.calls_per_s, shot.throttles_per_s) == (20, 1.6, 0.25)
    assert (shot.failures_per_s, shot.refusals_per_s) == (0.25, 0.1)
    assert shot.in_use == 2.0, "40 s of attempts in 20 s: two at a time on average"
    assert shot.latency_p50_ms == 100.0 and shot.latency_p99_ms == 100.0
    assert (shot.breaker, shot.budget_remaining, shot.concurrency, shot.calls_total) == ("half_open", 0.5, 8, 44)
    first = snapshot((120.0, after), (120.0, after), instance="h:1", interval_s=5, concurrency=None, now=NOW)
    assert (first.calls_per_s, first.window_s, first.in_use) == (0.0, 0.0, 0.0), "one moment: no rate yet"
    assert DependencySnapshot.decode(shot.encode()) == shot


def test_a_dependency_is_in_trouble_when_its_breaker_is_not_closed_its_budget_spent_it_fails_throttles_or_is_silent(
) -> None:
    well = DependencySnapshot(agent="a", dependency="d", instance="h:1", at=NOW, interval_s=5, window_s=60,
                              calls_per_s=3, throttles_per_s=0, failures_per_s=0, refusals_per_s=0.5,
                              breaker="closed", budget_remaining=10, in_use=1, calls_total=100)
    assert trouble(well, age_s=4) == [], "refusals are the requests' fault, not the dependency's"
    sick = well.model_copy(update={"breaker": "open", "budget_remaining": 0.0, "failures_per_s": 1.5,
                                   "throttles_per_s": 0.2})
    assert trouble(sick, age_s=16) == ["no report for 16 s", "breaker open: calls fail fast", "retry budget spent",
                                       "failing: 1.5/s", "throttled: 0.2/s"]


def test_a_dependency_first_seen_counts_from_the_last_report_and_rates_slide_with_the_window() -> None:
    now = [0.0]
    readings: list[Reading] = []
    reporter = Reporter("127.0.0.1:9", "unsent", interval_s=5, window_s=20, clock=lambda: now[0],
                        source=lambda: readings)
    now[0] = 10.0
    readings.append(Reading("payments", "bank", ok=20))
    assert [(s.calls_per_s, s.window_s) for s in reporter.report()] == [(2.0, 10.0)], "from zero at the start"
    now[0] = 15.0
    readings[0] = Reading("payments", "bank", ok=30)
    assert [(s.calls_per_s, s.window_s) for s in reporter.report()] == [(2.0, 15.0)]
    now[0] = 40.0
    assert [(s.calls_per_s, s.window_s) for s in reporter.report()] == [(0.0, 25.0)], "quiet for 25 s"
    now[0] = 70.0
    assert [s.calls_per_s for s in reporter.report()] == [0.0]
