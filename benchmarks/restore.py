"""The scheduler's restore of a partition against its history: time and resident memory.

Run by hand from the project folder::

    .venv/bin/python -m benchmarks.restore [--sizes 10000,100000,1000000] [--live-every 1000]

The broker is the one named by STEPSTREAM_BOOTSTRAP_SERVERS, else the project's local broker (started if
needed and left running). For each size, one single-partition ``events`` topic under a fresh prefix (deleted
at the end) is filled with realistic task histories (tests/histories.py: ~8 events a task, retries, failures,
alerts; one task in ``--live-every`` left in flight), then each partition is restored three times, each time
in a process of its own so its resident memory is its own:

- ``full_fold``: what the scheduler did before issue 14, every event folded and every task's whole state kept;
- ``events_fold``: ``Scheduler.restore`` over an empty changelog (a deployment's first start with it, or a
  changelog lost): the quarantine-aware fold of every event, finished tasks kept settled; it then writes the
  changelog as its first transaction would (``Scheduler.save_state``), timed apart as ``changelog_write``;
- ``restore``: ``Scheduler.restore`` as every later start runs it, reading that changelog (one record per
  task, as compaction leaves it) and the events past its checkpoint (none here).

Progress goes to stderr, the table to stdout; the last line of stdout is one JSON object with ``restore_s``,
``full_fold_s``, ``events_fold_s`` (the largest partition) and ``rss_mb`` (the scheduler after restoring it from
the changelog).
"""

from __future__ import annotations

import argparse
import base64
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import orjson
from confluent_kafka import Producer, TopicPartition
from confluent_kafka.admin import AdminClient
from rich.console import Console
from rich.table import Table

from benchmarks.replay import bootstrap_servers
from demo.workflows import REGISTRY
from eventstore.kafka_config import producer_config
from eventstore.producer import EventProducer
from eventstore.replay import ReplayReader
from eventstore.topics import TopicLayout, ensure_topics
from scheduler.decider import Limits, TaskState, evolve
from scheduler.service import Scheduler
from schemas.codec import default_codec
from schemas.messages import Event
from schemas.sealed import Keyring
from tests.histories import histories

console = Console(stderr=True)


def fill(bootstrap: str, topic: str, events: int, live_every: int) -> int:
    """Produce task histories into partition 0 of ``topic`` until ``events`` events; returns the task count."""
    codec = default_codec()
    producer = Producer(producer_config(bootstrap))
    tasks = 0
    last = ""
    for sent, event in enumerate(histories(events // 7 + 1, seed=42, prefix=f"restore{events}",
                                           in_flight_every=live_every)):
        if sent >= events and event.task_id != last:
            break  # whole histories only
        if event.task_id != last:
            tasks, last = tasks + 1, event.task_id
        while True:
            try:
                producer.produce(topic, key=event.task_id, value=codec.encode(event), partition=0)
                break
            except BufferError:
                producer.poll(0.1)
    producer.flush(120)
    return tasks


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def measure(kind: str, bootstrap: str, prefix: str) -> dict[str, Any]:
    """One restore of partition 0 in this process: seconds, records read, tasks, live ones, RSS after."""
    layout = TopicLayout(prefix=prefix, partitions=1)
    base = rss_mb()
    # The demo's registry marks sensitive data (orders v4), so a scheduler needs a master key to start.
    keyring = Keyring.parse(f"bench:{base64.b64encode(os.urandom(32)).decode()}")
    scheduler = Scheduler(bootstrap=bootstrap, layout=layout, registry=REGISTRY, limits=Limits(), keyring=keyring)
    started = time.perf_counter()
    if kind == "full_fold":
        tasks: dict[str, TaskState] = {}
        reader = ReplayReader(bootstrap, layout.events, partitions=[0])
        for record in reader:
            if isinstance(record.message, Event):
                tasks[record.message.task_id] = evolve(tasks.get(record.message.task_id), record.message)
        records, live = reader.stats.records, sum(1 for s in tasks.values() if not s.is_terminal)
        count = len(tasks)
    else:
        scheduler.restore([TopicPartition(layout.inbox, 0)])
        records, count, live = scheduler.restored_records[0], len(scheduler._tasks[0]), scheduler.in_flight(0)
    seconds = time.perf_counter() - started
    figures = {"seconds": round(seconds, 3), "records": records, "tasks": count, "live": live,
               "rss_mb": round(rss_mb(), 1), "rss_base_mb": round(base, 1)}
    if kind == "events_fold":
        started = time.perf_counter()
        output = EventProducer(bootstrap)
        scheduler.save_state(output)
        output.flush(600)
        figures["changelog_write_s"] = round(time.perf_counter() - started, 3)
    return figures


def child(kind: str, bootstrap: str, prefix: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "benchmarks.restore", "--measure", kind, "--bootstrap", bootstrap,
                          "--prefix", prefix], capture_output=True, text=True, check=True)
    return orjson.loads(out.stdout.splitlines()[-1])  # type: ignore[no-any-return]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="10000,100000,1000000", help="events per partition, comma-separated")
    parser.add_argument("--live-every", type=int, default=1000, help="one task in N left in flight")
    parser.add_argument("--measure", choices=("full_fold", "events_fold", "restore"), help=argparse.SUPPRESS)
    parser.add_argument("--bootstrap", help=argparse.SUPPRESS)
    parser.add_argument("--prefix", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        sys.stdout.write(orjson.dumps(measure(args.measure, args.bootstrap, args.prefix)).decode() + "\n")
        return 0
    bootstrap = bootstrap_servers()
    admin = AdminClient({"bootstrap.servers": bootstrap})
    figures: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "load_before": os.getloadavg()}}
    rows = []
    layouts = []
    try:
        for size in (int(s) for s in args.sizes.split(",")):
            layout = TopicLayout(prefix=f"bench-restore-{uuid.uuid4().hex[:8]}.", partitions=1)
            layouts.append(layout)
            ensure_topics(admin, layout.core_specs())
            console.print(f"filling a partition with {size:,} events")
            tasks = fill(bootstrap, layout.events, size, args.live_every)
            full = child("full_fold", bootstrap, layout.prefix)
            console.print(f"  full fold: {full}")
            folded = child("events_fold", bootstrap, layout.prefix)
            console.print(f"  restore folding events (empty changelog), then writing it: {folded}")
            restore = child("restore", bootstrap, layout.prefix)
            console.print(f"  restore from the changelog: {restore}")
            rows.append((size, tasks, full, folded, restore))
            figures[str(size)] = {"tasks": tasks, "full_fold": full, "events_fold": folded, "restore": restore}
    finally:
        for layout in layouts:
            admin.delete_topics([spec.name for spec in layout.core_specs()])
    figures["machine"]["load_after"] = os.getloadavg()
    table = Table(title="restore of one partition (each in a process of its own)")
    for column in ("events", "tasks", "live", "full fold s", "events fold s", "changelog write s", "restore s",
                   "records read", "speed-up", "full fold RSS MB", "restore RSS MB", "KB/task full",
                   "KB/task restore"):
        table.add_column(column, justify="right")
    for size, tasks, full, folded, restore in rows:
        per = [(r["rss_mb"] - r["rss_base_mb"]) * 1024 / max(tasks, 1) for r in (full, restore)]
        table.add_row(f"{size:,}", f"{tasks:,}", f"{restore['live']:,}", f"{full['seconds']:.2f}",
                      f"{folded['seconds']:.2f}", f"{folded['changelog_write_s']:.2f}", f"{restore['seconds']:.2f}",
                      f"{restore['records']:,}", f"{full['seconds'] / max(restore['seconds'], 1e-9):.1f}x",
                      f"{full['rss_mb']:.0f}", f"{restore['rss_mb']:.0f}", f"{per[0]:.2f}", f"{per[1]:.2f}")
    Console(width=220).print(table)
    size, tasks, full, folded, restore = rows[-1]
    figures.update({"events": size, "restore_s": restore["seconds"], "full_fold_s": full["seconds"],
                    "events_fold_s": folded["seconds"], "restore_records": restore["records"],
                    "speedup": round(full["seconds"] / max(restore["seconds"], 1e-9), 1),
                    "rss_mb": restore["rss_mb"], "full_fold_rss_mb": full["rss_mb"]})
    sys.stdout.write(orjson.dumps(figures).decode() + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
