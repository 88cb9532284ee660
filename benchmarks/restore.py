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

Then, for the memory of a scheduler after ``--finished`` finished tasks (1,000,000 by default), one changelog
partition is filled with that many finished tasks' records (settled states of the same histories, under new
task ids) and one live task in ``--live-every``, as a scheduler with a changelog leaves it once compacted, and
it is restored twice, each in a process of its own:

- ``held``: every record decoded and held in memory, as the restore did before finished tasks were spilled
  (``scheduler.settled``): the baseline;
- ``spilled``: ``Scheduler.restore`` now: live tasks in memory, finished ones spilled to local disk; then
  1,000 finished tasks are read back as a late command would (``lookup_us``).

Progress goes to stderr, the tables to stdout; the last line of stdout is one JSON object with ``restore_s``,
``full_fold_s``, ``events_fold_s`` (the largest partition), ``rss_mb`` (the scheduler after restoring it from
the changelog) and ``finished``: the memory figures of the scheduler after ``--finished`` finished tasks.
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
from eventstore.replay import LogRange, ReplayReader
from eventstore.topics import TopicLayout, ensure_topics
from scheduler.changelog import CHECKPOINT_KEY, SavedTask, decode_task, encode_checkpoint, encode_task
from scheduler.decider import Limits, TaskState, evolve
from scheduler.service import Scheduler
from schemas.codec import default_codec
from schemas.messages import Event
from schemas.sealed import Keyring
from schemas.states import FINAL
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


def fill_changelog(bootstrap: str, topic: str, finished: int, live_every: int) -> int:
    """Partition 0 of ``topic``: ``finished`` finished tasks' records and one live task's per ``live_every``,
    then a checkpoint at the start of (an empty) ``events``; returns the live tasks' count."""
    folded: dict[str, TaskState] = {}
    for event in histories(400, seed=42, prefix="tmpl", in_flight_every=20):
        folded[event.task_id] = evolve(folded.get(event.task_id), event)
    done = [(s.task_id.encode(), encode_task(SavedTask(s.settled(), None, s.sequence + 1)))
            for s in folded.values() if s.status in FINAL]
    running = [(s.task_id.encode(), encode_task(SavedTask(s, None, s.sequence + 1)))
               for s in folded.values() if not s.is_terminal]
    producer = Producer({**producer_config(bootstrap), "linger.ms": 50})
    live = finished // live_every

    def send(key: bytes, value: bytes) -> None:
        while True:
            try:
                producer.produce(topic, key=key, value=value, partition=0)
                return
            except BufferError:
                producer.poll(0.1)

    for n in range(finished + live):
        template_id, value = done[n % len(done)] if n < finished else running[n % len(running)]
        task_id = f"{'fin' if n < finished else 'run'}-{n:08d}".encode()
        send(task_id, value.replace(template_id, task_id))
    send(CHECKPOINT_KEY, encode_checkpoint(0))
    producer.flush(300)
    return live


def measure_finished(kind: str, bootstrap: str, prefix: str) -> dict[str, Any]:
    """One restore of the changelog partition of finished tasks in this process: seconds, RSS after."""
    layout = TopicLayout(prefix=prefix, partitions=1)
    base = rss_mb()
    started = time.perf_counter()
    if kind == "held":
        held: dict[str, TaskState | None] = {}
        for msg in LogRange(bootstrap, layout.scheduler_state, partitions=[0], batch_size=10000):
            key = msg.key()
            if key:
                held[key.decode()] = decode_task(msg.value()).state
        figures: dict[str, Any] = {"seconds": round(time.perf_counter() - started, 3), "tasks": len(held)}
    else:
        keyring = Keyring.parse(f"bench:{base64.b64encode(os.urandom(32)).decode()}")
        scheduler = Scheduler(bootstrap=bootstrap, layout=layout, registry=REGISTRY, limits=Limits(),
                              keyring=keyring)
        scheduler.restore([TopicPartition(layout.inbox, 0)])
        tasks = scheduler._tasks[0]
        figures = {"seconds": round(time.perf_counter() - started, 3), "tasks": len(tasks),
                   "in_memory": tasks.in_memory, "spilled": tasks.spilled}
        probe = time.perf_counter()
        for n in range(0, tasks.spilled, max(tasks.spilled // 1000, 1)):
            assert tasks[f"fin-{n:08d}"].status in FINAL
        figures["lookup_us"] = round((time.perf_counter() - probe) / 1000 * 1e6, 1)
    figures.update(rss_mb=round(rss_mb(), 1), rss_base_mb=round(base, 1))
    return figures


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
    """One measure in a process of its own, so that its resident memory is its own."""
    out = subprocess.run([sys.executable, "-m", "benchmarks.restore", "--measure", kind, "--bootstrap", bootstrap,
                          "--prefix", prefix], capture_output=True, text=True, check=True)
    return orjson.loads(out.stdout.splitlines()[-1])  # type: ignore[no-any-return]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="10000,100000,1000000", help="events per partition, comma-separated")
    parser.add_argument("--live-every", type=int, default=1000, help="one task in N left in flight")
    parser.add_argument("--finished", type=int, default=1_000_000,
                        help="finished tasks on the changelog partition of the memory measure (0: skip it)")
    parser.add_argument("--measure", choices=("full_fold", "events_fold", "restore", "held", "spilled"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--bootstrap", help=argparse.SUPPRESS)
    parser.add_argument("--prefix", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        measured = (measure_finished if args.measure in ("held", "spilled") else measure)(
            args.measure, args.bootstrap, args.prefix)
        sys.stdout.write(orjson.dumps(measured).decode() + "\n")
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
        if args.finished:
            layout = TopicLayout(prefix=f"bench-restore-{uuid.uuid4().hex[:8]}.", partitions=1)
            layouts.append(layout)
            ensure_topics(admin, layout.core_specs())
            console.print(f"filling a changelog partition with {args.finished:,} finished tasks")
            live = fill_changelog(bootstrap, layout.scheduler_state, args.finished, args.live_every)
            figures["finished"] = {"finished": args.finished, "live": live}
            for kind in ("held", "spilled"):
                figures["finished"][kind] = child(kind, bootstrap, layout.prefix)
                console.print(f"  {kind}: {figures['finished'][kind]}")
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
    if args.finished:
        finished = figures["finished"]
        memory = Table(title=f"a scheduler after {args.finished:,} finished tasks ({finished['live']:,} live)")
        for column in ("restore", "seconds", "RSS MB", "RSS above start MB", "bytes per finished task",
                       "lookup of a finished task µs"):
            memory.add_column(column, justify="right")
        for kind in ("held", "spilled"):
            got = finished[kind]
            above = got["rss_mb"] - got["rss_base_mb"]
            memory.add_row(kind, f"{got['seconds']:.2f}", f"{got['rss_mb']:.0f}", f"{above:.0f}",
                           f"{above * 1024 * 1024 / args.finished:.0f}", str(got.get("lookup_us", "")))
        Console(width=220).print(memory)
    size, tasks, full, folded, restore = rows[-1]
    figures.update({"events": size, "restore_s": restore["seconds"], "full_fold_s": full["seconds"],
                    "events_fold_s": folded["seconds"], "restore_records": restore["records"],
                    "speedup": round(full["seconds"] / max(restore["seconds"], 1e-9), 1),
                    "rss_mb": restore["rss_mb"], "full_fold_rss_mb": full["rss_mb"]})
    sys.stdout.write(orjson.dumps(figures).decode() + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
