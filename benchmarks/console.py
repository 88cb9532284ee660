"""The console's task list at scale: with 100,000 tasks in the store, each list, filter and search the page
makes answers within 200 ms, on SQLite and on PostgreSQL.

Run by hand from the project folder::

    .venv/bin/python -m benchmarks.console [--tasks 100000] [--repeats 15] [--skip-postgres] [--postgres-url URL]

The tasks are written straight into the store's ``tasks`` table (what the projector would leave: states,
workflows and versions, submitters, creation times over a week), not replayed from a log: the benchmark measures
the queries, and the replay has its own (``benchmarks.replay``). PostgreSQL is the server named by
--postgres-url, else a throwaway cluster of the installed server binaries (tests/postgres.py).

Each request goes through the real API (FastAPI, in this process, over ASGI): parsing, the query with its total,
the JSON answer. Each is asked ``--repeats`` times; the table shows the median, the 95th percentile and the
slowest; the target is the slowest within 200 ms. The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
from fastapi.testclient import TestClient
from rich.console import Console
from rich.table import Table

from benchmarks.shared import postgres_url
from eventstore.topics import TopicLayout
from projections.store import SqliteStore, Store
from stepstream.http.app import create_app

TARGET_MS = 200.0
WEEK_MS = 7 * 24 * 3600 * 1000
# Of a system that mostly completes its tasks: the rare states are the ones an operator looks for.
STATES = (("completed", 0.80), ("compensated", 0.08), ("running", 0.04), ("waiting", 0.03), ("error", 0.02),
          ("compensation_failed", 0.01), ("compensating", 0.01), ("rejected", 0.01))
WORKFLOWS = (("orders", 4), ("refunds", 2), ("provisioning", 1))
SUBMITTERS = (*(f"shop-{i}" for i in range(20)), "back-office")


def fill(store: Store, count: int, now_ms: int, seed: int = 7) -> None:
    """``count`` task rows as the projector leaves them, one transaction, then the planner's statistics."""
    rng = random.Random(seed)
    states = [s for s, _ in STATES]
    weights = [w for _, w in STATES]
    with store._lock, store._write() as db, store._bulk(db):
        for i in range(count):
            workflow, versions = WORKFLOWS[i % len(WORKFLOWS)]
            status = rng.choices(states, weights)[0]
            created = now_ms - WEEK_MS + i * (WEEK_MS // count)
            db.execute(
                "insert into tasks(task_id, workflow, workflow_version, status, sequence, current_step, failure_count, "
                "error, created_at, updated_at, submitter) values (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (f"{workflow[:5]}-{i:07d}", workflow, rng.randint(1, versions), status, rng.randint(2, 30),
                 None, rng.randint(0, 3), "charge: 402 declined" if status in ("error", "compensated") else None,
                 created, created + rng.randint(100, 60_000), rng.choice(SUBMITTERS)))
    store.analyze()


def queries(client: TestClient, now_ms: int) -> dict[str, str]:
    """What the console asks, by name: first pages, each filter, searches, a page deep in the list, the tiles."""
    day = datetime.fromtimestamp((now_ms - 3 * 24 * 3600 * 1000) / 1000, UTC)
    since, until = day.isoformat().replace("+", "%2B"), day.replace(hour=23).isoformat().replace("+", "%2B")
    deep = client.get("/api/tasks?limit=500").json()
    for _ in range(9):  # 5,000 tasks down (or the last page of a smaller store)
        if deep["next_cursor"] is not None:
            deep = client.get(f"/api/tasks?limit=500&cursor={deep['next_cursor']}").json()
    cursor = f"&cursor={deep['next_cursor']}" if deep["next_cursor"] else ""
    return {
        "newest 25": "/api/tasks?limit=25",
        "page 5,001-5,025": f"/api/tasks?limit=25{cursor}",
        "state completed (80%)": "/api/tasks?limit=25&state=completed",
        "state compensated (8%)": "/api/tasks?limit=25&state=compensated",
        "state compensation_failed (1%)": "/api/tasks?limit=25&state=compensation_failed",
        "workflow orders v3": "/api/tasks?limit=25&workflow=orders&version=3",
        "created in one day": f"/api/tasks?limit=25&since={since}&until={until}",
        "submitter shop-7": "/api/tasks?limit=25&submitter=shop-7",
        "id prefix, one task": "/api/tasks?limit=25&q=order-0050001",
        "id prefix, a few hundred": "/api/tasks?limit=25&q=order-0050",
        "id prefix, a few thousand": "/api/tasks?limit=25&q=order-005",
        "id prefix, a third of all": "/api/tasks?limit=25&q=order",
        "compensated + orders + prefix": "/api/tasks?limit=25&state=compensated&workflow=orders&q=order-00",
        "tiles (counts by state)": "/api/counts",
    }


def measure(store: Store, repeats: int, now_ms: int) -> dict[str, dict[str, float]]:
    client = TestClient(create_app(store, TopicLayout(prefix="bench.", partitions=3)))
    results: dict[str, dict[str, float]] = {}
    for name, path in queries(client, now_ms).items():
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            response = client.get(path)
            times.append((time.perf_counter() - started) * 1000)
            if response.status_code != 200:
                raise SystemExit(f"{path}: HTTP {response.status_code} {response.text}")
        body = response.json()
        times.sort()
        results[name] = {"median_ms": round(statistics.median(times), 1),
                         "p95_ms": round(times[max(0, round(0.95 * len(times)) - 1)], 1),
                         "max_ms": round(times[-1], 1), "total": body.get("total", 0)}
    client.close()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--skip-postgres", action="store_true")
    parser.add_argument("--postgres-url", default=None)
    args = parser.parse_args()
    console = Console(stderr=True)
    now_ms = int(time.time() * 1000)
    load_before = os.getloadavg()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="console-bench-") as folder:
        backends: list[tuple[str, Any]] = [("sqlite", lambda: SqliteStore(Path(folder) / "state.db"))]
        cluster = None
        if not args.skip_postgres:
            from projections.postgres import PostgresStore

            url, cluster = postgres_url(args.postgres_url)
            backends.append(("postgresql", lambda: PostgresStore(url, f"console_bench_{os.getpid()}")))
        try:
            for backend, open_store in backends:
                store = open_store()
                try:
                    started = time.perf_counter()
                    fill(store, args.tasks, now_ms)
                    console.print(f"{backend}: {args.tasks:,} tasks written in {time.perf_counter() - started:.1f}s")
                    results[backend] = measure(store, args.repeats, now_ms)
                finally:
                    if backend == "postgresql":
                        store.discard()
                    else:
                        store.close()
        finally:
            if cluster is not None:
                cluster.stop()
    table = Table(title=f"the console's task list, {args.tasks:,} tasks, {args.repeats} requests each (ms)")
    table.add_column("request")
    for backend in results:
        table.add_column(f"{backend} median / p95 / max", justify="right")
    table.add_column("matching", justify="right")
    names = list(next(iter(results.values())))
    for name in names:
        table.add_row(name, *(f"{r[name]['median_ms']} / {r[name]['p95_ms']} / {r[name]['max_ms']}"
                              for r in results.values()), f"{next(iter(results.values()))[name]['total']:,}")
    Console().print(table)
    slowest = max(r["max_ms"] for backend in results.values() for r in backend.values())
    print(orjson.dumps({"benchmark": "console", "date": datetime.now(UTC).isoformat(timespec="seconds"),
                        "cpus": os.cpu_count(), "tasks": args.tasks, "repeats": args.repeats,
                        "load_avg_1m_before": round(load_before[0], 2),
                        "load_avg_1m_after": round(os.getloadavg()[0], 2), "target_ms": TARGET_MS,
                        "slowest_ms": slowest, "within_target": slowest <= TARGET_MS, "results": results}).decode())
    return 0 if slowest <= TARGET_MS else 1


if __name__ == "__main__":
    raise SystemExit(main())
