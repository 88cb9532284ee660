"""The cost of sealing on the hot path: the same system, orders with and without a marked input field.

Run by hand from the project folder::

    .venv/bin/python -m benchmarks.sealing [--tasks N] [--rounds R] [--latency-samples M]

One system (order service without faults, projector, scheduler, the three agents, supervisor, as real
processes) on the demo's registry, with a master key configured. The two kinds of order differ only in
their marking: ``orders`` v3 (no field marked) and ``orders`` v4 (the same steps, ``card_token`` marked:
sealed by the submitter under a fresh task key, the key proposed on ``keys`` by the submitter before the
submission and adopted by the scheduler, opened by each agent from ``keys``). Rounds alternate the two
kinds (plain first in even rounds, sealed first in odd ones) so that a drift in the machine's load falls on
both alike. Per round and kind:

- throughput: N submissions built (and, for v4, sealed: the time that takes is reported per submission),
  sent as fast as one producer sends them; the clock runs from the first send (for v4, of the proposed
  keys, acknowledged before the submissions) until every task has a terminal event on ``events``;
  steps/s = 3 N / elapsed;
- submit latency: M submissions one after another through ``Client.submit`` (validation, sealing, produce,
  wait for acks=all), each timed.

Reported: per kind the median over rounds of steps/s, the p50/p99 of every submit latency, and the
slowdown of v4 against v3 (target at most 10 %). The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson

from benchmarks.shared import delete_topics, quiet_stderr, resolve_bootstrap, run_facts
from benchmarks.workflow import (
    AGENTS,
    ROOT,
    SERVICES,
    TerminalWatcher,
    Topics,
    create_topics,
    latency_summary,
    service_env,
)
from demo.orders_client import ServiceProcess
from demo.workflows import REGISTRY
from eventstore.logs import configure_logging
from eventstore.producer import EventProducer
from eventstore.settings import KafkaSettings
from eventstore.topics import TopicLayout
from schemas.codec import default_codec
from schemas.messages import SubmitTask
from schemas.sealed import Keyring
from stepstream.client import Client
from stepstream.local.processes import ServiceProcesses

KINDS = {"plain": 3, "sealed": 4}  # orders version per kind


def order(task_id: str, i: int, version: int) -> SubmitTask:
    data: dict[str, Any] = {"order_id": task_id, "sku": f"SKU-{i % 50:03d}", "qty": 1 + i % 3, "amount": 10 + i % 90}
    if version == 4:
        data["card_token"] = f"tok_{i:012d}"
    return SubmitTask(task_id=task_id, workflow="orders", workflow_version=version, input=data)


def burst(client: Client, producer: EventProducer, watcher: TerminalWatcher, layout: TopicLayout, prefix: str,
          n: int, version: int, step: Callable[[str], None]) -> tuple[float, float]:
    """(steps/s, sealing µs per submission) of N orders of ``version`` sent at once."""
    built = time.perf_counter()
    commands = [client.sealing.seal(order(f"{prefix}{i:06d}", i, version), known=False) for i in range(n)]
    seal_us = 1e6 * (time.perf_counter() - built) / n
    started = time.perf_counter()
    for command in client.sealing.ready(commands):  # new data keys proposed on keys first, acknowledged
        producer.send(layout.inbox, command)
    producer.flush()
    watcher.wait_for(prefix, n, step, f"{prefix} v{version}")
    return 3 * n / (watcher.last_seen - started), seal_us


def submit_latencies(client: Client, prefix: str, m: int, version: int) -> list[float]:
    """Milliseconds of each of M ``Client.submit`` calls, one after another."""
    out = []
    for i in range(m):
        command = order(f"{prefix}{i:06d}", i, version)
        began = time.perf_counter()
        client.submit(command.workflow, command.input, version=version, task_id=command.task_id)
        out.append(1000 * (time.perf_counter() - began))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--tasks", type=int, default=500, help="orders per burst (default 500)")
    parser.add_argument("--rounds", type=int, default=4, help="rounds, each a burst of both kinds (default 4)")
    parser.add_argument("--latency-samples", type=int, default=100, help="timed submits per round and kind")
    args = parser.parse_args(argv)
    if args.tasks < 1 or not 1 <= args.rounds <= 9 or args.latency_samples < 1:  # task id prefixes: 2 characters
        parser.error("--tasks and --latency-samples must be >= 1, --rounds 1 to 9")

    settings = KafkaSettings()
    configure_logging("WARNING")
    started = datetime.now(UTC)
    load_before = os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="stepstream-bench-sealing-"))
    keys = f"bench:{Keyring.generate_key()}"
    rates: dict[str, list[float]] = {kind: [] for kind in KINDS}
    seal_us: dict[str, list[float]] = {kind: [] for kind in KINDS}
    latencies: dict[str, list[float]] = {kind: [] for kind in KINDS}
    with quiet_stderr(settings.home / "bench-sealing.log") as terminal:
        def step(text: str) -> None:
            print(f"{time.strftime('%H:%M:%S')} {text}", file=terminal, flush=True)

        bootstrap, broker, _pid = resolve_bootstrap(settings)
        prefix = f"bench-sealing-{started:%Y%m%d%H%M%S}-{uuid.uuid4().hex[:6]}."
        layout = TopicLayout(prefix, settings.partitions, settings.replication_factor)
        topics = Topics(layout, TopicLayout(f"{prefix}solo.", settings.partitions), f"{prefix}raw-in",
                        f"{prefix}raw-out")
        create_topics(bootstrap, topics)
        step(f"broker: {bootstrap} ({broker}); topics {prefix}*; folder {tmp}")
        (tmp / "logs").mkdir()
        service = ServiceProcess(log_path=tmp / "logs" / "orders-service.log").start()
        env = {**service_env(bootstrap, layout, tmp, service.base_url), "STEPSTREAM_ENCRYPTION_KEYS": keys}
        procs = ServiceProcesses(env, tmp / "logs", cwd=ROOT)
        watcher = TerminalWatcher(bootstrap, layout.events, layout.partitions, default_codec())
        kafka = KafkaSettings(bootstrap_servers=bootstrap, topic_prefix=prefix, partitions=layout.partitions)
        try:
            for name in SERVICES:
                procs.service(name, *(("agent", name) if name in AGENTS else (name,)))
            procs.wait_started("scheduler", "partition restored", count=layout.partitions, timeout_s=120.0)
            for name in ("projector", *AGENTS):
                procs.wait_started(name, "partitions assigned", timeout_s=120.0)
            watcher.start()
            producer = EventProducer(bootstrap)
            with Client(kafka=kafka, registry=REGISTRY, keyring=Keyring.parse(keys),
                        store_path=tmp / "none.db") as client:
                for version in KINDS.values():
                    burst(client, producer, watcher, layout, f"w{version}", 20, version, step)
                step("warm-up done")
                for r in range(args.rounds):
                    order_of = list(KINDS.items()) if r % 2 == 0 else list(reversed(KINDS.items()))
                    for kind, version in order_of:
                        rate, sealing = burst(client, producer, watcher, layout, f"{kind[0]}{r}", args.tasks,
                                              version, step)
                        rates[kind].append(rate)
                        seal_us[kind].append(sealing)
                        latencies[kind].extend(submit_latencies(client, f"l{r}{kind[0]}", args.latency_samples,
                                                                version))
                        step(f"round {r + 1} {kind}: {rate:,.0f} steps/s, sealing {sealing:,.0f} µs/submission")
                    watcher.wait_for(f"l{r}", 2 * args.latency_samples, step, "latency tasks")
        finally:
            if watcher.is_alive():
                watcher.halt()
            codes = procs.terminate_all()
            codes["orders-service"] = service.stop()
            for error in delete_topics(bootstrap, topics.names):
                step(f"could not delete topic {error}")
    load_after = os.getloadavg()
    median = {kind: statistics.median(values) for kind, values in rates.items()}
    figures = {
        **run_facts("sealing", started, bootstrap, broker, prefix, load_before, load_after),
        "tasks_per_burst": args.tasks,
        "rounds": args.rounds,
        "steps_per_s": {kind: [round(v, 1) for v in values] for kind, values in rates.items()},
        "steps_per_s_median": {kind: round(v, 1) for kind, v in median.items()},
        "sealing_us_per_submission": {kind: round(statistics.median(v), 1) for kind, v in seal_us.items()},
        "submit_latency_ms": {kind: latency_summary(values) for kind, values in latencies.items()},
        "throughput_slowdown_pct": round(100 * (1 - median["sealed"] / median["plain"]), 1),
        "submit_p50_slowdown_pct": round(100 * (statistics.median(latencies["sealed"])
                                                / statistics.median(latencies["plain"]) - 1), 1),
        "exit_codes": codes,
    }
    print(orjson.dumps(figures).decode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
