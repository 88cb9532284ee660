"""End-to-end throughput of the orders workflow, against a raw transactional consume-transform-produce loop.

Run by hand from the project folder::

    .venv/bin/python -m benchmarks.workflow [--tasks N] [--latency-ms MS] [--concurrency N] [--system-only]
                                           [--profile-scheduler [PATH]]

The broker is the one named by STEPSTREAM_BOOTSTRAP_SERVERS, else the project's local broker (started if
needed and left running). Every run uses fresh topics under a unique prefix (deleted at the end unless
``--keep-topics``), a state store and service logs in a fresh temporary folder (kept, for reading), and
measures, one after the other:

1. raw loop: a confluent-kafka consume-transform-produce loop in this process, the scheduler's transactional
   pattern and nothing else (no decoding, no deciding): consume what is there (``consume_available``, the
   runtime's batch size and consumer configuration), produce one output per message on the same partition,
   ``send_offsets_to_transaction``, ``commit_transaction``, with the project's transactional producer
   configuration. Its input is the run's own inbox traffic, encoded: per task 1 SubmitTask + 3 StepResults,
   same keys, same partition count, 4 x N messages per repetition (``--raw-messages``), 5 repetitions with a
   fresh consumer group each; the median counts;
2. scheduler alone (a reference, not a target): the scheduler process with no agents; the same 4 x N messages
   go to its inbox (the StepResults name the attempt ids it will give, ``task:step:1``); the clock runs from
   the first send until every TaskCompleted is in ``events``;
3. the system: the order service (no faults; ``--latency-ms`` delays each answer), then the projector, the
   scheduler, the inventory, payments and shipping agents and the supervisor as real processes
   (``ServiceProcesses``, as the system tests run them). Once every consumer owns its partitions and
   ``--warmup`` tasks went through, N ``SubmitTask`` commands (workflow "orders" v1) are sent to the inbox as
   fast as one ``EventProducer`` sends them; the clock runs from the first send until a watcher reading
   ``events`` (read_committed, not decoding: the writer fingerprint and the key suffice) has seen a terminal
   event for every task.

``--system-only`` skips 1 and 2. ``--concurrency`` sets the agents' ``STEPSTREAM_AGENT_CONCURRENCY``.

Reported: tasks completed / failed, tasks/s, steps/s (3 per task), a step's queue wait (StepStarted to its
first call reaching the order service) and execution (that call to StepSucceeded) at p50 / p99, the
scheduler's inbox rate (4 x N / elapsed) and its ratio to the
raw loop, step latency (StepStarted.occurred_at to StepSucceeded.occurred_at of the same attempt, read back
with ReplayReader after the run), task latency, retried attempts, and the CPU time each process used during
the timed window (from /proc: all threads, and the main thread alone) against the machine's busy time, so
the load of other processes is on record. Targets: >= 1,000 steps/s and a ratio >= 0.3. Every process is
stopped with SIGTERM at the end and its exit code reported. ``--profile-scheduler [PATH]`` runs the system's
scheduler as ``python -m cProfile -o PATH -m stepstream run scheduler`` (slower: such a run's figures are not
the headline; the JSON says ``"scheduler_profiled": true``) and prints its top costs.

librdkafka and client logs go to a file under the project folder, progress to stderr; the last line of
stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import os
import platform
import pstats
import sqlite3
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, Producer, TopicPartition
from rich.console import Console
from rich.table import Table

from benchmarks.shared import (
    create_fresh_topics,
    delete_topics,
    message_count,
    quiet_stderr,
    resolve_bootstrap,
    run_facts,
    short_filename,
)
from demo.orders_client import Arrival, ServiceProcess
from eventstore.kafka_config import (
    consume_available,
    consumer_config,
    producer_config,
    transactional_config,
)
from eventstore.logs import configure_logging
from eventstore.producer import EventProducer
from eventstore.replay import ReplayReader
from eventstore.settings import ConsumerSettings, KafkaSettings
from eventstore.topics import TopicLayout, TopicSpec
from schemas.codec import Codec, default_codec
from schemas.messages import (
    MessageIgnored,
    StepFailed,
    StepResult,
    StepStarted,
    StepSucceeded,
    SubmitTask,
    TaskAccepted,
    TaskCompleted,
    TaskFailed,
    TaskRejected,
)
from schemas.sealed import configured_keys
from schemas.states import TERMINAL
from stepstream.local.processes import ServiceProcesses, child_env

ROOT = Path(__file__).resolve().parent.parent

AGENTS = ("inventory", "payments", "shipping")
SERVICES = ("projector", "scheduler", *AGENTS, "supervisor")
STEPS_PER_TASK = 3
INBOX_PER_TASK = 4  # what the scheduler consumes per task: 1 SubmitTask + 3 StepResults
STEPS_TARGET = 1_000.0
RATIO_TARGET = 0.3
RAW_REPEATS = 5  # a raw repetition lasts about a second and swings with the machine's load: the median of 5
TERMINAL_EVENTS = frozenset({"TaskCompleted", "TaskFailed", "TaskRejected"})
TERMINAL_STATUSES = tuple(sorted(TERMINAL))  # the query's parameters, in a stable order
TIMED = "t-"  # task id prefixes: timed tasks, warm-up tasks
WARMUP = "w-"
STALL_TIMEOUT_S = 120.0
CLK_TCK = os.sysconf("SC_CLK_TCK")
DEFAULT_PROFILE = Path("/tmp/sched.prof")


# -- measuring ------------------------------------------------------------------------------------


def process_cpu_s(pid: int | None, main_thread: bool = False) -> float | None:
    """User + system CPU seconds of a live process, all its threads (librdkafka's too), or only of its main
    thread (where a Python service runs its Python code); None if gone."""
    if pid is None:
        return None
    try:
        stat = Path(f"/proc/{pid}/task/{pid}/stat" if main_thread else f"/proc/{pid}/stat")
        fields = stat.read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def machine_cpu_s() -> float:
    """CPU seconds the whole machine spent busy (every core, every process), since boot."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
    return (sum(values) - values[3] - values[4]) / CLK_TCK  # minus idle and iowait


@dataclass(frozen=True)
class CpuSnapshot:
    at: float
    machine: float
    processes: dict[str, float | None]
    main_threads: dict[str, float | None]

    @classmethod
    def take(cls, pids: dict[str, int | None]) -> CpuSnapshot:
        return cls(time.perf_counter(), machine_cpu_s(), {name: process_cpu_s(pid) for name, pid in pids.items()},
                   {name: process_cpu_s(pid, main_thread=True) for name, pid in pids.items()})


def cpu_usage(before: CpuSnapshot, after: CpuSnapshot) -> tuple[dict[str, float], dict[str, float]]:
    """CPU seconds per process between two snapshots, plus ``machine`` and ``other`` (everything else);
    and per process, its main thread's share."""
    def between(start: dict[str, float | None], end: dict[str, float | None]) -> dict[str, float]:
        return {name: round(b - a, 3) for name, a in start.items()
                if a is not None and (b := end.get(name)) is not None}

    used = between(before.processes, after.processes)
    main = between(before.main_threads, after.main_threads)
    machine = after.machine - before.machine
    used["machine"] = round(machine, 3)
    used["other"] = round(machine - sum(v for k, v in used.items() if k != "machine"), 3)
    return used, main


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list (NaN when empty)."""
    if not sorted_values:
        return float("nan")
    rank = max(1, min(len(sorted_values), round(q / 100 * len(sorted_values) + 0.5)))
    return sorted_values[rank - 1]


def latency_summary(values_ms: list[float]) -> dict[str, float | int]:
    ordered = sorted(values_ms)
    return {"count": len(ordered), "p50_ms": round(percentile(ordered, 50), 1),
            "p99_ms": round(percentile(ordered, 99), 1),
            "max_ms": round(ordered[-1], 1) if ordered else float("nan")}


# -- set-up ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Topics:
    layout: TopicLayout  # the whole system's
    solo: TopicLayout  # the scheduler's, when it runs alone
    raw_in: str
    raw_out: str

    def specs(self) -> list[TopicSpec]:
        p = self.layout.partitions
        return [*(spec for layout in (self.layout, self.solo)
                  for spec in (*layout.core_specs(), *(layout.agent_spec(a) for a in AGENTS))),
                TopicSpec(self.raw_in, p), TopicSpec(self.raw_out, p)]

    @property
    def names(self) -> list[str]:
        return [spec.name for spec in self.specs()]


def create_topics(bootstrap: str, topics: Topics) -> None:
    """Every topic of the run (agent topics too: a deployment has them), once each partition has a leader."""
    create_fresh_topics(bootstrap, topics.specs(), topics.layout.replication_factor)


def order(task_id: str, i: int) -> SubmitTask:
    return SubmitTask(task_id=task_id, workflow="orders", workflow_version=1,
                      input={"order_id": task_id, "sku": f"SKU-{i % 50:03d}", "qty": 1 + i % 3,
                             "amount": 10 + i % 90})


def inbox_like_messages(codec: Codec, n: int) -> tuple[list[str], list[bytes]]:
    """Keys and encoded bytes shaped like the inbox of the timed run: per task, its SubmitTask and the
    StepResults of its three steps (with outputs the size the order service answers)."""
    keys: list[str] = []
    payloads: list[bytes] = []
    for i in range(n):
        task_id = f"{TIMED}{i:06d}"
        keys.append(task_id)
        payloads.append(codec.encode(order(task_id, i)))
        for step, output in (("reserve", {"reservation_id": f"res_{uuid.uuid4().hex[:16]}", "status": "reserved"}),
                             ("charge", {"charge_id": f"ch_{uuid.uuid4().hex[:16]}", "status": "captured"}),
                             ("ship", {"shipment_id": f"shp_{uuid.uuid4().hex[:16]}", "status": "created"})):
            keys.append(task_id)
            payloads.append(codec.encode(StepResult(task_id=task_id, step=step, attempt_id=f"{task_id}:{step}:1",
                                                    ok=True, output={"order_id": task_id, **output}, calls=1)))
    return keys, payloads


# -- stage 1: the raw transactional loop -----------------------------------------------------------


@dataclass(frozen=True)
class LoopRun:
    messages: int
    seconds: float
    cpu_seconds: float  # of this process, librdkafka's threads included
    transactions: int
    commit_seconds: float = 0.0  # in send_offsets_to_transaction + commit_transaction
    broker_cpu_seconds: float | None = None  # of the local broker, when there is one

    @property
    def rate(self) -> float:
        return self.messages / self.seconds if self.seconds > 0 else float("nan")


def fill(bootstrap: str, topic: str, keys: list[str], payloads: list[bytes], n: int) -> None:
    producer = Producer(producer_config(bootstrap))
    for i in range(n):
        j = i % len(payloads)
        while True:
            try:
                producer.produce(topic, payloads[j], keys[j])
                break
            except BufferError:
                producer.poll(0.1)
    if producer.flush(120):
        raise RuntimeError(f"{topic}: not every message was delivered")


def raw_loop(bootstrap: str, topics: Topics, n: int, settings: ConsumerSettings, run: int,
             broker_pid: int | None) -> LoopRun:
    """Consume-transform-produce with one transaction per batch, the way the runtime does it for the
    scheduler (same consumer and producer configuration, same batch size), minus decoding and deciding."""
    prefix = topics.layout.prefix
    group = f"{prefix}raw-loop-{run}"
    consumer = Consumer(consumer_config(bootstrap, group, settings, **{"enable.auto.commit": False}))
    producer = Producer(transactional_config(bootstrap, f"{prefix}raw-loop-{run}"))
    producer.init_transactions(30)
    consumer.subscribe([topics.raw_in])
    source, sink = topics.raw_in, topics.raw_out
    produce = producer.produce
    count = transactions = 0
    start_wall = start_cpu = committing = 0.0
    broker_start: float | None = None
    idle_since = time.monotonic()
    try:
        while count < n:
            batch = consume_available(consumer, settings.batch_size, settings.poll_timeout_s)
            if not batch:
                if time.monotonic() - idle_since > STALL_TIMEOUT_S:
                    raise RuntimeError(f"raw loop stalled at {count}/{n}")
                continue
            if count == 0:
                start_wall, start_cpu = time.perf_counter(), time.process_time()
                broker_start = process_cpu_s(broker_pid)
            del batch[n - count:]  # exactly n messages in all: the last transaction takes only what is left
            producer.begin_transaction()
            offsets: dict[int, int] = {}
            for msg in batch:
                if msg.error() is not None:
                    raise RuntimeError(f"raw loop: {msg.error()}")
                partition = msg.partition()
                produce(sink, msg.value(), msg.key(), partition=partition)
                offsets[partition] = msg.offset() + 1
            commit_started = time.perf_counter()
            producer.send_offsets_to_transaction([TopicPartition(source, p, o) for p, o in offsets.items()],
                                                 consumer.consumer_group_metadata(), 30)
            producer.commit_transaction(30)
            committing += time.perf_counter() - commit_started
            transactions += 1
            count += len(batch)
            idle_since = time.monotonic()
        end_wall, end_cpu = time.perf_counter(), time.process_time()
        broker_end = process_cpu_s(broker_pid)
    finally:
        consumer.close()
    broker = broker_end - broker_start if broker_start is not None and broker_end is not None else None
    return LoopRun(count, end_wall - start_wall, end_cpu - start_cpu, transactions, committing, broker)


# -- stage 2: the system ----------------------------------------------------------------------------


class LagSampler(threading.Thread):
    """Every ``interval_s``, each consumer group's lag (end offsets minus committed offsets) on its topic:
    where the backlog sits is where the system waits. Agents commit every second (at-least-once), the
    scheduler with each transaction; ``events`` holds transaction markers, so the projector's lag is an
    upper bound."""

    def __init__(self, bootstrap: str, groups: dict[str, tuple[str, str]], partitions: int,
                 interval_s: float = 0.5) -> None:
        super().__init__(name="lag-sampler", daemon=True)
        self._groups = groups  # name -> (group id, topic)
        self._partitions = partitions
        self._interval_s = interval_s
        self._consumers = {name: Consumer({"bootstrap.servers": bootstrap, "group.id": group,
                                           "enable.auto.commit": False})
                           for name, (group, _topic) in groups.items()}
        self._halt = threading.Event()
        self.samples: dict[str, list[int]] = {name: [] for name in groups}

    def run(self) -> None:
        try:
            while not self._halt.wait(self._interval_s):
                for name, (_group, topic) in self._groups.items():
                    consumer = self._consumers[name]
                    tps = [TopicPartition(topic, p) for p in range(self._partitions)]
                    committed = {tp.partition: tp.offset for tp in consumer.committed(tps, timeout=5)}
                    lag = 0
                    for tp in tps:
                        high = consumer.get_watermark_offsets(tp, timeout=5)[1]
                        lag += max(0, high - max(0, committed.get(tp.partition, 0)))
                    self.samples[name].append(lag)
        except Exception:  # a missing sample is no reason to fail the run
            pass
        finally:
            for consumer in self._consumers.values():
                consumer.close()

    def halt(self) -> dict[str, dict[str, float]]:
        self._halt.set()
        self.join(30)
        return {name: {"mean": round(sum(values) / len(values), 1) if values else float("nan"),
                       "peak": max(values, default=0), "samples": len(values)}
                for name, values in self.samples.items()}


class TerminalWatcher(threading.Thread):
    """Reads ``events`` (read_committed) and notes when each task first shows a terminal event.

    No decoding: the writer schema's fingerprint (bytes 2 to 10) names the event type, the key is the
    task id. That keeps the watcher's CPU use (it shares the machine with the system) to raw consuming.
    """

    def __init__(self, bootstrap: str, topic: str, partitions: int, codec: Codec) -> None:
        super().__init__(name="terminal-watcher", daemon=True)
        self._terminal = {fp: v.full_name.rsplit(".", 1)[-1] for fp, v in codec.registry.by_fingerprint.items()
                          if v.full_name.rsplit(".", 1)[-1] in TERMINAL_EVENTS}
        self._consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"bench-watcher-{uuid.uuid4().hex}",
                                   "enable.auto.commit": False, "isolation.level": "read_committed"})
        self._consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(partitions)])
        self._halt = threading.Event()
        self.done: dict[str, tuple[str, float]] = {}  # task id -> (terminal event, perf_counter when seen)
        self.counts: Counter[str] = Counter()  # per task id prefix
        self.events = 0
        self.last_seen = 0.0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self._halt.is_set():
                for msg in consume_available(self._consumer, 1000, 0.05):
                    if msg.error() is not None:
                        if msg.error().code() != KafkaError._PARTITION_EOF:
                            raise RuntimeError(f"watcher: {msg.error()}")
                        continue
                    self.events += 1
                    value = msg.value()
                    name = self._terminal.get(value[2:10]) if value else None
                    if name is not None:
                        key = msg.key().decode()
                        if key not in self.done:
                            now = time.perf_counter()
                            self.done[key] = (name, now)
                            self.counts[key[:2]] += 1
                            self.last_seen = now
        except BaseException as exc:  # reported by the main thread
            self.error = exc
        finally:
            self._consumer.close()

    def halt(self) -> None:
        self._halt.set()
        self.join(30)

    def wait_for(self, prefix: str, n: int, progress: Callable[[str], None], what: str) -> None:
        seen, seen_at, reported = -1, time.monotonic(), time.monotonic()
        while self.counts[prefix] < n:
            if self.error is not None:
                raise RuntimeError(f"watcher failed: {self.error!r}")
            if self.counts[prefix] != seen:
                seen, seen_at = self.counts[prefix], time.monotonic()
            elif time.monotonic() - seen_at > STALL_TIMEOUT_S:
                raise RuntimeError(f"{what}: no task ended for {STALL_TIMEOUT_S:.0f}s ({seen}/{n} terminal)")
            if time.monotonic() - reported >= 2.0:
                progress(f"{what}: {self.counts[prefix]:,}/{n:,} tasks terminal, {self.events:,} events")
                reported = time.monotonic()
            time.sleep(0.01)


def store_terminal_count(path: Path) -> int:
    """One COUNT query on the state store (0 while its tables do not exist yet)."""
    if not path.exists():
        return 0
    try:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)) as db:
            marks = ",".join("?" * len(TERMINAL_STATUSES))
            row = db.execute(f"select count(*) from tasks where status in ({marks})", TERMINAL_STATUSES).fetchone()
            return int(row[0])
    except sqlite3.OperationalError:
        return 0


def service_env(bootstrap: str, layout: TopicLayout, folder: Path, service_url: str) -> dict[str, str]:
    env = child_env(STEPSTREAM_BOOTSTRAP_SERVERS=bootstrap, STEPSTREAM_TOPIC_PREFIX=layout.prefix,
                    STEPSTREAM_PARTITIONS=str(layout.partitions), STEPSTREAM_HOME=str(folder),
                    STEPSTREAM_STORE_PATH=str(folder / "state.db"), STEPSTREAM_AGENT_SERVICE_URL=service_url,
                    STEPSTREAM_SCHEDULER_WORKFLOWS="demo.workflows:REGISTRY", STEPSTREAM_LOG_JSON="true")
    for inherited in ("STEPSTREAM_METRICS_PORT", "STEPSTREAM_SCHEDULER_INSTANCE"):
        env.pop(inherited, None)  # one port for six processes would not do; nor a fixed transactional id
    # The demo's latest orders version marks a field, and a scheduler of its registry starts only with a master
    # key: the folder's own development key, as ``stepstream up`` makes one (the timed orders, v1, seal nothing).
    env.setdefault("STEPSTREAM_ENCRYPTION_KEYS", configured_keys(folder, create=True) or "")
    return env


@dataclass(frozen=True)
class SoloRun:
    """The scheduler process alone, over an inbox filled with every message of N tasks' happy paths."""

    messages: int
    seconds: float
    cpu_seconds: float  # of the scheduler process, librdkafka's threads included
    main_thread_cpu_seconds: float  # of its main thread: the Python code
    broker_cpu_seconds: float | None
    outcomes: dict[str, int]
    exit_code: int

    @property
    def rate(self) -> float:
        return self.messages / self.seconds


def run_scheduler_alone(bootstrap: str, layout: TopicLayout, folder: Path, keys: list[str], payloads: list[bytes],
                        n: int, codec: Codec, broker_pid: int | None, step: Callable[[str], None]) -> SoloRun:
    """The scheduler's own capacity: no agents, no order service. Its inbox receives, as fast as one producer
    sends them, each task's SubmitTask and the successful StepResults of its three steps, naming the attempt
    ids the scheduler will give (``task:step:1``); the clock runs from the first send until every task's
    TaskCompleted is in ``events``. The same messages as the raw loop's, in the same order per task."""
    procs = ServiceProcesses(service_env(bootstrap, layout, folder, "http://127.0.0.1:9"), folder / "logs", cwd=ROOT)
    watcher = TerminalWatcher(bootstrap, layout.events, layout.partitions, codec)
    code = -1
    try:
        procs.service("scheduler", "scheduler")
        procs.wait_started("scheduler")
        procs.wait_started("scheduler", "partition restored", count=layout.partitions, timeout_s=90.0)
        watcher.start()
        pid = procs.procs["scheduler"].pid
        producer = Producer(producer_config(bootstrap))
        gc.collect()
        broker_before = process_cpu_s(broker_pid)
        main_before, cpu_before, started = process_cpu_s(pid, True), process_cpu_s(pid), time.perf_counter()
        for key, value in zip(keys, payloads, strict=True):
            while True:
                try:
                    producer.produce(layout.inbox, value, key)
                    break
                except BufferError:
                    producer.poll(0.1)
        if producer.flush(120):
            raise RuntimeError("the scheduler's inbox was not filled")
        watcher.wait_for(TIMED, n, step, "scheduler alone")
        cpu_after, main_after, broker_after = process_cpu_s(pid), process_cpu_s(pid, True), process_cpu_s(broker_pid)
        seconds = watcher.last_seen - started
        outcomes = dict(Counter(name for name, _t in watcher.done.values()))
    finally:
        if watcher.is_alive():
            watcher.halt()
        code = procs.terminate_all()["scheduler"]
    assert cpu_before is not None and cpu_after is not None and main_before is not None and main_after is not None
    broker = broker_after - broker_before if broker_before is not None and broker_after is not None else None
    return SoloRun(len(payloads), seconds, cpu_after - cpu_before, main_after - main_before, broker, outcomes, code)


@dataclass
class SystemRun:
    tasks: int
    warmup: int
    submit_seconds: float = 0.0
    inbox_messages: int = 0  # what the inbox received in the timed window: submissions, results, recoveries
    elapsed: float = 0.0  # first send to the last terminal event seen
    outcomes: dict[str, int] = field(default_factory=dict)
    cpu: dict[str, float] = field(default_factory=dict)
    cpu_main_thread: dict[str, float] = field(default_factory=dict)
    lag: dict[str, dict[str, float]] = field(default_factory=dict)  # per consumer, mean and peak backlog
    store_lag_s: float | None = None  # after the last terminal event, until the store showed every task ended
    exit_codes: dict[str, int | None] = field(default_factory=dict)
    logs: str = ""
    profile: Path | None = None
    arrivals: dict[str, dict[str, list[Arrival]]] = field(default_factory=dict)  # the order service's

    @property
    def tasks_per_s(self) -> float:
        return self.tasks / self.elapsed

    @property
    def steps_per_s(self) -> float:
        return STEPS_PER_TASK * self.tasks / self.elapsed

    @property
    def inbox_per_s(self) -> float:
        return INBOX_PER_TASK * self.tasks / self.elapsed


def instance_names(instances: int) -> list[str]:
    """The processes of a system run: ``instances`` of the scheduler and of each agent (the further ones
    named ``scheduler#2``, ...: each in its service's consumer group), one projector, one supervisor."""
    scaled = ("scheduler", *AGENTS)
    return [*SERVICES, *(f"{name}#{k}" for k in range(2, instances + 1) for name in scaled)]


def run_system(bootstrap: str, topics: Topics, tmp: Path, n: int, warmup: int, broker_pids: list[int],
               codec: Codec, profile: Path | None, step: Callable[[str], None], latency_ms: int = 0,
               concurrency: int | None = None, instances: int = 1) -> SystemRun:
    layout = topics.layout
    names = instance_names(instances)
    result = SystemRun(n, warmup, logs=str(tmp / "logs"), profile=profile)
    store = tmp / "state.db"
    (tmp / "logs").mkdir(parents=True, exist_ok=True)
    service = ServiceProcess(log_path=tmp / "logs" / "orders-service.log").start()
    admin = service.admin(timeout_s=60)
    if latency_ms:
        admin.set_faults(latency_ms=latency_ms)
    env = service_env(bootstrap, layout, tmp, service.base_url)
    if concurrency is not None:
        env["STEPSTREAM_AGENT_CONCURRENCY"] = str(concurrency)
    procs = ServiceProcesses(env, tmp / "logs", cwd=ROOT)
    watcher = TerminalWatcher(bootstrap, layout.events, layout.partitions, codec)
    try:
        for name in names:
            service_name = name.partition("#")[0]
            if service_name in AGENTS:
                procs.service(name, "agent", service_name)
            elif name == "scheduler" and profile is not None:
                procs.start(name, "cProfile", "-o", str(profile), "-m", "stepstream", "run", "scheduler")
            else:
                procs.service(name, service_name)
        for name in names:
            procs.wait_started(name, timeout_s=180.0)  # sixteen processes importing at once on a busy machine
        # Ready means: every consumer owns its partitions (the scheduler restored each), the supervisor leads;
        # with several instances, each owns some (the warm-up then runs through the settled groups).
        if instances == 1:
            procs.wait_started("scheduler", "partition restored", count=layout.partitions, timeout_s=90.0)
        for name in names:
            marker = {"scheduler": "partition restored", "supervisor": "leadership acquired"}.get(
                name.partition("#")[0], "partitions assigned")
            procs.wait_started(name, marker, timeout_s=90.0)
        step(f"services up: order service {service.base_url}, {', '.join(names)}; logs in {tmp / 'logs'}")
        watcher.start()
        producer = EventProducer(bootstrap)
        for i in range(warmup):
            producer.send(layout.inbox, order(f"{WARMUP}{i:04d}", i))
        producer.flush()
        watcher.wait_for(WARMUP, warmup, step, "warm-up")
        step(f"warm-up: {warmup} tasks ended; submitting {n:,} tasks")

        commands = [order(f"{TIMED}{i:06d}", i) for i in range(n)]
        inbox = layout.inbox
        pids: dict[str, int | None] = {name: proc.pid for name, proc in procs.procs.items()}
        pids |= {"orders-service": service.pid, "benchmark": os.getpid()}
        # A cluster's nodes as instances of one "broker" (``broker``, ``broker#2``, ...), as services' are.
        pids |= {("broker" if k == 1 else f"broker#{k}"): pid for k, pid in enumerate(broker_pids, 1)}
        inbox_before = message_count(bootstrap, inbox, layout.partitions)
        gc.collect()
        groups = {"scheduler (inbox)": (f"{layout.prefix}scheduler", inbox),
                  **{f"{a} (agent.{a})": (f"{layout.prefix}agent.{a}", layout.agent(a)) for a in AGENTS},
                  "projector (events)": (f"{layout.prefix}projector", layout.events)}
        sampler = LagSampler(bootstrap, groups, layout.partitions)
        before = CpuSnapshot.take(pids)
        sampler.start()
        send = producer.send
        for command in commands:
            send(inbox, command)
        producer.flush()
        result.submit_seconds = time.perf_counter() - before.at
        step(f"submitted {n:,} tasks in {result.submit_seconds:.2f}s")
        watcher.wait_for(TIMED, n, step, "timed run")
        after = CpuSnapshot.take(pids)
        result.lag = sampler.halt()
        result.elapsed = watcher.last_seen - before.at
        result.cpu, result.cpu_main_thread = cpu_usage(before, after)
        result.inbox_messages = message_count(bootstrap, inbox, layout.partitions) - inbox_before
        result.outcomes = dict(Counter(name for key, (name, _t) in watcher.done.items() if key.startswith(TIMED)))
        step(f"all {n:,} tasks ended after {result.elapsed:.2f}s: {result.tasks_per_s:,.0f} tasks/s, "
             f"{result.steps_per_s:,.0f} steps/s")
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if store_terminal_count(store) >= n + warmup:
                result.store_lag_s = round(time.perf_counter() - watcher.last_seen, 2)
                break
            time.sleep(0.5)
        step(f"state store caught up {result.store_lag_s}s after the last terminal event"
             if result.store_lag_s is not None else "[yellow]state store did not catch up within 120s[/yellow]")
        result.arrivals = admin.arrivals()
    finally:
        admin.close()
        if watcher.is_alive():
            watcher.halt()
        step("stopping every service with SIGTERM")
        result.exit_codes = dict(procs.terminate_all())
        result.exit_codes["orders-service"] = service.stop()
    return result


# -- after the run: latencies from the event store ---------------------------------------------------


def first_calls(arrivals: dict[str, dict[str, list[Arrival]]]) -> dict[str, datetime]:
    """Attempt id (``task:step:n``) -> when its first call reached the order service."""
    first: dict[str, datetime] = {}
    for per_key in arrivals.values():
        for key, log in per_key.items():
            for arrival in log:
                first.setdefault(f"{key}:{arrival['attempt']}", datetime.fromtimestamp(arrival["at"], UTC))
    return first


def analyse_events(bootstrap: str, topic: str, called: dict[str, datetime]) -> dict[str, Any]:
    """Step and task latencies of the timed tasks, and how many events of each type they produced.

    With ``called`` (each attempt's first call at the service), a step's time splits into its queue wait
    (StepStarted to that call: in the agent's topic and the agent's queue) and its execution (that call to
    StepSucceeded: the service, the answer on inbox, the scheduler).
    """
    started: dict[str, datetime] = {}
    succeeded: dict[str, datetime] = {}
    accepted: dict[str, datetime] = {}
    ended: dict[str, datetime] = {}
    counts: Counter[str] = Counter()
    failures: Counter[str] = Counter()
    ignored: Counter[str] = Counter()
    reader = ReplayReader(bootstrap, topic)
    for record in reader:
        event = record.message
        if not event.task_id.startswith(TIMED):
            continue
        counts[type(event).__name__] += 1
        if isinstance(event, StepStarted):
            started[event.attempt_id] = event.occurred_at
        elif isinstance(event, StepSucceeded):
            succeeded[event.attempt_id] = event.occurred_at
        elif isinstance(event, TaskAccepted):
            accepted[event.task_id] = event.occurred_at
        elif isinstance(event, StepFailed):
            failures["timed out (supervisor)" if event.timed_out else _failure_kind(event.error)] += 1
        elif isinstance(event, MessageIgnored):
            ignored[f"{event.message_type}: {event.reason.split(':')[0]}"] += 1
        elif isinstance(event, (TaskCompleted, TaskFailed, TaskRejected)):
            ended[event.task_id] = event.occurred_at
    by_step: dict[str, list[float]] = {}
    for attempt, done in succeeded.items():
        if attempt in started:
            step = attempt.rsplit(":", 2)[1]
            by_step.setdefault(step, []).append((done - started[attempt]).total_seconds() * 1000)
    task_ms = [(ended[t] - accepted[t]).total_seconds() * 1000 for t in ended if t in accepted]
    wait_ms = [(called[a] - at).total_seconds() * 1000 for a, at in started.items() if a in called]
    run_ms = [(done - called[a]).total_seconds() * 1000 for a, done in succeeded.items() if a in called]
    first, last = (min(accepted.values()), max(ended.values())) if accepted and ended else (None, None)
    return {
        "step_latency": latency_summary([v for values in by_step.values() for v in values]),
        "step_latency_by_step": {name: latency_summary(values) for name, values in by_step.items()},
        "task_latency": latency_summary(task_ms),
        "step_queue_wait": latency_summary(wait_ms),
        "step_execution": latency_summary(run_ms),
        "event_counts": dict(sorted(counts.items())),
        "step_failures": dict(failures.most_common()),
        "messages_ignored": dict(ignored.most_common()),
        "scheduler_span_s": round((last - first).total_seconds(), 3) if first and last else None,
        "undecodable": reader.stats.undecodable,
    }


def _failure_kind(error: str) -> str:
    """An agent-reported failure, without its task-specific details."""
    return error.split(" after ")[0] if error.startswith("deadline passed") else error[:60]


# -- output -------------------------------------------------------------------------------------------


def profile_table(path: Path, top: int = 25) -> tuple[Table, dict[str, Any]]:
    stats = pstats.Stats(str(path), stream=io.StringIO())
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    rows = []
    for (filename, line, name), (_cc, calls, own, cum, _callers) in raw.items():
        where = name if filename == "~" else f"{short_filename(filename, ROOT)}:{line}({name})"
        rows.append((where, calls, own, cum))
    total = sum(r[2] for r in rows)
    rows.sort(key=lambda r: r[2], reverse=True)
    table = Table(title=f"cProfile of the scheduler's main thread, by own time ({total:.2f}s in all; {path})",
                  title_justify="left")
    for column in ("function", "calls", "own s", "own %", "cum s"):
        table.add_column(column, justify="left" if column == "function" else "right")
    for where, calls, own, cum in rows[:top]:
        table.add_row(where, f"{calls:,}", f"{own:.2f}", f"{100 * own / total:.1f}", f"{cum:.2f}")
    return table, {"total_s": round(total, 3),
                   "top": [{"function": w, "calls": c, "own_s": round(o, 3), "cum_s": round(cu, 3)}
                           for w, c, o, cu in rows[:top]]}


def results_table(system: SystemRun, raw: LoopRun | None, raw_runs: list[LoopRun], alone: SoloRun | None,
                  events: dict[str, Any], partitions: int, latency_ms: int) -> Table:
    table = Table(title=f"Workflow end to end: {system.tasks:,} orders (3 steps each), {partitions} partitions, "
                        f"order service latency {latency_ms} ms", title_justify="left",
                  caption="step latency: StepStarted.occurred_at -> StepSucceeded.occurred_at of the same attempt; "
                          "task latency: TaskAccepted -> its terminal event", caption_justify="left")
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_column("target / note")
    steps_ok = "met" if system.steps_per_s >= STEPS_TARGET else "MISSED"
    step_lat, task_lat = events["step_latency"], events["task_latency"]
    wait, run = events["step_queue_wait"], events["step_execution"]
    rows = [
        ("elapsed, first submit to last terminal event", f"{system.elapsed:.2f} s",
         f"submitting took {system.submit_seconds:.2f} s"),
        ("tasks/s", f"{system.tasks_per_s:,.0f}", ", ".join(f"{v:,} {k}" for k, v in sorted(system.outcomes.items()))),
        ("steps/s", f"{system.steps_per_s:,.0f}", f">= {STEPS_TARGET:,.0f}: {steps_ok}"),
        ("scheduler inbox msgs/s (4 per task)", f"{system.inbox_per_s:,.0f}",
         f"the inbox actually got {system.inbox_messages:,} messages "
         f"({system.inbox_messages / system.elapsed:,.0f}/s)"),
        ("attempts beyond one per step", f"{events['event_counts'].get('StepStarted', 0) - 3 * system.tasks:,}",
         "; ".join(f"{v:,} {k}" for k, v in {**events["step_failures"], **events["messages_ignored"]}.items())),
        ("step latency p50 / p99", f"{step_lat['p50_ms']:,.0f} / {step_lat['p99_ms']:,.0f} ms",
         "; ".join(f"{k} {v['p50_ms']:,.0f}/{v['p99_ms']:,.0f}" for k, v in events["step_latency_by_step"].items())),
        ("step queue wait p50 / p99", f"{wait['p50_ms']:,.0f} / {wait['p99_ms']:,.0f} ms",
         "StepStarted -> the attempt's first call at the order service"),
        ("step execution p50 / p99", f"{run['p50_ms']:,.0f} / {run['p99_ms']:,.0f} ms",
         "that call -> StepSucceeded (service, answer on inbox, scheduler)"),
        ("task latency p50 / p99", f"{task_lat['p50_ms']:,.0f} / {task_lat['p99_ms']:,.0f} ms", ""),
        ("consumer lag, mean / peak (messages)", "",
         "; ".join(f"{k} {v['mean']:,.0f} / {v['peak']:,.0f}" for k, v in system.lag.items())),
        ("state store caught up", "" if system.store_lag_s is None else f"+{system.store_lag_s:.1f} s",
         "after the last terminal event (the projector is not on the clock's path)"),
    ]
    if raw is not None and alone is not None:
        ratio = system.inbox_per_s / raw.rate
        ratio_ok = "met" if ratio >= RATIO_TARGET else "MISSED"
        rows += [
            (f"raw transactional loop msgs/s (median of {len(raw_runs)})", f"{raw.rate:,.0f}",
             "runs: " + ", ".join(f"{r.rate:,.0f}" for r in raw_runs) + f"; {raw.messages:,} msgs, "
             f"{raw.transactions} transactions, {1000 * raw.commit_seconds / raw.transactions:.0f} ms each in "
             f"send_offsets + commit ({raw.commit_seconds / raw.seconds:.0%} of the time); "
             f"{1e6 * raw.cpu_seconds / raw.messages:,.0f} CPU µs/msg"
             + ("" if raw.broker_cpu_seconds is None
                else f", broker {1e6 * raw.broker_cpu_seconds / raw.messages:,.0f} CPU µs/msg")),
            ("ratio inbox rate / raw loop", f"{ratio:.3f}", f">= {RATIO_TARGET}: {ratio_ok}"),
            ("ref: scheduler alone, inbox msgs/s (same messages as the raw loop)", f"{alone.rate:,.0f}",
             f"{alone.rate / raw.rate:.3f} of the raw loop; {1e6 * alone.cpu_seconds / alone.messages:,.0f} CPU µs/msg "
             f"({1e6 * alone.main_thread_cpu_seconds / alone.messages:,.0f} in the main thread), "
             f"{alone.cpu_seconds / alone.seconds:.2f} cores; {alone.messages:,} msgs in {alone.seconds:.2f} s"
             + ("" if alone.broker_cpu_seconds is None
                else f"; broker {1e6 * alone.broker_cpu_seconds / alone.messages:,.0f} CPU µs/msg")),
        ]
    for row in rows:
        table.add_row(*row)
    return table


def cpu_table(system: SystemRun) -> Table:
    table = Table(title=f"CPU used during the timed window ({system.elapsed:.2f} s; /proc, all threads)",
                  title_justify="left",
                  caption="main thread: where a Python service runs its Python code (the rest is librdkafka's "
                          "threads); other: processes outside this run; machine: all of them (10 ms ticks)",
                  caption_justify="left")
    # "other": processes outside this run (other engineers' tests); "machine": every process, all cores
    for column in ("process", "CPU s", "main thread", "cores", "CPU µs/task", "exit code"):
        table.add_column(column, justify="left" if column == "process" else "right")
    processes = sorted((kv for kv in system.cpu.items() if kv[0] not in ("other", "machine")), key=lambda kv: -kv[1])
    for name, seconds in [*processes, ("other", system.cpu["other"]), ("machine", system.cpu["machine"])]:
        code = system.exit_codes.get(name)
        main = system.cpu_main_thread.get(name) if name not in ("broker", "benchmark") else None
        table.add_row(name, f"{seconds:.2f}", "" if main is None else f"{main:.2f}", f"{seconds / system.elapsed:.2f}",
                      f"{1e6 * seconds / system.tasks:,.0f}", "" if code is None else str(code))
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--tasks", type=int, default=2000, help="orders to run (default 2000)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed tasks run first (default 20)")
    parser.add_argument("--raw-messages", type=int, default=None,
                        help="messages per raw-loop repetition (default 4 x tasks, the scheduler's inbox count)")
    parser.add_argument("--profile-scheduler", nargs="?", const=DEFAULT_PROFILE, type=Path, default=None,
                        metavar="PATH", help=f"run the scheduler under cProfile (default output {DEFAULT_PROFILE})")
    parser.add_argument("--keep-topics", action="store_true", help="do not delete the run's topics")
    parser.add_argument("--latency-ms", type=int, default=0, help="the order service's latency per call (default 0)")
    parser.add_argument("--concurrency", type=int, default=None,
                        help="calls in flight per agent process (default: STEPSTREAM_AGENT_CONCURRENCY or its default)")
    parser.add_argument("--system-only", action="store_true",
                        help="skip the raw loop and the scheduler alone: only the system run")
    args = parser.parse_args(argv)
    n: int = args.tasks
    if n < 1 or args.warmup < 0 or args.latency_ms < 0 or (args.concurrency is not None and args.concurrency < 1):
        parser.error("--tasks and --concurrency must be >= 1, --warmup and --latency-ms >= 0")
    raw_n: int = args.raw_messages or INBOX_PER_TASK * n

    settings = KafkaSettings()
    consumer_settings = ConsumerSettings()
    log_path = settings.home / "bench-workflow.log"
    console = Console(width=None if sys.stdout.isatty() else 160)
    configure_logging("WARNING")
    started = datetime.now(UTC)
    load_before = os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="stepstream-bench-workflow-"))
    profile: Path | None = args.profile_scheduler.resolve() if args.profile_scheduler else None
    if profile is not None:
        profile.unlink(missing_ok=True)

    with quiet_stderr(log_path) as terminal:
        progress = Console(file=terminal, stderr=True)

        def step(text: str) -> None:
            progress.print(f"[dim]{time.strftime('%H:%M:%S')}[/dim] {text}", highlight=False)

        bootstrap, broker, broker_pid = resolve_bootstrap(settings)
        prefix = f"bench-workflow-{started:%Y%m%d%H%M%S}-{uuid.uuid4().hex[:6]}."
        layout = TopicLayout(prefix, settings.partitions, settings.replication_factor)
        solo = TopicLayout(f"{prefix}solo.", settings.partitions, settings.replication_factor)
        topics = Topics(layout, solo, f"{prefix}raw-in", f"{prefix}raw-out")
        step(f"broker: {bootstrap} ({broker}); topics {prefix}* ({layout.partitions} partitions); folder {tmp}")
        create_topics(bootstrap, topics)
        codec = default_codec()
        raw_runs: list[LoopRun] = []
        raw: LoopRun | None = None
        alone: SoloRun | None = None
        try:
            if not args.system_only:
                keys, payloads = inbox_like_messages(codec, n)
                fill(bootstrap, topics.raw_in, keys, payloads, raw_n * RAW_REPEATS)
                step(f"raw loop: {raw_n:,} messages x {RAW_REPEATS} repetitions, "
                     f"~{sum(map(len, payloads)) / len(payloads):.0f} bytes each")
                for run in range(RAW_REPEATS):
                    gc.collect()
                    # Each repetition is a fresh consumer group: it reads from the start of the topic, which holds
                    # RAW_REPEATS x raw_n messages, and stops after raw_n of them.
                    raw_runs.append(raw_loop(bootstrap, topics, raw_n, consumer_settings, run, broker_pid))
                    step(f"raw loop {run + 1}: {raw_runs[-1].rate:,.0f} msgs/s")
                raw = sorted(raw_runs, key=lambda r: r.rate)[len(raw_runs) // 2]
                gc.collect()
                alone = run_scheduler_alone(bootstrap, solo, tmp / "solo", keys, payloads, n, codec, broker_pid, step)
                step(f"scheduler alone: {alone.rate:,.0f} inbox msgs/s, "
                     f"{1e6 * alone.cpu_seconds / alone.messages:,.0f} CPU µs each")
                del keys, payloads
                gc.collect()
            system = run_system(bootstrap, topics, tmp, n, args.warmup, [broker_pid] if broker_pid else [], codec,
                                profile, step, args.latency_ms, args.concurrency)
            step("replaying events for latencies")
            events = analyse_events(bootstrap, layout.events, first_calls(system.arrivals))
        finally:
            if not args.keep_topics:
                for error in delete_topics(bootstrap, topics.names):
                    step(f"[yellow]could not delete topic {error}[/yellow]")
        step("done")
    load_after = os.getloadavg()

    figures: dict[str, Any] = {
        **run_facts("workflow", started, bootstrap, broker, prefix, load_before, load_after),
        "partitions": layout.partitions,
        "tasks": n,
        "warmup_tasks": args.warmup,
        "latency_ms": args.latency_ms,
        "agent_concurrency": args.concurrency,
        "outcomes": system.outcomes,
        "tasks_completed": system.outcomes.get("TaskCompleted", 0),
        "tasks_failed": n - system.outcomes.get("TaskCompleted", 0),
        "submit_seconds": round(system.submit_seconds, 3),
        "elapsed_seconds": round(system.elapsed, 3),
        "tasks_per_s": round(system.tasks_per_s, 1),
        "steps_per_s": round(system.steps_per_s, 1),
        "steps_target": STEPS_TARGET,
        "steps_target_met": system.steps_per_s >= STEPS_TARGET,
        "succeeded_steps_per_s": round(events["event_counts"].get("StepSucceeded", 0) / system.elapsed, 1),
        "scheduler_inbox_msgs_per_s": round(system.inbox_per_s, 1),
        "inbox_messages_in_window": system.inbox_messages,
        "inbox_actual_msgs_per_s": round(system.inbox_messages / system.elapsed, 1),
        **events,
        "store_caught_up_after_s": system.store_lag_s,
        "consumer_lag": system.lag,
        "cpu_seconds": system.cpu,
        "cpu_seconds_main_thread": {k: v for k, v in system.cpu_main_thread.items()
                                    if k not in ("broker", "benchmark")},
        "scheduler_cpu_us_per_inbox_msg": (round(1e6 * system.cpu["scheduler"] / system.inbox_messages, 1)
                                           if "scheduler" in system.cpu and system.inbox_messages else None),
        "cpu_us_per_task": {k: round(1e6 * v / n, 1) for k, v in system.cpu.items()},
        "exit_codes": system.exit_codes,
        "scheduler_profiled": profile is not None,
        "logs": system.logs,
        "client_log": str(log_path),
    }
    if raw is not None and alone is not None:
        ratio = system.inbox_per_s / raw.rate
        figures |= {
            "inbox_actual_vs_raw_loop": round(system.inbox_messages / system.elapsed / raw.rate, 4),
            "raw_loop_messages": raw.messages,
            "raw_loop_msgs_per_s": round(raw.rate, 1),
            "raw_loop_repeats_msgs_per_s": [round(r.rate, 1) for r in raw_runs],
            "raw_loop_transactions": raw.transactions,
            "raw_loop_commit_seconds": round(raw.commit_seconds, 3),
            "raw_loop_seconds": round(raw.seconds, 3),
            "raw_loop_cpu_us_per_msg": round(1e6 * raw.cpu_seconds / raw.messages, 2),
            "raw_loop_broker_cpu_us_per_msg": (None if raw.broker_cpu_seconds is None
                                               else round(1e6 * raw.broker_cpu_seconds / raw.messages, 1)),
            "inbox_vs_raw_loop": round(ratio, 4),
            "scheduler_alone_messages": alone.messages,
            "scheduler_alone_seconds": round(alone.seconds, 3),
            "scheduler_alone_msgs_per_s": round(alone.rate, 1),
            "scheduler_alone_cpu_us_per_msg": round(1e6 * alone.cpu_seconds / alone.messages, 1),
            "scheduler_alone_main_thread_cpu_us_per_msg": round(
                1e6 * alone.main_thread_cpu_seconds / alone.messages, 1),
            "scheduler_alone_cores": round(alone.cpu_seconds / alone.seconds, 3),
            "scheduler_alone_broker_cpu_us_per_msg": (None if alone.broker_cpu_seconds is None
                                                      else round(1e6 * alone.broker_cpu_seconds / alone.messages, 1)),
            "scheduler_alone_vs_raw_loop": round(alone.rate / raw.rate, 4),
            "scheduler_alone_outcomes": alone.outcomes,
            "ratio_target": RATIO_TARGET,
            "ratio_target_met": ratio >= RATIO_TARGET,
            "scheduler_alone_exit_code": alone.exit_code,
        }
    console.print(results_table(system, raw, raw_runs, alone, events, layout.partitions, args.latency_ms))
    console.print(cpu_table(system))
    console.print(f"broker {bootstrap} ({broker}); {started:%Y-%m-%d %H:%M} UTC; {os.cpu_count()} CPUs; "
                  f"Python {platform.python_version()}; 1-minute load average {load_before[0]:.2f} before, "
                  f"{load_after[0]:.2f} after; exit codes: "
                  + ", ".join(f"{k} {v}" for k, v in system.exit_codes.items())
                  + ("" if alone is None else f", scheduler (alone) {alone.exit_code}")
                  + f"; service logs: {system.logs}; client logs: {log_path}", highlight=False)
    if profile is not None:
        if profile.exists():
            table, top = profile_table(profile)
            console.print(table)
            figures["profile"] = {"path": str(profile), **top}
        else:
            console.print(f"[yellow]no profile written to {profile}[/yellow]")

    sys.stdout.flush()
    sys.stdout.write(orjson.dumps(figures).decode() + "\n")
    return 0 if (alone is None or alone.exit_code == 0) and all(code == 0 for code in system.exit_codes.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
