"""What replication costs, and what more instances give: the workflow benchmark's system run, several times.

Run by hand from the project folder::

    .venv/bin/python -m benchmarks.scaling [--tasks N] [--instances 1,2,4] [--partitions P]

In one run, one after the other, each on fresh topics (P partitions, default 8) and a fresh state store:

1. a one-node local cluster (replication factor 1): the system of benchmarks/workflow.py (``run_system``:
   order service without faults, projector, schedulers, agents, supervisor as real processes) with K
   schedulers and K of each forward agent, for each K of ``--instances`` (one projector, one supervisor);
2. a three-node local cluster (replication factor 3, ``min.insync.replicas`` 2, producers at acks=all): the
   same system with one instance of each, against step 1's K = 1 run: the cost of replication.

Both clusters are the project's own brokers (eventstore.cluster.LocalCluster) in a temporary folder, started
here and stopped after their runs; the two never run at the same time. Per run: tasks/s, steps/s (3 per
task), outcomes, each consumer group's mean and peak lag, and each service's CPU seconds over the timed
window (its instances summed; the broker's: every node's Java process, from /proc/<pid>/stat) with the steps
it handled per CPU second (each agent: its own step), so the figures can size a deployment; and the brokers'
CPU per step on three nodes against one (``replicated_vs_single_broker_cpu``), what replication costs them.
Progress goes to stderr; the last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson

from benchmarks.shared import delete_topics, quiet_stderr, run_facts
from benchmarks.workflow import AGENTS, STEPS_PER_TASK, SystemRun, Topics, create_topics, run_system
from eventstore.cluster import LocalCluster
from eventstore.logs import configure_logging
from eventstore.settings import KafkaSettings
from eventstore.topics import TopicLayout
from schemas.codec import default_codec


def summary(run: SystemRun, load_before: tuple[float, ...]) -> dict[str, Any]:
    """One run's figures; per service (instances summed): CPU seconds, and the steps it handled per CPU
    second: every step for the scheduler, projector, supervisor, order service and broker, its own step
    (one per task) for each agent."""
    per_service: dict[str, float] = defaultdict(float)
    for name, seconds in run.cpu.items():
        per_service[name.partition("#")[0]] += seconds
    steps = STEPS_PER_TASK * run.tasks
    return {
        "tasks": run.tasks,
        "outcomes": run.outcomes,
        "elapsed_seconds": round(run.elapsed, 3),
        "tasks_per_s": round(run.tasks_per_s, 1),
        "steps_per_s": round(run.steps_per_s, 1),
        "cpu_seconds": {name: round(seconds, 2) for name, seconds in per_service.items()},
        "steps_per_cpu_second": {name: round((run.tasks if name in AGENTS else steps) / seconds)
                                 for name, seconds in per_service.items()
                                 if seconds > 0 and name not in ("benchmark", "machine", "other")},
        "consumer_lag": run.lag,
        "exit_codes": run.exit_codes,
        "load_avg_1m_before": round(load_before[0], 2),
        "load_avg_1m_after": round(os.getloadavg()[0], 2),
        "logs": run.logs,
    }


def broker_cpu_per_step(run: dict[str, Any]) -> float:
    """The brokers' CPU seconds (every node summed) per step of a run: comparable across task counts."""
    seconds: float = run["cpu_seconds"]["broker"]
    tasks: int = run["tasks"]
    return seconds / (STEPS_PER_TASK * tasks)


def measure(cluster: LocalCluster, nodes: int, instances: int, args: argparse.Namespace, tmp: Path,
            step: Callable[[str], None]) -> dict[str, Any]:
    """One system run on ``cluster`` (already started) with ``instances`` schedulers and agents."""
    bootstrap = cluster.bootstrap_servers
    prefix = f"bench-scaling-{nodes}n{instances}i-{uuid.uuid4().hex[:6]}."
    layout = TopicLayout(prefix, args.partitions, min(nodes, 3))
    topics = Topics(layout, TopicLayout(f"{prefix}solo.", args.partitions, layout.replication_factor),
                    f"{prefix}raw-in", f"{prefix}raw-out")
    create_topics(bootstrap, topics)
    load_before = os.getloadavg()
    step(f"{nodes} broker(s), {instances} instance(s) of the scheduler and each agent: {args.tasks:,} tasks")
    brokers = [info.pid for node in cluster.nodes if (info := node.status()) is not None]
    try:
        run = run_system(bootstrap, topics, tmp / f"{nodes}n{instances}i", args.tasks, args.warmup, brokers,
                         default_codec(), None, step, instances=instances)
    finally:
        for error in delete_topics(bootstrap, topics.names):
            step(f"[yellow]could not delete topic {error}[/yellow]")
    step(f"{run.steps_per_s:,.0f} steps/s")
    return {"brokers": nodes, "replication_factor": layout.replication_factor, "instances": instances,
            **summary(run, load_before)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--tasks", type=int, default=2000, help="orders per run (default 2000)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed tasks run first in each run (default 20)")
    parser.add_argument("--instances", default="1,2,4", help="scheduler and agent instance counts (default 1,2,4)")
    parser.add_argument("--partitions", type=int, default=8, help="partitions per topic (default 8)")
    args = parser.parse_args(argv)
    counts = sorted({int(k) for k in args.instances.split(",")} | {1})
    if args.tasks < 1 or args.warmup < 0 or counts[0] < 1 or args.partitions < counts[-1]:
        parser.error("--tasks >= 1, --warmup >= 0, instances >= 1 and no more of them than --partitions")

    settings = KafkaSettings()
    configure_logging("WARNING")
    started = datetime.now(UTC)
    load_before = os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="stepstream-bench-scaling-"))
    runs: list[dict[str, Any]] = []
    with quiet_stderr(settings.home / "bench-scaling.log") as terminal:

        def step(text: str) -> None:
            print(f"{time.strftime('%H:%M:%S')} {text}", file=terminal, flush=True)

        for nodes, instance_counts in ((1, counts), (3, [1])):
            cluster = LocalCluster(tmp / f"cluster-{nodes}", nodes=nodes)
            cluster.start()
            step(f"{nodes}-node cluster up: {cluster.bootstrap_servers}")
            try:
                runs.extend(measure(cluster, nodes, k, args, tmp, step) for k in instance_counts)
            finally:
                cluster.stop()
    single = next(r for r in runs if r["brokers"] == 1 and r["instances"] == 1)
    replicated = next(r for r in runs if r["brokers"] == 3)
    figures = {
        **run_facts("scaling", started, "local clusters", "1 and 3 local nodes", "bench-scaling-*", load_before,
                    os.getloadavg()),
        "tasks": args.tasks,
        "partitions": args.partitions,
        "replicated_vs_single_steps": round(replicated["steps_per_s"] / single["steps_per_s"], 3),
        "replicated_vs_single_broker_cpu": round(broker_cpu_per_step(replicated) / broker_cpu_per_step(single), 3),
        "steps_per_s_by_instances": {r["instances"]: r["steps_per_s"] for r in runs if r["brokers"] == 1},
        "runs": runs,
        "folder": str(tmp),
    }
    sys.stdout.write(orjson.dumps(figures, option=orjson.OPT_NON_STR_KEYS).decode() + "\n")
    return 0 if all(code == 0 for r in runs for code in r["exit_codes"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
