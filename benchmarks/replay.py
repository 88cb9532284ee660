"""Rebuilding the state store by replaying ``events``, against a raw confluent-kafka consume of the same topic.

Run by hand from the project folder::

    .venv/bin/python -m benchmarks.replay [--events 1000000] [--workers N] [--skip-postgres] [--postgres-url URL]

The broker is the one named by STEPSTREAM_BOOTSTRAP_SERVERS, else the project's local broker (started if
needed and left running). PostgreSQL is the server named by --postgres-url, else a throwaway cluster made
with the installed server binaries (tests/postgres.py: fsync off, like a rebuild's own scratch schema).

One run, one topic (3 partitions, under a fresh prefix, deleted at the end), filled with realistic task
histories (tests/histories.py: ~8 events a task, retries, failures, alerts) and measured as:

1. raw ``Consumer.consume(500)``, read_committed, from the beginning to the end (median of 3): the ceiling;
2. ``stepstream projections rebuild --into FILE`` (SQLite), the real command in its own process, twice: in
   order in one process (``--workers 1``, the baseline: how every rebuild ran before) and with partitions
   side by side (``--workers N``, default the command's own); the resident memory (VmRSS) of the command
   and its worker processes together is sampled 5 times a second: it must stay flat as the replay goes on;
3. the same two into a PostgreSQL schema;
4. where the time goes, in this process on the first 100,000 records: decoding (Avro + pydantic), the row
   mapping's Python side (``rows.project`` against an executor that runs nothing), and applying decoded events
   to a fresh SQLite store; the side-by-side rebuilds report how long loading the staged rows took;
5. the floor, in CPU time: fastavro alone and the mapping's SQL statements alone (executed from a recording),
   the two parts that are native libraries already. Their sum against the CPU a target leaves an event on
   this machine's cores says whether any Python replay could meet it.

Targets: 100,000 records/s into SQLite, 50,000 into PostgreSQL (side by side).

Progress goes to stderr, the table to stdout; the last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import platform
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, Producer, TopicPartition
from confluent_kafka.admin import AdminClient
from fastavro import schemaless_reader
from rich.console import Console
from rich.table import Table

from benchmarks.shared import postgres_url
from eventstore.broker import LocalBroker
from eventstore.kafka_config import consume_available, producer_config
from eventstore.settings import KafkaSettings
from eventstore.topics import TopicLayout, ensure_topics
from projections.rows import project
from projections.store import Positioned, SqliteStore
from schemas.codec import HEADER_SIZE, default_codec
from schemas.messages import Event
from tests.histories import histories

ROOT = Path(__file__).resolve().parent.parent

PARTITIONS = 3
TARGETS = {"sqlite": 100_000, "postgresql": 50_000}  # records/s of a rebuild side by side
SAMPLE = 100_000
console = Console(stderr=True)


@dataclass
class Stage:
    name: str
    records: int
    seconds: float
    rss_mb: list[float] = field(default_factory=list)
    repeats: list[float] = field(default_factory=list)
    report: dict[str, Any] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return self.records / self.seconds if self.seconds else float("nan")

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"records": self.records, "seconds": round(self.seconds, 3),
                               "records_per_s": round(self.rate)}
        if self.rss_mb:
            settled = self.rss_mb[len(self.rss_mb) // 5:]  # past start-up (imports, connections, first batches)
            out["rss_mb"] = {"samples": len(self.rss_mb), "at_10_percent_steps": _tenths(self.rss_mb),
                             "max": round(max(self.rss_mb), 1),
                             "range_from_20_percent_on": [round(min(settled), 1), round(max(settled), 1)]}
        if self.repeats:
            out["repeats_records_per_s"] = [round(r) for r in self.repeats]
        if self.report:
            out["staged"] = self.report["staged"]
            out["loading_seconds"] = self.report["loading_seconds"]
        return out


def _tenths(samples: list[float]) -> list[float]:
    return [round(samples[min(len(samples) - 1, int(len(samples) * k / 10))], 1) for k in range(1, 11)]


def bootstrap_servers() -> str:
    settings = KafkaSettings()
    if settings.bootstrap_servers:
        return settings.bootstrap_servers
    return LocalBroker(settings.home).start().bootstrap_servers


def fill(bootstrap: str, topic: str, events: int) -> tuple[int, float]:
    """Produce task histories until ``events`` events; returns (events, average bytes)."""
    codec = default_codec()
    producer = Producer(producer_config(bootstrap))
    sent = size = 0
    started = time.perf_counter()
    for event in histories(events // 7 + 1, seed=42, prefix="bench"):
        payload = codec.encode(event)
        while True:
            try:
                producer.produce(topic, key=event.task_id, value=payload)
                break
            except BufferError:
                producer.poll(0.1)
        sent += 1
        size += len(payload)
        if sent % 100_000 == 0:
            console.print(f"produced {sent:,} events ({time.perf_counter() - started:.0f}s)")
        if sent >= events:
            break
    producer.flush(120)
    return sent, size / sent


def raw_consume(bootstrap: str, topic: str, keep: int = 0) -> tuple[Stage, list[bytes]]:
    # librdkafka postpones the next fetch by fetch.queue.backoff.ms (1 s by default) once 100,000 records
    # of a partition wait in its queue: a consumer this fast would measure those pauses, not Kafka.
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"bench-raw-{uuid.uuid4().hex}",
                         "enable.auto.commit": False, "isolation.level": "read_committed",
                         "enable.partition.eof": True, "fetch.max.bytes": 52428800, "fetch.queue.backoff.ms": 10})
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(PARTITIONS)])
    kept: list[bytes] = []
    records = 0
    done: set[int] = set()
    started = last = 0.0
    while len(done) < PARTITIONS:
        before = records
        for msg in consume_available(consumer, 500, 1.0):
            if msg.error() is not None:
                if msg.error().code() == KafkaError._PARTITION_EOF:
                    done.add(msg.partition())
                continue
            if not records:
                started = time.perf_counter()
            records += 1
            if len(kept) < keep:
                kept.append(msg.value())
        if records > before:  # first record to last: not the wait for the end-of-partition events
            last = time.perf_counter()
    consumer.close()
    return Stage("raw consume", records, last - started), kept


def rebuild_command(name: str, env: dict[str, str], into: str, workers: int | None) -> Stage:
    """``stepstream projections rebuild --into`` in its own process, its RSS (workers included) sampled meanwhile."""
    extra = [] if workers is None else ["--workers", str(workers)]
    child = subprocess.Popen([sys.executable, "-m", "stepstream", "projections", "rebuild", "--into", into, "--json",
                              "--no-progress", *extra], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
    samples: list[float] = []

    def sample() -> None:
        while child.poll() is None:
            with contextlib.suppress(OSError):  # a process that just ended: the next sample
                samples.append(sum(_rss_mb(pid) for pid in _with_descendants(child.pid)))
            time.sleep(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, err = child.communicate()
    sampler.join()
    if child.returncode != 0:
        raise RuntimeError(f"{name} failed ({child.returncode}): {err.decode()[-2000:]}")
    report = orjson.loads(out)
    return Stage(name, int(report["records"]), float(report["seconds"]), samples, report=report)


def _with_descendants(pid: int) -> list[int]:
    """The process and its children's children: a staged rebuild's worker processes count too."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [pid, *(p for child in children for p in _with_descendants(int(child)))]


def _rss_mb(pid: int) -> float:
    """0 for a process that ended and waits to be reaped (no VmRSS line)."""
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    return sum(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


def rebuild_pair(backend: str, env: dict[str, str], into: str, workers: int | None) -> list[Stage]:
    """In order (the baseline) then side by side, into fresh stores of one backend (``into`` with ``{}``
    where the store's name goes)."""
    stages = []
    for how, count, tag in (("in order", 1, "in_order"), ("side by side", workers, "staged")):
        console.print(f"rebuild into {backend}, {how} …")
        stages.append(rebuild_command(f"rebuild into {backend}, {how}", env, into.format(tag), count))
        console.print(f"  {stages[-1].rate:,.0f} records/s")
    return stages


class Recorder:
    """An executor that runs nothing and keeps the statements: the row mapping's Python side on its own."""

    def __init__(self) -> None:
        self.statements: list[tuple[str, tuple[Any, ...]]] = []

    def execute(self, sql: str, params: tuple[Any, ...] = ()) -> None:
        self.statements.append((sql, params))


def breakdown(values: list[bytes]) -> dict[str, float]:
    """Microseconds per event of each part of a replay, measured apart on the same records."""
    codec = default_codec()
    started = time.perf_counter()
    events = [codec.decode(v) for v in values]
    decode = time.perf_counter() - started

    recorder = Recorder()
    started = time.perf_counter()
    for event in events:
        project(recorder, event)  # type: ignore[arg-type]
    mapping = time.perf_counter() - started
    with tempfile.TemporaryDirectory() as folder:
        store = SqliteStore(Path(folder) / "b.db", scratch=True)
        started = time.perf_counter()
        decoded = [e for e in events if isinstance(e, Event)]
        for i in range(0, len(decoded), 2000):
            store.apply_events("t", [Positioned(0, i + j, e) for j, e in enumerate(decoded[i:i + 2000])])
        apply = time.perf_counter() - started
        store.close()
    n = len(values)
    return {"decode_us": round(1e6 * decode / n, 2), "row_mapping_python_us": round(1e6 * mapping / n, 2),
            "apply_sqlite_us_incl_mapping": round(1e6 * apply / n, 2)}


def floors(values: list[bytes]) -> dict[str, float]:
    """CPU microseconds per event of the two parts of a replay that are native libraries already, with none of
    the project's Python around them: what a replay in Python costs at the very least.

    * ``avro_us``: fastavro's ``schemaless_reader`` alone (no validation, no conversion), writer schema only;
    * ``sql_us``: the statements ``rows.project`` issues for these events, recorded once and then executed
      through ``sqlite3`` into a staging store (key indexes only, as the side-by-side workers write), 2,000
      events a transaction.
    """
    codec = default_codec()
    writers = [codec.registry.by_fingerprint[v[2:HEADER_SIZE]].parsed for v in values]
    started = time.process_time()
    for value, writer in zip(values, writers, strict=True):
        body = io.BytesIO(value)
        body.seek(HEADER_SIZE)
        schemaless_reader(body, writer, None)
    avro = time.process_time() - started
    batches = []
    events = [e for e in (codec.decode(v) for v in values) if isinstance(e, Event)]
    for i in range(0, len(events), 2000):
        recorder = Recorder()
        for event in events[i:i + 2000]:
            project(recorder, event)
        batches.append(recorder.statements)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "floor.db"
        store = SqliteStore(path, scratch=True)
        store.keys_only()
        store.close()
        conn = sqlite3.connect(path, isolation_level=None)
        conn.execute("pragma journal_mode=memory")
        conn.execute("pragma synchronous=off")
        started = time.process_time()
        for statements in batches:
            conn.execute("begin")
            for sql, params in statements:
                conn.execute(sql, params)
            conn.execute("commit")
        sql_cpu = time.process_time() - started
        conn.close()
    n = len(values)
    return {"avro_us": round(1e6 * avro / n, 2), "sql_us": round(1e6 * sql_cpu / n, 2),
            "statements_per_event": round(sum(len(b) for b in batches) / n, 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--workers", type=int, default=None, help="of the side-by-side rebuilds (default: the "
                                                                      "command's own)")
    parser.add_argument("--skip-postgres", action="store_true")
    parser.add_argument("--postgres-url", default=None)
    args = parser.parse_args()
    bootstrap = bootstrap_servers()
    layout = TopicLayout(prefix=f"bench-replay-{uuid.uuid4().hex[:8]}.", partitions=PARTITIONS)
    admin = AdminClient({"bootstrap.servers": bootstrap})
    ensure_topics(admin, layout.core_specs())
    cluster = None
    figures: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                           "load_before": os.getloadavg()[0]}}
    try:
        console.print(f"filling {layout.events} with {args.events:,} events")
        produced, average = fill(bootstrap, layout.events, args.events)
        figures["events"] = {"count": produced, "average_bytes": round(average, 1)}
        raws = []
        sample: list[bytes] = []
        for i in range(3):
            stage, kept = raw_consume(bootstrap, layout.events, keep=SAMPLE if i == 0 else 0)
            sample = sample or kept
            raws.append(stage)
            console.print(f"raw consume {i + 1}: {stage.rate:,.0f} records/s")
        raw = sorted(raws, key=lambda s: s.rate)[1]
        raw.repeats = [s.rate for s in raws]
        with tempfile.TemporaryDirectory() as home:
            env = {**os.environ, "STEPSTREAM_BOOTSTRAP_SERVERS": bootstrap, "STEPSTREAM_TOPIC_PREFIX": layout.prefix,
                   "STEPSTREAM_HOME": home, "STEPSTREAM_PARTITIONS": str(PARTITIONS)}
            stages = [raw, *rebuild_pair("SQLite", env, str(Path(home) / "rebuilt_{}.db"), args.workers)]
            if not args.skip_postgres:
                url, cluster = postgres_url(args.postgres_url)
                stages += rebuild_pair("PostgreSQL", env, url + "?schema=bench_rebuild_{}", args.workers)
        console.print("breakdown on the first 100,000 records …")
        figures["breakdown_us_per_event"] = breakdown(sample)
        figures["floor_cpu_us_per_event"] = floors(sample)
    finally:
        if cluster is not None:
            cluster.stop()
        admin.delete_topics([spec.name for spec in layout.core_specs()])  # keys and scheduler-state too
    figures["load_after"] = os.getloadavg()[0]
    table = Table(title=f"replay of {produced:,} events ({average:.0f} bytes on average), {PARTITIONS} partitions")
    for column in ("stage", "records", "seconds", "records/s", "of raw", "RSS MB (10%…100%)"):
        table.add_column(column, justify="right" if column != "stage" else "left")
    for stage in stages:
        ratio = stage.rate / raw.rate
        table.add_row(stage.name, f"{stage.records:,}", f"{stage.seconds:.2f}", f"{stage.rate:,.0f}",
                      "" if stage is raw else f"{ratio:.3f}",
                      " ".join(f"{v:.0f}" for v in _tenths(stage.rss_mb)) if stage.rss_mb else "")
        figures[stage.name.replace(" ", "_")] = {**stage.as_json(),
                                                 **({} if stage is raw else {"ratio": round(ratio, 4)})}
    Console().print(table)
    figures["targets"] = {}
    for backend, baseline, staged in zip(("sqlite", "postgresql"), stages[1::2], stages[2::2], strict=False):
        goal = TARGETS[backend]
        figures["targets"][backend] = {"records_per_s": round(staged.rate), "goal": goal, "met": staged.rate >= goal,
                                       "of_goal": round(staged.rate / goal, 3),
                                       "speedup_vs_in_order": round(staged.rate / baseline.rate, 2)}
        Console().print(f"rebuild into {backend} side by side: {staged.rate:,.0f} records/s, "
                        f"{staged.rate / baseline.rate:.2f}x in order, {staged.rate / goal:.2f} of the "
                        f"{goal:,} target ({'met' if staged.rate >= goal else 'missed'})")
    Console().print(f"per event: {figures['breakdown_us_per_event']}")
    floor = figures["floor_cpu_us_per_event"]
    floor["avro_and_sql_us"] = round(floor["avro_us"] + floor["sql_us"], 2)
    for backend, goal in TARGETS.items():
        # CPU a target rate leaves an event if every core replays and nothing else runs (no consuming, loading,
        # validation or mapping): a floor above it cannot meet the target in Python on this machine.
        budget = round((os.cpu_count() or 1) * 1e6 / goal, 2)
        figures["targets"].setdefault(backend, {})["cpu_budget_us_per_event"] = budget
    Console().print(f"floor, CPU µs an event: fastavro alone {floor['avro_us']}, the SQL alone {floor['sql_us']} "
                    f"({floor['statements_per_event']} statements): {floor['avro_and_sql_us']} against a budget of "
                    f"{figures['targets']['sqlite']['cpu_budget_us_per_event']} for the SQLite target on "
                    f"{os.cpu_count()} CPUs")
    figures["raw_median_of_3"] = statistics.median(raw.repeats)
    sys.stdout.write(orjson.dumps(figures).decode() + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
