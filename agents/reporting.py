"""An agent process's report on the dependencies it calls, published every few seconds to the ``dependencies``
topic for the console: calls, throttles and failures per second, call latency, breaker state, retry budget
left, attempts in flight (``schemas.snapshots.DependencySnapshot``).

Breaker and budget state live in the process (``agents.dependencies``); so does every count. The reporter reads
them where the process already publishes them, its Prometheus registry, so it needs no hook in the attempt
path and keeps working whatever the fault handling's internals become, as long as the metrics keep their names:

* ``stepstream_agent_calls_total{agent, dependency, outcome}``: calls by how they ended -- ``ok``,
  ``throttled`` (the service pacing us), ``failed`` and ``timed_out`` (the dependency in trouble), ``rejected``
  (a permanent refusal: the request's fault, not the service's);
* ``stepstream_agent_call_seconds`` (histogram, per agent and dependency): latency percentiles, interpolated
  in the buckets as Prometheus' ``histogram_quantile`` does;
* ``stepstream_agent_step_seconds_sum`` (per agent and dependency): attempts in flight on average, by Little's
  law (the time attempts spent in the window over its length);
* ``stepstream_agent_breaker_state{dependency}`` and ``stepstream_agent_retry_budget_remaining{dependency}``.

``Reporter`` takes any ``source`` of ``Reading``s, so a typed accessor of the dependencies can replace the
registry without changing what is published. Rates are over a sliding window (a minute by default): a burst of
throttles stays visible for that long rather than one report.
"""

from __future__ import annotations

import math
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Literal

import structlog
from confluent_kafka import Producer
from prometheus_client import REGISTRY, CollectorRegistry

from agents.dependencies import OUTCOMES
from eventstore.kafka_config import producer_config
from schemas.snapshots import DependencySnapshot

log = structlog.get_logger("stepstream.agent")

BreakerName = Literal["closed", "half_open", "open"]
BREAKER_STATES: dict[int, BreakerName] = {0: "closed", 1: "half_open", 2: "open"}  # agents.dependencies' gauge


@dataclass
class Reading:
    """One dependency of one agent as its metrics stand now: cumulative counts, and the state gauges."""

    agent: str
    dependency: str
    ok: float = 0.0
    throttled: float = 0.0
    failed: float = 0.0
    timed_out: float = 0.0
    rejected: float = 0.0
    buckets: dict[float, float] = field(default_factory=dict)  # upper bound -> cumulative count of calls
    step_seconds: float = 0.0
    breaker: BreakerName | None = None
    budget_remaining: float | None = None

    @property
    def calls(self) -> float:
        return self.ok + self.throttled + self.failed + self.timed_out + self.rejected

    @property
    def failures(self) -> float:
        return self.failed + self.timed_out


def prometheus_readings(registry: CollectorRegistry = REGISTRY) -> list[Reading]:
    """The readings of every (agent, dependency) the process's metrics know."""
    readings: dict[tuple[str, str], Reading] = {}
    breakers: dict[str, BreakerName] = {}
    budgets: dict[str, float] = {}

    def of(labels: dict[str, str]) -> Reading:
        key = (labels["agent"], labels["dependency"])
        if key not in readings:
            readings[key] = Reading(*key)
        return readings[key]

    for family in registry.collect():
        for sample in family.samples:
            name, labels, value = sample.name, sample.labels, sample.value
            if name == "stepstream_agent_calls_total" and labels.get("outcome") in OUTCOMES:
                reading = of(labels)
                setattr(reading, labels["outcome"], getattr(reading, labels["outcome"]) + value)
            elif name == "stepstream_agent_call_seconds_bucket":
                buckets = of(labels).buckets
                bound = float(labels["le"])
                buckets[bound] = buckets.get(bound, 0.0) + value
            elif name == "stepstream_agent_step_seconds_sum":
                of(labels).step_seconds += value
            elif name == "stepstream_agent_breaker_state":
                breakers[labels["dependency"]] = BREAKER_STATES.get(int(value), "open")
            elif name == "stepstream_agent_retry_budget_remaining":
                budgets[labels["dependency"]] = value
    for reading in readings.values():
        reading.breaker = breakers.get(reading.dependency)
        reading.budget_remaining = budgets.get(reading.dependency)
    return list(readings.values())


def quantile(buckets: dict[float, float], q: float) -> float | None:
    """The ``q`` quantile of a histogram's cumulative buckets (upper bound -> count), interpolated linearly in
    the bucket it falls in; None without observations. Past the last finite bound: that bound."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0.0
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower
            inside = count - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = bound, count
    return lower


def snapshot(first: tuple[float, Reading], last: tuple[float, Reading], *, instance: str, interval_s: float,
             concurrency: int | None, now: datetime) -> DependencySnapshot:
    """The report of one dependency from its oldest reading in the window (``first``) to its newest (``last``),
    each with the clock reading it was taken at; over no time at all (the same moment), every rate is zero."""
    began, oldest = first
    at, newest = last
    span = at - began

    def per_s(value: float) -> float:
        return round(value / span, 3) if span > 0 else 0.0

    window = {b: c - oldest.buckets.get(b, 0.0) for b, c in newest.buckets.items()}
    p50, p99 = quantile(window, 0.5), quantile(window, 0.99)
    return DependencySnapshot(
        agent=newest.agent, dependency=newest.dependency, instance=instance, at=now, interval_s=interval_s,
        window_s=round(span, 3), calls_per_s=per_s(newest.calls - oldest.calls),
        throttles_per_s=per_s(newest.throttled - oldest.throttled),
        failures_per_s=per_s(newest.failures - oldest.failures),
        refusals_per_s=per_s(newest.rejected - oldest.rejected),
        latency_p50_ms=None if p50 is None else round(p50 * 1000, 1),
        latency_p99_ms=None if p99 is None else round(p99 * 1000, 1),
        breaker=newest.breaker,
        budget_remaining=newest.budget_remaining, in_use=per_s(newest.step_seconds - oldest.step_seconds),
        concurrency=concurrency, calls_total=int(newest.calls))


class Reporter:
    """Publishes a snapshot of each dependency every ``interval_s`` (rates over ``window_s``) until stopped,
    then a tombstone for each: a process that stopped leaves the console. Publishing is best effort: a report
    that cannot be sent is logged and the next one tried; the agent's work never waits for it."""

    def __init__(self, bootstrap: str, topic: str, *, interval_s: float = 5.0, window_s: float = 60.0,
                 concurrency: int | None = None, source: Callable[[], Iterable[Reading]] = prometheus_readings,
                 clock: Callable[[], float] = time.monotonic, instance: str | None = None) -> None:
        self.topic = topic
        self.interval_s = interval_s
        self.window_s = window_s
        self.concurrency = concurrency
        self.source = source
        self.clock = clock
        self.instance = instance or f"{socket.gethostname()}:{os.getpid()}"
        self._producer = Producer(producer_config(bootstrap, **{"linger.ms": 50}))
        self._history: dict[tuple[str, str], deque[tuple[float, Reading]]] = {}
        self._last_report = clock()  # a process's metrics start at zero with it: the first baseline
        self._keys: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def report(self) -> list[DependencySnapshot]:
        """Read the source once and publish a snapshot of each dependency; returns them."""
        now = self.clock()
        sent = []
        for reading in self.source():
            history = self._history.get((reading.agent, reading.dependency))
            if history is None:  # new since the last report: it counted from zero then
                history = self._history[(reading.agent, reading.dependency)] = deque(
                    [(self._last_report, Reading(reading.agent, reading.dependency))])
            history.append((now, reading))
            # The baseline is the newest reading at least a window old (or the oldest one kept).
            while len(history) > 2 and now - history[1][0] >= self.window_s:
                history.popleft()
            shot = snapshot(history[0], history[-1], instance=self.instance, interval_s=self.interval_s,
                            concurrency=self.concurrency, now=datetime.now(UTC))
            self._producer.produce(self.topic, key=shot.key.encode(), value=shot.encode())
            self._keys.add(shot.key)
            sent.append(shot)
        self._last_report = now
        self._producer.poll(0)
        return sent

    def start(self) -> Reporter:
        self._thread = threading.Thread(target=self._run, name="dependency-reporter", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.report()
            except Exception as exc:  # a report is for people: never let it take the agent down
                log.warning("dependency report not sent", error=repr(exc))
            self._stop.wait(self.interval_s)

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop reporting and withdraw this process's reports (tombstones)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        for key in self._keys:
            self._producer.produce(self.topic, key=key.encode(), value=None)
        self._producer.flush(timeout_s)
