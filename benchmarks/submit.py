"""The submission path: raw produce, ``Client.submit`` and ``POST /api/tasks``, measured in one run.

Run by hand from the project folder::

    .venv/bin/python -m benchmarks.submit [--tasks N] [--concurrency 1,4,16] [--keep-topics]

The broker is the one named by STEPSTREAM_BOOTSTRAP_SERVERS, else the project's local broker (started if
needed and left running). Every run uses fresh topics under a unique prefix (deleted at the end unless
``--keep-topics``) and a fresh temporary folder for the state store and the service logs (kept, for reading).

First the scheduler, the projector and ``stepstream serve api --port 0`` (with STEPSTREAM_API_TOKENS) start as
processes (``ServiceProcesses``) on the run's topics, with the "orders" workflow of ``demo.workflows``.
No agent runs and no supervisor: an admitted task waits on its first step's agent topic, so every task stays
in flight, and both bounds (STEPSTREAM_API_MAX_IN_FLIGHT and STEPSTREAM_SCHEDULER_MAX_IN_FLIGHT) are set far
above what a run submits. Then, with those processes up and idle, one after the other:

1. baseline A, on an inbox topic of its own (same partition count, nobody consuming it): the encoded bytes of
   the SubmitTask ``Client.submit`` would produce, with the project's producer configuration (idempotent,
   acks=all, lz4, ``linger.ms`` 5):
   - sequential: ``produce`` then ``flush`` per message (flush sends at once, whatever ``linger.ms``), so one
     message at a time, each acknowledged before the next;
   - pipelined: every message produced, then one ``flush`` (50 x N messages);
   - ref, sequential waiting for the delivery report by ``poll`` instead of ``flush``, as the API's
     ``TaskWriter`` waits: ``linger.ms`` then applies to every message;
2. ``Client.submit`` (stepstream.client) sequential, to the same topic (validation, encoding, produce, flush),
   alternating with baseline A sequential in blocks of 10 calls, so both see the same machine;
3. ``POST /api/tasks`` against the served API, for each concurrency level C: C threads, each with its own
   keep-alive ``httpx.Client``, N requests in all (after 2 untimed ones per thread); a 201 means the scheduler
   admitted the task (its TaskAccepted, read back by the API from ``events``). Every answer code is counted;
   anything but 201 is printed with its body. Baseline A sequential runs again (N messages) before each level;
4. baseline A and ``Client.submit`` again, as in 1 (without the ref), to show how far the machine drifted.

Reported: latency p50 / p99 / max per call, calls per second, the ratios to baseline A (latency p50 and rate,
pooled over every run of its kind), per HTTP level the CPU time per submission of the API, the scheduler, the
projector, the broker and this process (/proc), and where a 201's time goes: request start to the SubmitTask's record
timestamp on ``inbox`` (the API before producing), to the TaskAccepted's record timestamp on ``events`` (the
delivery, the scheduler consuming and deciding), to the answer (the scheduler's transaction commit, the API's
watcher reading ``events``, the HTTP answer). Also the state store's view of the submitted tasks, and the
API's own answer counter from ``/metrics``. Every process is stopped with SIGTERM and its exit code reported.

librdkafka and client logs go to a file under the project folder, progress to stderr; the last line of
stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import platform
import re
import sqlite3
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import orjson
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, Producer, TopicPartition
from rich.console import Console
from rich.table import Table

from benchmarks.shared import (
    create_fresh_topics,
    delete_topics,
    quiet_stderr,
    resolve_bootstrap,
    run_facts,
)
from benchmarks.workflow import machine_cpu_s, percentile, process_cpu_s
from eventstore.kafka_config import producer_config
from eventstore.logs import configure_logging
from eventstore.settings import KafkaSettings
from eventstore.topics import TopicLayout, TopicSpec
from schemas.codec import default_codec
from schemas.messages import SubmitTask, TaskAccepted
from stepstream.client import Client, build_submission
from stepstream.local.processes import ServiceProcesses, child_env

ROOT = Path(__file__).resolve().parent.parent

WORKFLOW, VERSION = "orders", 1
AGENTS = ("inventory", "payments", "shipping")  # their topics exist (the scheduler dispatches there); no agent runs
DEFAULT_TASKS = 200
DEFAULT_CONCURRENCY = "1,4,16"
PIPELINED_FACTOR = 50  # the pipelined baseline sends 50 x N messages: N alone lasts a few milliseconds
BLOCK = 10  # baseline A and Client.submit alternate in blocks of this many calls
WARMUP = 10  # untimed calls before each measured path (connections, metadata)
HTTP_WARMUP = 2  # per HTTP thread
BOUND = 1_000_000  # both admission bounds: far above any run
DOCUMENTED_CODES = (200, 201, 202, 401, 409, 422, 429, 503)


def order_input(task_id: str, i: int) -> dict[str, Any]:
    return {"order_id": task_id, "sku": f"SKU-{i % 50:03d}", "qty": 1 + i % 3, "amount": 10 + i % 90}


def submission(task_id: str, i: int) -> SubmitTask:
    """The command ``Client.submit`` and the API build for this order (no submitter)."""
    return build_submission(WORKFLOW, order_input(task_id, i), version=VERSION, task_id=task_id)


# -- measuring ------------------------------------------------------------------------------------


@dataclass
class Calls:
    """One measured path: a latency per call (ms), the wall-clock span, the answers."""

    name: str
    latencies_ms: list[float] = field(default_factory=list)
    seconds: float = 0.0
    messages: int = 0  # calls made (the pipelined baseline has no per-call latency)
    answers: Counter[str] = field(default_factory=Counter)
    odd: list[str] = field(default_factory=list)  # the first few answers other than the expected one
    cpu_us: dict[str, float] = field(default_factory=dict)  # per submission, per process (HTTP levels)
    breakdown_ms: dict[str, float] = field(default_factory=dict)  # medians of the 201's segments (HTTP levels)
    requests: list[tuple[str, float, float, int]] = field(default_factory=list)  # id, wall start, wall end, code

    @property
    def rate(self) -> float:
        return self.messages / self.seconds if self.seconds else float("nan")

    def p(self, q: float) -> float:
        return percentile(sorted(self.latencies_ms), q)

    def summary(self) -> dict[str, Any]:
        ordered = sorted(self.latencies_ms)
        return {"messages": self.messages, "seconds": round(self.seconds, 3), "per_s": round(self.rate, 1),
                "p50_ms": round(percentile(ordered, 50), 2), "p99_ms": round(percentile(ordered, 99), 2),
                "max_ms": round(ordered[-1], 2) if ordered else None, "answers": dict(self.answers),
                **({"cpu_us_per_submission": self.cpu_us} if self.cpu_us else {}),
                **({"breakdown_p50_ms": self.breakdown_ms} if self.breakdown_ms else {}),
                **({"odd_answers": self.odd} if self.odd else {})}

    def add(self, part: Calls) -> None:
        self.latencies_ms += part.latencies_ms
        self.seconds += part.seconds
        self.messages += part.messages
        self.answers += part.answers
        self.odd += part.odd


def pooled(name: str, runs: list[Calls]) -> Calls:
    total = Calls(name)
    for run in runs:
        total.add(run)
    return total


class RawProducer:
    """The project's producer configuration, with a delivery report for every message."""

    def __init__(self, bootstrap: str) -> None:
        self.producer = Producer(producer_config(bootstrap, **{"delivery.report.only.error": False}))
        self.failures: list[str] = []
        self.delivered = 0

    def _report(self, err: KafkaError | None, _msg: Any) -> None:
        if err is not None:
            self.failures.append(err.str())
        else:
            self.delivered += 1

    def produce(self, topic: str, key: str, value: bytes) -> None:
        while True:
            try:
                self.producer.produce(topic, value, key, on_delivery=self._report)
                return
            except BufferError:
                self.producer.poll(0.05)

    def sequential(self, name: str, topic: str, messages: list[tuple[str, bytes]], by_poll: bool = False) -> Calls:
        """One at a time: produce, then ``flush`` (or ``poll`` until the report) before the next."""
        calls = Calls(name)
        clock = time.perf_counter
        started = clock()
        for key, value in messages:
            before, failures = self.delivered, len(self.failures)
            t0 = clock()
            self.produce(topic, key, value)
            if by_poll:
                while self.delivered == before and len(self.failures) == failures:
                    self.producer.poll(0.1)
            else:
                self.producer.flush(30)
            calls.latencies_ms.append(1000 * (clock() - t0))
            calls.answers["delivered" if self.delivered > before else "failed"] += 1
        calls.seconds = clock() - started
        calls.messages = len(messages)
        return calls

    def pipelined(self, name: str, topic: str, messages: list[tuple[str, bytes]]) -> Calls:
        calls = Calls(name)
        before = self.delivered
        started = time.perf_counter()
        for key, value in messages:
            self.produce(topic, key, value)
        remaining = self.producer.flush(120)
        calls.seconds = time.perf_counter() - started
        calls.messages = len(messages)
        calls.answers["delivered"] = self.delivered - before
        if remaining or self.failures:
            calls.answers["failed"] = len(messages) - (self.delivered - before)
            calls.odd = self.failures[:5]
        return calls


def client_sequential(name: str, client: Client, ids: list[str]) -> Calls:
    calls = Calls(name)
    clock = time.perf_counter
    started = clock()
    for i, task_id in enumerate(ids):
        t0 = clock()
        client.submit(WORKFLOW, order_input(task_id, i), version=VERSION, task_id=task_id)
        calls.latencies_ms.append(1000 * (clock() - t0))
    calls.seconds = clock() - started
    calls.messages = len(ids)
    calls.answers["submitted"] = len(ids)
    return calls


def http_level(base_url: str, token: str, concurrency: int, ids: list[str], warmup_ids: list[list[str]]) -> Calls:
    """``concurrency`` threads, each with its own keep-alive client, share ``ids`` (thread t takes every
    ``concurrency``-th); each first sends its ``warmup_ids`` untimed. The clock runs from the barrier to the
    last answer."""
    calls = Calls(f"POST /api/tasks, {concurrency} client{'s' if concurrency > 1 else ''}")
    barrier = threading.Barrier(concurrency + 1)
    results: list[list[tuple[str, float, float, float, int, str]]] = [[] for _ in range(concurrency)]
    warm: Counter[str] = Counter()
    lock = threading.Lock()
    ends: list[float] = []

    def post(http: httpx.Client, task_id: str, i: int) -> tuple[int, str]:
        body = {"workflow": WORKFLOW, "version": VERSION, "input": order_input(task_id, i), "task_id": task_id}
        try:
            response = http.post("/api/tasks", json=body)
        except httpx.HTTPError as exc:
            return -1, f"{type(exc).__name__}: {exc}"
        return response.status_code, "" if response.status_code == 201 else response.text[:300]

    def worker(t: int) -> None:
        with httpx.Client(base_url=base_url, timeout=30, headers={"Authorization": f"Bearer {token}"}) as http:
            for j, task_id in enumerate(warmup_ids[t]):
                code, _ = post(http, task_id, j)
                with lock:
                    warm[str(code)] += 1
            barrier.wait()
            out = results[t]
            for k in range(t, len(ids), concurrency):
                wall0, t0 = time.time(), time.perf_counter()
                code, text = post(http, ids[k], k)
                t1 = time.perf_counter()
                out.append((ids[k], wall0, time.time(), 1000 * (t1 - t0), code, text))
            with lock:
                ends.append(time.perf_counter())

    threads = [threading.Thread(target=worker, args=(t,), name=f"http-{t}", daemon=True) for t in range(concurrency)]
    for thread in threads:
        thread.start()
    barrier.wait()
    started = time.perf_counter()
    for thread in threads:
        thread.join()
    calls.seconds = max(ends) - started
    calls.messages = len(ids)
    for task_id, wall0, wall1, ms, code, text in (r for out in results for r in out):
        calls.answers[str(code)] += 1
        calls.requests.append((task_id, wall0, wall1, code))
        if code == 201:
            calls.latencies_ms.append(ms)
        elif len(calls.odd) < 10:
            calls.odd.append(f"{task_id}: {code} after {ms:.0f} ms: {text}")
    if set(warm) != {"201"}:
        calls.odd.append(f"warm-up answers: {dict(warm)}")
    return calls


# -- services -------------------------------------------------------------------------------------


def service_env(bootstrap: str, layout: TopicLayout, folder: Path, token: str) -> dict[str, str]:
    env = child_env(STEPSTREAM_BOOTSTRAP_SERVERS=bootstrap, STEPSTREAM_TOPIC_PREFIX=layout.prefix,
                    STEPSTREAM_PARTITIONS=str(layout.partitions), STEPSTREAM_HOME=str(folder),
                    STEPSTREAM_STORE_PATH=str(folder / "state.db"),
                    STEPSTREAM_SCHEDULER_WORKFLOWS="demo.workflows:REGISTRY",
                    STEPSTREAM_SCHEDULER_MAX_IN_FLIGHT=str(BOUND), STEPSTREAM_API_MAX_IN_FLIGHT=str(BOUND),
                    STEPSTREAM_API_TOKENS=orjson.dumps({"bench": token}).decode(), STEPSTREAM_LOG_JSON="true")
    for inherited in ("STEPSTREAM_METRICS_PORT", "STEPSTREAM_SCHEDULER_INSTANCE", "STEPSTREAM_STORE_URL"):
        env.pop(inherited, None)  # no fixed port or transactional id; the store is this run's SQLite file
    return env


def start_services(procs: ServiceProcesses, partitions: int) -> str:
    """Scheduler, projector and API; returns the API's address once every consumer owns its partitions."""
    procs.service("scheduler", "scheduler")
    procs.service("projector", "projector")
    procs.start("api", "stepstream", "serve", "api", "--port", "0")
    procs.wait_started("scheduler")
    procs.wait_started("projector")
    procs.wait_started("scheduler", "partition restored", count=partitions, timeout_s=90.0)
    procs.wait_started("projector", "partitions assigned", timeout_s=90.0)
    deadline = time.monotonic() + 60
    while not (found := re.findall(r"api listening on (http://\S+)", procs.log("api"))):
        if not procs.alive("api") or time.monotonic() > deadline:
            raise RuntimeError(f"the API did not start:\n{procs.log('api')[-3000:]}")
        time.sleep(0.05)
    return str(found[0])


def cpu_snapshot(pids: dict[str, int | None]) -> dict[str, float | None]:
    return {"machine": machine_cpu_s(), **{name: process_cpu_s(pid) for name, pid in pids.items()}}


def cpu_per_call(before: dict[str, float | None], after: dict[str, float | None], calls: int) -> dict[str, float]:
    used = {name: b - a for name, a in before.items() if a is not None and (b := after.get(name)) is not None}
    used["other"] = used["machine"] - sum(v for k, v in used.items() if k != "machine")
    return {name: round(1e6 * seconds / calls) for name, seconds in used.items()}


# -- after the run --------------------------------------------------------------------------------


def record_times(bootstrap: str, topic: str, partitions: int, wanted: type[Any]) -> dict[str, float]:
    """Task id -> record timestamp (s) of the first ``wanted`` message on ``topic``, read to its end now."""
    codec = default_codec()
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"bench-submit-read-{uuid.uuid4().hex}",
                         "enable.auto.commit": False, "isolation.level": "read_committed",
                         "enable.partition.eof": True})
    out: dict[str, float] = {}
    try:
        ends = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1] for p in range(partitions)}
        pending = {p for p, end in ends.items() if end > 0}
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in pending])
        deadline = time.monotonic() + 60
        while pending and time.monotonic() < deadline:
            for msg in consumer.consume(1000, 0.5):
                if msg.error() is not None:
                    if msg.error().code() == KafkaError._PARTITION_EOF:
                        pending.discard(msg.partition())
                    continue
                message = codec.decode(msg.value())
                if isinstance(message, wanted) and message.task_id not in out:
                    out[message.task_id] = msg.timestamp()[1] / 1000
                if msg.offset() + 1 >= ends[msg.partition()]:
                    pending.discard(msg.partition())
    finally:
        consumer.close()
    return out


def breakdown(calls: Calls, submitted: dict[str, float], accepted: dict[str, float]) -> dict[str, float]:
    """Medians (ms) of a 201's segments: before producing, until the TaskAccepted, until the answer."""
    api, scheduler, answer = [], [], []
    for task_id, wall0, wall1, code in calls.requests:
        if code == 201 and task_id in submitted and task_id in accepted:
            api.append(1000 * (submitted[task_id] - wall0))
            scheduler.append(1000 * (accepted[task_id] - submitted[task_id]))
            answer.append(1000 * (wall1 - accepted[task_id]))
    if not api:
        return {}
    return {"api_before_produce": round(percentile(sorted(api), 50), 1),
            "produce_to_task_accepted": round(percentile(sorted(scheduler), 50), 1),
            "task_accepted_to_answer": round(percentile(sorted(answer), 50), 1),
            "task_accepted_to_answer_p90": round(percentile(sorted(answer), 90), 1),
            "matched": len(api)}


def store_statuses(path: Path, prefixes: tuple[str, ...], expected: int, timeout_s: float = 60.0) -> dict[str, int]:
    """Statuses in the state store of the tasks whose ids start with ``prefixes``, once it holds ``expected``
    of them (or at the timeout)."""
    deadline = time.monotonic() + timeout_s
    counts: dict[str, int] = {}
    where = " or ".join("task_id like ?" for _ in prefixes)
    while time.monotonic() < deadline:
        with contextlib.suppress(sqlite3.OperationalError), \
                contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)) as db:
            rows = db.execute(f"select status, count(*) from tasks where {where} group by status",
                              [f"{p}%" for p in prefixes]).fetchall()
            counts = {str(status): int(n) for status, n in rows}
        if sum(counts.values()) >= expected:
            break
        time.sleep(0.5)
    return counts


def api_answer_counter(base_url: str) -> dict[str, float]:
    try:
        text = httpx.get(f"{base_url}/metrics", timeout=10).text
    except httpx.HTTPError as exc:
        return {"error": float("nan"), f"{type(exc).__name__}": float("nan")}
    found = re.findall(r'^stepstream_api_writes_total\{answer="(\d+)",endpoint="submit"\} (\S+)$', text, re.M)
    return {answer: float(value) for answer, value in found}


def logged_answers(log: str) -> dict[str, int]:
    """The answer codes of the API's "submission answered" log lines."""
    codes: Counter[str] = Counter()
    for line in log.splitlines():
        if line.startswith("{") and "submission answered" in line:
            with contextlib.suppress(orjson.JSONDecodeError):
                codes[str(orjson.loads(line).get("status"))] += 1
    return dict(codes)


# -- report ---------------------------------------------------------------------------------------


def results_table(rounds: list[list[Calls]], http: list[Calls], base_seq: Calls, base_pipe: Calls,
                  title: str) -> Table:
    table = Table(title=title, title_justify="left", caption=(
        "latency ratio: p50 ÷ baseline A sequential p50; rate ratios: calls/s ÷ baseline A sequential, ÷ pipelined "
        "(pooled: every run of its kind); HTTP latencies are of 201 answers"), caption_justify="left")
    for column in ("path", "n", "p50 ms", "p99 ms", "max ms", "per s", "p50 ÷ A", "rate ÷ A seq",
                   "rate ÷ A pipe", "answers"):
        table.add_column(column, justify="left" if column in ("path", "answers") else "right")

    def row(calls: Calls, tag: str = "") -> None:
        has_latency = bool(calls.latencies_ms)
        table.add_row(
            calls.name + tag, f"{calls.messages:,}",
            f"{calls.p(50):.2f}" if has_latency else "", f"{calls.p(99):.2f}" if has_latency else "",
            f"{max(calls.latencies_ms):.1f}" if has_latency else "", f"{calls.rate:,.0f}",
            f"{calls.p(50) / base_seq.p(50):.1f}x" if has_latency else "",
            f"{calls.rate / base_seq.rate:.3f}", f"{calls.rate / base_pipe.rate:.4f}",
            ", ".join(f"{k} {v:,}" for k, v in sorted(calls.answers.items())))

    for label, runs in zip(("start", "between", "end"), rounds, strict=False):
        for calls in runs:
            row(calls, f" ({label})" if label != "between" else "")
    row(base_seq, " (pooled)")
    for calls in http:
        row(calls)
    return table


def http_table(http: list[Calls]) -> Table:
    table = Table(title="Where a 201's time goes (medians, ms; Kafka record timestamps have ms resolution) and CPU "
                        "per submission (µs, /proc)", title_justify="left", caption=(
        "before produce: request start -> SubmitTask record timestamp on inbox (HTTP, FastAPI, validation, store "
        "look-up, admission); to TaskAccepted: -> its record timestamp on events (linger + acks, the scheduler "
        "fetching, deciding); to answer: -> the answer received (the rest of the scheduler's batch, its "
        "transaction commit, the API watcher's read of events, the HTTP answer)"), caption_justify="left")
    names = sorted({k for c in http for k in c.cpu_us if k != "machine"} - {"other"})
    for column in ("clients", "before produce", "to TaskAccepted", "to answer", "to answer p90",
                   *[f"CPU {n}" for n in names], "CPU other", "CPU machine"):
        table.add_column(column, justify="right")
    for calls in http:
        b = calls.breakdown_ms
        table.add_row(calls.name.rsplit(", ", 1)[-1], *(f"{b[k]:.1f}" if k in b else "" for k in (
            "api_before_produce", "produce_to_task_accepted", "task_accepted_to_answer",
            "task_accepted_to_answer_p90")), *(f"{calls.cpu_us.get(n, 0):,.0f}" for n in (*names, "other", "machine")))
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--tasks", type=int, default=DEFAULT_TASKS,
                        help=f"submissions per measured path and per HTTP level (default {DEFAULT_TASKS}); the "
                             f"pipelined baseline sends {PIPELINED_FACTOR} x N")
    parser.add_argument("--concurrency", default=DEFAULT_CONCURRENCY,
                        help=f"HTTP client threads per level, comma-separated (default {DEFAULT_CONCURRENCY})")
    parser.add_argument("--keep-topics", action="store_true", help="do not delete the run's topics")
    args = parser.parse_args(argv)
    n: int = args.tasks
    try:
        levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        parser.error("--concurrency: comma-separated integers")
    if n < 1 or not levels or min(levels) < 1:
        parser.error("--tasks and every --concurrency level must be >= 1")

    settings = KafkaSettings()
    log_path = settings.home / "bench-submit.log"
    console = Console(width=None if sys.stdout.isatty() else 200)
    configure_logging("WARNING")
    started = datetime.now(UTC)
    load_before = os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="stepstream-bench-submit-"))
    token = uuid.uuid4().hex

    with quiet_stderr(log_path) as terminal:
        progress = Console(file=terminal, stderr=True)

        def step(text: str) -> None:
            progress.print(f"[dim]{time.strftime('%H:%M:%S')}[/dim] {text}", highlight=False)

        bootstrap, broker, broker_pid = resolve_bootstrap(settings)
        prefix = f"bench-submit-{started:%Y%m%d%H%M%S}-{uuid.uuid4().hex[:6]}."
        layout = TopicLayout(prefix, settings.partitions, settings.replication_factor)
        raw = TopicLayout(f"{prefix}raw.", settings.partitions, settings.replication_factor)
        specs = [*layout.core_specs(), *(layout.agent_spec(a) for a in AGENTS), TopicSpec(raw.inbox, raw.partitions)]
        step(f"broker: {bootstrap} ({broker}); topics {prefix}* ({layout.partitions} partitions); folder {tmp}")
        create_fresh_topics(bootstrap, specs, layout.replication_factor)
        procs = ServiceProcesses(service_env(bootstrap, layout, tmp, token), tmp / "logs", cwd=ROOT)
        exit_codes: dict[str, int] = {}
        codec = default_codec()
        rounds: list[list[Calls]] = []
        http: list[Calls] = []
        extra: dict[str, Any] = {}
        try:
            base_url = start_services(procs, layout.partitions)
            step(f"scheduler, projector and API up ({base_url}); logs in {tmp / 'logs'}")
            producer = RawProducer(bootstrap)
            client = Client(kafka=KafkaSettings(bootstrap_servers=bootstrap, topic_prefix=raw.prefix,
                                                partitions=raw.partitions))

            def encoded(tag: str, count: int) -> list[tuple[str, bytes]]:
                return [(f"{tag}{i:06d}", codec.encode(submission(f"{tag}{i:06d}", i))) for i in range(count)]

            def baseline_round(r: int, with_reference: bool) -> list[Calls]:
                producer.sequential("warm-up", raw.inbox, encoded(f"aw{r}-", WARMUP))
                client_sequential("warm-up", client, [f"cw{r}-{i:06d}" for i in range(WARMUP)])
                gc.collect()
                # Baseline A and Client.submit alternate in blocks, so both see the same machine.
                seq, sub = Calls("A: raw produce + flush, sequential"), Calls("Client.submit, sequential")
                messages, ids = encoded(f"a{r}-", n), [f"c{r}-{i:06d}" for i in range(n)]
                for start in range(0, n, BLOCK):
                    seq.add(producer.sequential(seq.name, raw.inbox, messages[start:start + BLOCK]))
                    sub.add(client_sequential(sub.name, client, ids[start:start + BLOCK]))
                runs = [seq, sub]
                step(f"round {r}: baseline A sequential {seq.rate:,.0f}/s, p50 {seq.p(50):.2f} ms; "
                     f"Client.submit {sub.rate:,.0f}/s, p50 {sub.p(50):.2f} ms")
                if with_reference:
                    runs.append(producer.sequential("ref: raw produce, poll for the report", raw.inbox,
                                                    encoded(f"ar{r}-", n), by_poll=True))
                    step(f"round {r}: raw produce waiting by poll {runs[-1].rate:,.0f}/s")
                gc.collect()
                runs.append(producer.pipelined("A: raw produce, pipelined", raw.inbox,
                                               encoded(f"ap{r}-", PIPELINED_FACTOR * n)))
                step(f"round {r}: baseline A pipelined {runs[-1].rate:,.0f}/s")
                return runs

            rounds.append(baseline_round(1, with_reference=True))
            pids: dict[str, int | None] = {name: proc.pid for name, proc in procs.procs.items()}
            pids |= {"broker": broker_pid, "benchmark": os.getpid()}
            between = Calls("A: raw produce + flush, sequential, before each HTTP level")
            for c in levels:
                ids = [f"h{c}-{i:06d}" for i in range(n)]
                warmup = [[f"hw{c}-{t}-{j}" for j in range(HTTP_WARMUP)] for t in range(c)]
                gc.collect()
                between.add(producer.sequential(between.name, raw.inbox, encoded(f"ab{c}-", n)))
                before = cpu_snapshot(pids)
                calls = http_level(base_url, token, c, ids, warmup)
                calls.cpu_us = cpu_per_call(before, cpu_snapshot(pids), n)
                http.append(calls)
                step(f"HTTP, {c} clients: {calls.rate:,.0f}/s, 201 p50 {calls.p(50):.1f} ms; answers "
                     f"{dict(calls.answers)}")
                for line in calls.odd:
                    step(f"[yellow]  {line}[/yellow]")
            rounds.append(baseline_round(2, with_reference=False))
            rounds.insert(1, [between])
            client.close()

            step("reading inbox and events back for the breakdown; waiting for the state store")
            submitted = record_times(bootstrap, layout.inbox, layout.partitions, SubmitTask)
            accepted = record_times(bootstrap, layout.events, layout.partitions, TaskAccepted)
            for calls in http:
                calls.breakdown_ms = breakdown(calls, submitted, accepted)
            http_total = n * len(levels) + HTTP_WARMUP * sum(levels)
            extra["store_statuses"] = store_statuses(tmp / "state.db", ("h",), http_total)
            extra["submit_tasks_on_inbox"] = len(submitted)
            extra["task_accepted_on_events"] = len(accepted)
            extra["http_submissions"] = http_total
            extra["api_answer_counter"] = api_answer_counter(base_url)
            extra["api_log_answers"] = logged_answers(procs.log("api"))
        finally:
            step("stopping every service with SIGTERM")
            exit_codes = procs.terminate_all()
            if not args.keep_topics:
                for error in delete_topics(bootstrap, [spec.name for spec in specs]):
                    step(f"[yellow]could not delete topic {error}[/yellow]")
        step("done")
    load_after = os.getloadavg()

    base_seq = pooled("A: raw produce + flush, sequential", [r for rs in rounds for r in rs
                                                              if r.name.startswith("A: raw produce + flush")])
    base_pipe = pooled("A: raw produce, pipelined", [r for rs in rounds for r in rs
                                                     if r.name.startswith("A: raw produce, pipelined")])
    client_all = pooled("Client.submit, sequential", [r for rs in rounds for r in rs
                                                      if r.name.startswith("Client.submit")])
    console.print(results_table(rounds, http, base_seq, base_pipe,
                                f"Submission path: N = {n:,} per path and HTTP level, {layout.partitions} partitions, "
                                f"workflow {WORKFLOW} v{VERSION}, scheduler + projector + API running, no agents"))
    console.print(http_table(http))
    codes_seen = Counter[str]()
    for calls in http:
        codes_seen.update(calls.answers)
    not_201 = {k: v for k, v in codes_seen.items() if k != "201"}
    console.print(f"HTTP answers: {dict(codes_seen)}" + (f"; [red]NOT 201: {not_201}[/red]" if not_201 else
                                                         " (all 201)"))
    for calls in http:
        for line in calls.odd:
            console.print(f"  [yellow]{calls.name}: {line}[/yellow]", highlight=False)
    console.print(f"state store, HTTP tasks by status: {extra.get('store_statuses')} "
                  f"(of {extra.get('http_submissions')} submitted); SubmitTasks on inbox "
                  f"{extra.get('submit_tasks_on_inbox')}, TaskAccepted on events "
                  f"{extra.get('task_accepted_on_events')}; the API's stepstream_api_writes_total{{submit}}: "
                  f"{extra.get('api_answer_counter')}, its log: {extra.get('api_log_answers')}", highlight=False)
    console.print(f"broker {bootstrap} ({broker}); {started:%Y-%m-%d %H:%M} UTC; {os.cpu_count()} CPUs; Python "
                  f"{platform.python_version()}; 1-minute load average {load_before[0]:.2f} before, "
                  f"{load_after[0]:.2f} after; exit codes: {', '.join(f'{k} {v}' for k, v in exit_codes.items())}; "
                  f"service logs: {tmp / 'logs'}; client logs: {log_path}", highlight=False)

    figures: dict[str, Any] = {
        **run_facts("submit", started, bootstrap, broker, prefix, load_before, load_after),
        "partitions": layout.partitions,
        "tasks": n,
        "concurrency": levels,
        "rounds": dict(zip(("start", "between", "end"),
                           ({calls.name: calls.summary() for calls in runs} for runs in rounds), strict=False)),
        "baseline_sequential_pooled": base_seq.summary(),
        "baseline_pipelined_pooled": base_pipe.summary(),
        "client_submit_pooled": client_all.summary(),
        "client_submit_vs_baseline": {"p50": round(client_all.p(50) / base_seq.p(50), 3),
                                      "rate": round(client_all.rate / base_seq.rate, 3)},
        "http": {str(calls.name.rsplit(", ", 1)[-1]): {
            **calls.summary(), "vs_baseline": {"p50": round(calls.p(50) / base_seq.p(50), 2),
                                               "rate_vs_sequential": round(calls.rate / base_seq.rate, 4),
                                               "rate_vs_pipelined": round(calls.rate / base_pipe.rate, 5)}}
            for calls in http},
        "http_answers": dict(codes_seen),
        "all_201": not not_201,
        **extra,
        "exit_codes": exit_codes,
        "logs": str(tmp / "logs"),
        "client_log": str(log_path),
    }
    sys.stdout.flush()
    sys.stdout.write(orjson.dumps(figures).decode() + "\n")
    return 0 if not not_201 and all(code == 0 for code in exit_codes.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
