"""How long tasks stay unfinished after the broker coordinating a scheduler's transactions is SIGKILLed.

Run by hand from the project folder (``make soak`` runs it with ``--runs 5``)::

    .venv/bin/python -m benchmarks.broker_kill_loop [--runs 20] [--tasks 24] [--seed N] [--logs DIR]

Each run is tests/broker_kill.py's: two of every service (fresh topics at replication factor 3, a fresh
PostgreSQL database, a fresh order service) on one three-broker cluster kept across the runs; once a random share
of the tasks ended, the transaction coordinator of one scheduler is SIGKILLed; it is started again before the next
run. Reported per run: the broker's roles, the tasks unfinished at the kill, the seconds from the kill until
every task was terminal in the store and until every unfinished one had a new event, outcomes, tasks whose end
disagrees with the order service's records (must be 0), whether ``projections verify`` found the store equal,
services restarted after a stall or ended for good, and the 1-minute load average at the run's start.
Then p50 and max over the runs. Progress goes to stderr, a table to stdout; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

import orjson
from confluent_kafka.admin import AdminClient

from demo.orders_client import ServiceProcess
from eventstore.cluster import LocalCluster
from eventstore.topics import TopicLayout, ensure_topics
from tests.broker_kill import KillRun, run_through_kill
from tests.postgres import ThrowawayPostgres, create_database, drop_database, server_binaries
from tests.system import AGENTS, System, service_env
from tests.test_compensation_end_to_end import COMPENSATION_AGENTS, KEY

TARGET_S = 60.0
"""No task may stay unfinished longer than this after the kill."""


def one_run(cluster: LocalCluster, postgres: str, tmp: Path, args: argparse.Namespace, rng: random.Random) -> KillRun:
    """One whole system on ``cluster`` (its own topics, database, order service) through one kill."""
    tmp.mkdir(parents=True)
    bootstrap = cluster.bootstrap_servers
    layout = TopicLayout(prefix=f"k{uuid.uuid4().hex[:10]}.", partitions=4, replication_factor=3)
    specs = [*layout.core_specs(), *(layout.agent_spec(a) for a in (*AGENTS, *COMPENSATION_AGENTS))]
    ensure_topics(AdminClient({"bootstrap.servers": bootstrap}), specs, replication_factor=3)
    database = create_database(postgres)
    env = service_env(bootstrap, layout, tmp / "home")
    try:
        with ServiceProcess(log_path=tmp / "orders-service.log", env=env) as service:
            system = System(bootstrap, layout, env, tmp, service)
            system.env.update({"STEPSTREAM_SCHEDULER_WORKFLOWS": "tests.workflows:COMPENSATION_REGISTRY",
                               "STEPSTREAM_SCHEDULER_INSTANCE": "kill-loop", "STEPSTREAM_ENCRYPTION_KEYS": f"k1:{KEY}",
                               "STEPSTREAM_STORE_URL": database, "STEPSTREAM_REPLICATION_FACTOR": "3"})
            try:
                return run_through_kill(system, cluster, tasks=args.tasks, rng=rng, patience_s=args.patience_s)
            finally:
                system.stop()
    finally:
        drop_database(database)


def spread(values: list[float]) -> dict[str, float | None]:
    """Median and maximum; a run whose tasks never all ended counts as infinite (null in the JSON line)."""
    if not values:
        return {"p50": None, "max": None}
    return {"p50": round(statistics.median(values), 2), "max": round(max(values), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--tasks", type=int, default=24)
    parser.add_argument("--patience-s", type=float, default=150.0, help="how long a run waits for its tasks")
    parser.add_argument("--seed", type=int, default=None, help="of the kill moments and targets (default: random)")
    parser.add_argument("--logs", type=Path, default=None, help="keep each run's service logs under this folder")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 32)
    rng = random.Random(seed)
    bindir = server_binaries()
    if bindir is None:
        raise SystemExit("PostgreSQL server binaries (initdb, pg_ctl) are needed: apt-get install postgresql")

    results: list[dict[str, Any]] = []
    root = Path(tempfile.mkdtemp(prefix="broker-kill-loop-"))
    postgres = ThrowawayPostgres(bindir)
    cluster = LocalCluster(root / "cluster", nodes=3)
    try:
        url = postgres.start()
        cluster.start()
        for n in range(1, args.runs + 1):
            load = round(os.getloadavg()[0], 1)
            print(f"run {n}/{args.runs} (load {load}) ...", file=sys.stderr, flush=True)
            tmp = root / f"run-{n}"
            try:
                figures = one_run(cluster, url, tmp, args, rng).figures()
            except Exception as exc:  # a run that could not even be judged is a result too, not the loop's end
                figures = {"error": repr(exc)[:2000]}
            figures.update({"run": n, "load_1m": load})
            results.append(figures)
            print(f"  {figures}", file=sys.stderr, flush=True)
            if args.logs is not None:
                shutil.copytree(tmp, args.logs / tmp.name, ignore=shutil.ignore_patterns("home"), dirs_exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            for node in cluster.nodes:  # the broker killed comes back, and the next run finds three
                if node.status() is None:
                    node.start()
    finally:
        cluster.stop()
        postgres.stop()
        shutil.rmtree(root, ignore_errors=True)

    judged = [r for r in results if "error" not in r]
    ended = [float("inf") if r["ended_after_kill_s"] is None else r["ended_after_kill_s"] for r in judged]
    moved = [r["moved_after_kill_s"] for r in judged]
    passed = [r for r in judged if r["ended_after_kill_s"] is not None and r["ended_after_kill_s"] <= TARGET_S
              and not r["disagreeing"] and r["verified"] and not r["exits"]]
    print(f"{'run':>3} {'load':>5} {'killed':>6} {'unfin.':>6} {'ended s':>8} {'moved s':>8} {'disagree':>8} "
          f"{'verify':>6} {'stalls':>6}  roles")
    for r in results:
        if "error" in r:
            print(f"{r['run']:>3} {r['load_1m']:>5} error: {r['error'][:200]}")
            continue
        print(f"{r['run']:>3} {r['load_1m']:>5} {r['killed']:>6} {r['unfinished_at_kill']:>6} "
              f"{r['ended_after_kill_s'] if r['ended_after_kill_s'] is not None else 'never':>8} "
              f"{r['moved_after_kill_s']:>8} {r['disagreeing']:>8} {'equal' if r['verified'] else 'DIFF':>6} "
              f"{len(r['stall_restarts']):>6}  {'; '.join(r['roles'])}")
    summary = {"ended_after_kill_s": spread(ended), "moved_after_kill_s": spread(moved)}
    print(f"{len(passed)} of {len(results)} runs passed (every task terminal within {TARGET_S:g} s of the kill, "
          f"none disagreeing, store verified, no service ended for good); {summary}")
    print(orjson.dumps({"benchmark": "broker_kill_loop", "seed": seed, "tasks": args.tasks, "runs": results,
                        "passed": len(passed), **summary}).decode())


if __name__ == "__main__":
    main()
