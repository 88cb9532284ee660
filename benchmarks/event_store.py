"""Throughput of the event store against raw confluent-kafka, in one run against one broker.

Run by hand from the project folder::

    .venv/bin/python -m benchmarks.event_store [--messages N] [--profile]

The broker is the one named by STEPSTREAM_BOOTSTRAP_SERVERS, else the project's local broker (started
if needed and left running). Every run writes to fresh topics (3 partitions) under a unique prefix and
measures, on the same small messages (encoded StepStarted / OperatorAlert events keyed by task id):

1. raw confluent-kafka produce of pre-encoded bytes (producer_config settings), until flushed;
2. EventProducer.send of model instances (encode + produce), until flushed; ratio to 1;
3. raw confluent-kafka consume (batches of 500, read_committed, from the beginning), first record to last;
4. ConsumerRuntime with a counting handler (fresh group), first record to last; ratio to 3 (target >= 0.5);
5. ReplayReader over the same topic, first record to last; ratio to 3.

Stages 1 and 3 take well under a second, so each runs 3 times and the median counts. Besides wall-clock
rates, every stage reports the CPU time per message of the Python thread that ran it, which the load of
other processes on the machine inflates far less. Codec encode-only and decode-only rates (no Kafka), and
the serial ceiling of "raw consume, then decode" are printed as references. ``--profile`` adds a cProfile
pass of stage 4 (fresh group, not timed) and prints its top costs. librdkafka and service logs go to a
file under the project folder, progress to stderr; the last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import os
import platform
import pstats
import random
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
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
from eventstore.kafka_config import producer_config
from eventstore.logs import configure_logging
from eventstore.producer import EventProducer
from eventstore.replay import ReplayReader
from eventstore.runtime import ConsumerRuntime, Record
from eventstore.settings import KafkaSettings
from eventstore.topics import FOREVER, TopicSpec
from schemas.codec import Codec, default_codec
from schemas.messages import Event, OperatorAlert, StepStarted, now

ROOT = Path(__file__).resolve().parent.parent

PARTITIONS = 3
CONSUME_BATCH = 500
RAW_REPEATS = 3  # the raw stages take well under a second: their median of 3 is less at the mercy of noise
RUNTIME_TARGET = 0.5
STALL_TIMEOUT_S = 60.0
STALL_NOTE_S = 0.1  # a pause between two records longer than this is shown next to the stage's figures
STEPS = ("reserve-stock", "charge-card", "ship-parcel", "send-invoice")
WORKFLOW = "order-fulfilment"


@dataclass(frozen=True)
class Stamp:
    """Wall-clock time, and CPU time of the calling thread (what other processes' load does not inflate)."""

    wall: float
    cpu: float

    @classmethod
    def now(cls) -> Stamp:
        return cls(time.perf_counter(), time.thread_time())


@dataclass(frozen=True)
class Measurement:
    messages: int
    seconds: float
    cpu_seconds: float  # of the thread that ran the stage's Python code
    longest_gap_s: float | None = None  # longest pause between two consecutive records, where measured
    repeats: tuple[float, ...] = ()  # msgs/s of every repetition, for stages run several times

    @classmethod
    def between(cls, messages: int, start: Stamp, end: Stamp, longest_gap_s: float | None = None) -> Measurement:
        return cls(messages, end.wall - start.wall, end.cpu - start.cpu, longest_gap_s)

    @property
    def rate(self) -> float:
        return self.messages / self.seconds if self.seconds > 0 else float("nan")

    @property
    def cpu_us_per_message(self) -> float:
        return 1e6 * self.cpu_seconds / self.messages


def median_run(runs: list[Measurement]) -> Measurement:
    """The run with the median rate, carrying the rates of all runs."""
    chosen = sorted(runs, key=lambda r: r.rate)[len(runs) // 2]
    return Measurement(chosen.messages, chosen.seconds, chosen.cpu_seconds, chosen.longest_gap_s,
                       tuple(r.rate for r in runs))


@dataclass(frozen=True)
class Workload:
    messages: list[Event]
    keys: list[str]
    payloads: list[bytes]
    encode: Measurement

    @property
    def average_bytes(self) -> float:
        return sum(map(len, self.payloads)) / len(self.payloads)


# -- set-up ---------------------------------------------------------------------------------------


def make_workload(n: int, tasks: int, codec: Codec, seed: int = 7) -> Workload:
    """``n`` events over ``tasks`` task ids: 3 StepStarted to 1 OperatorAlert, sequences per task."""
    rng = random.Random(seed)
    started_at = now()
    deadline = started_at + timedelta(minutes=15)
    sequences: dict[str, int] = {}
    messages: list[Event] = []

    def hex_id() -> str:
        return f"{rng.getrandbits(128):032x}"

    for i in range(n):
        task_id = f"task-{rng.randrange(tasks):06d}"
        sequence = sequences[task_id] = sequences.get(task_id, 0) + 1
        common: dict[str, Any] = {
            "message_id": hex_id(), "task_id": task_id, "occurred_at": started_at, "sequence": sequence,
            "workflow": WORKFLOW, "workflow_version": 3, "causation_id": hex_id(),
        }
        step_index = rng.randrange(len(STEPS))
        if i % 4 == 3:
            messages.append(OperatorAlert(reason=f"step {STEPS[step_index]} exhausted its call budget",
                                          step=STEPS[step_index], **common))
        else:
            messages.append(StepStarted(step=STEPS[step_index], step_index=step_index,
                                        attempt=rng.randrange(1, 4), attempt_id=hex_id(),
                                        complete_by=deadline, calls_allowed=rng.randrange(10), **common))
    start = Stamp.now()
    payloads = [codec.encode(m) for m in messages]
    encode = Measurement.between(n, start, Stamp.now())
    return Workload(messages, [m.task_id for m in messages], payloads, encode)


@dataclass(frozen=True)
class Topics:
    raw: str  # written by the raw producer (stage 1)
    events: str  # written by EventProducer (stage 2), read by stages 3 to 5
    dlq: str  # the runtime's dead letters (stays empty)
    warmup: str  # each producer connects and gets its producer id here before it is timed

    @property
    def names(self) -> list[str]:
        return [self.raw, self.events, self.dlq, self.warmup]


def create_topics(bootstrap: str, prefix: str) -> Topics:
    """Fresh topics under ``prefix``, returned once the broker reports a leader for every partition."""
    event_store = {"cleanup.policy": "delete", "retention.ms": FOREVER, "retention.bytes": FOREVER}
    topics = Topics(f"{prefix}raw", f"{prefix}events", f"{prefix}dlq", f"{prefix}warmup")
    specs = [TopicSpec(topics.raw, PARTITIONS, event_store), TopicSpec(topics.events, PARTITIONS, event_store),
             TopicSpec(topics.dlq, PARTITIONS, {"retention.ms": FOREVER}), TopicSpec(topics.warmup, 1)]
    create_fresh_topics(bootstrap, specs)
    return topics


# -- the five stages ------------------------------------------------------------------------------


def warm_up(producer: Producer, topic: str) -> None:
    """Connect, get the idempotent producer id and the broker's attention before the clock starts."""
    for i in range(10):
        producer.produce(topic, b"warm-up", f"warm-up-{i}")
    if producer.flush(30):
        raise RuntimeError("the warm-up messages were not delivered")


def raw_produce(bootstrap: str, topics: Topics, work: Workload, repeats: int) -> Measurement:
    """``repeats`` rounds of all the messages into the raw topic, with one (warmed-up) producer."""
    producer = Producer(producer_config(bootstrap))
    warm_up(producer, topics.warmup)
    topic = topics.raw
    produce, poll = producer.produce, producer.poll
    runs = []
    for _round in range(repeats):
        gc.collect()
        start = Stamp.now()
        for key, value in zip(work.keys, work.payloads, strict=True):
            while True:
                try:
                    produce(topic, value, key)
                    break
                except BufferError:
                    poll(0.1)
        remaining = producer.flush(120)
        end = Stamp.now()
        if remaining:
            raise RuntimeError(f"raw producer: {remaining} messages not delivered")
        runs.append(Measurement.between(len(work.payloads), start, end))
    return median_run(runs)


def event_store_produce(bootstrap: str, topics: Topics, work: Workload) -> Measurement:
    producer = EventProducer(bootstrap)
    warm_up(producer.raw, topics.warmup)
    topic = topics.events
    send = producer.send
    start = Stamp.now()
    for message in work.messages:
        send(topic, message)
    producer.flush(120)
    return Measurement.between(len(work.messages), start, Stamp.now())


def raw_consume_once(bootstrap: str, topic: str, n: int) -> Measurement:
    consumer = Consumer({
        "bootstrap.servers": bootstrap,
        "group.id": f"bench-raw-{uuid.uuid4().hex}",
        "enable.auto.commit": False,
        "auto.offset.reset": "earliest",
        "isolation.level": "read_committed",
    })
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(PARTITIONS)])
    count = 0
    first = last = Stamp(0.0, 0.0)
    idle_since = time.monotonic()
    try:
        while count < n:
            # Never ask for more than is left: consume() waits out its timeout for a batch to fill.
            batch = consumer.consume(min(CONSUME_BATCH, n - count), 1.0)
            if not batch:
                if time.monotonic() - idle_since > STALL_TIMEOUT_S:
                    raise RuntimeError(f"raw consumer stalled at {count}/{n}")
                continue
            if count == 0:
                first = Stamp.now()
            for msg in batch:
                if msg.error() is None:
                    msg.value()
                    count += 1
                elif msg.error().code() != KafkaError._PARTITION_EOF:
                    raise RuntimeError(f"raw consumer: {msg.error()}")
            last = Stamp.now()
            idle_since = time.monotonic()
    finally:
        consumer.close()
    return Measurement.between(count, first, last)


def raw_consume(bootstrap: str, topic: str, n: int, repeats: int) -> Measurement:
    runs = []
    for _round in range(repeats):
        gc.collect()
        runs.append(raw_consume_once(bootstrap, topic, n))
    return median_run(runs)


class _CountingHandler:
    """Counts records; stops the runtime at the target and notes when the first and last arrived."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.count = 0
        self.first = 0.0
        self.last = 0.0
        self.first_cpu = 0.0
        self.longest_gap = 0.0
        self.end = Stamp(0.0, 0.0)
        self.runtime: ConsumerRuntime | None = None

    def __call__(self, record: Record, output: EventProducer) -> None:
        now = time.perf_counter()
        self.count += 1
        if self.count == 1:
            self.first, self.first_cpu = now, time.thread_time()
        elif now - self.last > self.longest_gap:
            self.longest_gap = now - self.last
        self.last = now
        if self.count >= self.target:
            self.end = Stamp(now, time.thread_time())
            assert self.runtime is not None
            self.runtime.stop()


def runtime_consume(bootstrap: str, topic: str, dlq: str, n: int,
                    profiler: cProfile.Profile | None = None) -> Measurement:
    handler = _CountingHandler(n)
    runtime = ConsumerRuntime(bootstrap=bootstrap, group_id=f"bench-runtime-{uuid.uuid4().hex}",
                              topics=[topic], handler=handler, dlq_topic=dlq)
    handler.runtime = runtime
    failure: list[BaseException] = []

    def run() -> None:
        if profiler is not None:
            profiler.enable()  # profiles this thread only
        try:
            runtime.run()
        except BaseException as exc:  # re-raised in the main thread
            failure.append(exc)
        finally:
            if profiler is not None:
                profiler.disable()

    thread = threading.Thread(target=run, name="bench-runtime", daemon=True)
    thread.start()
    seen, seen_at = 0, time.monotonic()
    while thread.is_alive():
        thread.join(0.5)
        if handler.count != seen:
            seen, seen_at = handler.count, time.monotonic()
        elif time.monotonic() - seen_at > STALL_TIMEOUT_S:
            runtime.stop()
            thread.join(30)
            raise RuntimeError(f"consumer runtime stalled at {handler.count}/{n} (see the DLQ {dlq})")
    if failure:
        raise failure[0]
    if handler.count != n:
        raise RuntimeError(f"consumer runtime stopped at {handler.count}/{n}")
    return Measurement.between(handler.count, Stamp(handler.first, handler.first_cpu), handler.end,
                               handler.longest_gap)


def replay(bootstrap: str, topic: str, n: int) -> Measurement:
    reader = ReplayReader(bootstrap, topic)
    count, first, first_cpu, last, longest_gap = 0, 0.0, 0.0, 0.0, 0.0
    for _record in reader:
        now = time.perf_counter()
        count += 1
        if count == 1:
            first, first_cpu = now, time.thread_time()
        elif now - last > longest_gap:
            longest_gap = now - last
        last = now
    end = Stamp(last, time.thread_time())
    if count != n or reader.stats.undecodable:
        raise RuntimeError(f"replay read {count}/{n} ({reader.stats.undecodable} undecodable)")
    return Measurement.between(count, Stamp(first, first_cpu), end, longest_gap)


def decode_only(codec: Codec, payloads: list[bytes]) -> Measurement:
    decode = codec.decode
    start = Stamp.now()
    for payload in payloads:
        decode(payload)
    return Measurement.between(len(payloads), start, Stamp.now())


# -- output ---------------------------------------------------------------------------------------


def profile_rows(profiler: cProfile.Profile, top: int) -> tuple[float, list[tuple[str, int, float, float]]]:
    """(total seconds, [(function, calls, own seconds, cumulative seconds)]) by own time."""
    stats = pstats.Stats(profiler, stream=io.StringIO())
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    rows = []
    for (filename, line, name), (_cc, calls, tottime, cumtime, _callers) in raw.items():
        where = name if filename == "~" else f"{short_filename(filename, ROOT)}:{line}({name})"
        rows.append((where, calls, tottime, cumtime))
    rows.sort(key=lambda r: r[2], reverse=True)
    return sum(r[2] for r in rows), rows[:top]


def ratio(a: Measurement, b: Measurement) -> float:
    return a.rate / b.rate


def serial_ceiling(*parts: Measurement) -> float:
    """The rate of doing every part one after the other on one thread: 1 / (sum of seconds per message)."""
    return 1.0 / sum(1.0 / p.rate for p in parts)


def run_stages(bootstrap: str, topics: Topics, work: Workload, codec: Codec, n: int,
               step: Callable[[str], None]) -> dict[str, Measurement]:
    stages: list[tuple[str, Callable[[], Measurement]]] = [
        ("raw_produce", lambda: raw_produce(bootstrap, topics, work, RAW_REPEATS)),
        ("event_producer", lambda: event_store_produce(bootstrap, topics, work)),
        ("raw_consume", lambda: raw_consume(bootstrap, topics.events, n, RAW_REPEATS)),
        ("runtime", lambda: runtime_consume(bootstrap, topics.events, topics.dlq, n)),
        ("replay", lambda: replay(bootstrap, topics.events, n)),
        ("codec_decode", lambda: decode_only(codec, work.payloads)),
    ]
    results: dict[str, Measurement] = {}
    for name, run in stages:
        gc.collect()
        results[name] = run()
        step(f"{name}: {results[name].rate:,.0f} msgs/s")
        if name == "event_producer":
            # The models are not needed any more; keeping 10^5 of them alive would make every garbage
            # collection in the consuming stages slower than it is in a service.
            work.messages.clear()
            for topic, expected in ((topics.raw, RAW_REPEATS * n), (topics.events, n)):
                if (count := message_count(bootstrap, topic, PARTITIONS)) != expected:
                    raise RuntimeError(f"{topic} holds {count} messages, expected {expected}")
    return results


def build_figures(m: dict[str, Measurement], work: Workload, n: int, tasks: int) -> dict[str, Any]:
    figures: dict[str, Any] = {"messages": n, "task_ids": tasks, "partitions": PARTITIONS,
                               "avg_message_bytes": round(work.average_bytes, 1)}
    for name, value in (("codec_encode", work.encode), *m.items()):
        figures[f"{name}_seconds"] = round(value.seconds, 4)
        figures[f"{name}_msgs_per_s"] = round(value.rate, 1)
        figures[f"{name}_cpu_us_per_msg"] = round(value.cpu_us_per_message, 3)
        if value.repeats:
            figures[f"{name}_repeats_msgs_per_s"] = [round(r, 1) for r in value.repeats]
        if value.longest_gap_s is not None:
            figures[f"{name}_longest_gap_s"] = round(value.longest_gap_s, 4)
    ceiling = serial_ceiling(m["raw_consume"], m["codec_decode"])
    runtime_ratio = ratio(m["runtime"], m["raw_consume"])
    figures |= {
        "event_producer_vs_raw_produce": round(ratio(m["event_producer"], m["raw_produce"]), 4),
        "runtime_vs_raw_consume": round(runtime_ratio, 4),
        "replay_vs_raw_consume": round(ratio(m["replay"], m["raw_consume"]), 4),
        "runtime_target": RUNTIME_TARGET,
        "runtime_target_met": runtime_ratio >= RUNTIME_TARGET,
        "consume_plus_decode_ceiling_msgs_per_s": round(ceiling, 1),
        "ceiling_vs_raw_consume": round(ceiling / m["raw_consume"].rate, 4),
        "runtime_vs_ceiling": round(m["runtime"].rate / ceiling, 4),
        "replay_vs_ceiling": round(m["replay"].rate / ceiling, 4),
    }
    return figures


def results_table(m: dict[str, Measurement], work: Workload, n: int, tasks: int) -> Table:
    table = Table(title=f"Event store throughput: {n:,} messages of ~{work.average_bytes:.0f} bytes, "
                        f"{PARTITIONS} partitions, {tasks:,} task ids",
                  title_justify="left",
                  caption="CPU µs/msg: CPU time of the Python thread that ran the stage (librdkafka's own "
                          "threads not included); * wall µs/msg of the ceiling",
                  caption_justify="left")
    table.add_column("#", justify="right")
    table.add_column("stage")
    table.add_column("seconds", justify="right")
    table.add_column("msgs/s", justify="right")
    table.add_column("CPU µs/msg", justify="right")
    table.add_column("ratio", justify="right")
    runtime_ratio = ratio(m["runtime"], m["raw_consume"])
    verdict = "met" if runtime_ratio >= RUNTIME_TARGET else "MISSED"
    ceiling = serial_ceiling(m["raw_consume"], m["codec_decode"])
    rows: list[tuple[str, str, Measurement | None, float, str]] = [
        ("1", f"raw produce, pre-encoded (median of {RAW_REPEATS})", m["raw_produce"], 0, ""),
        ("2", "EventProducer.send (encode + produce)", m["event_producer"], 0,
         f"{ratio(m['event_producer'], m['raw_produce']):.3f} of 1"),
        ("3", f"raw consume, batches of 500 (median of {RAW_REPEATS})", m["raw_consume"], 0, ""),
        ("4", "ConsumerRuntime (consume + decode + handler)", m["runtime"], 0,
         f"{runtime_ratio:.3f} of 3 (>= {RUNTIME_TARGET}? {verdict})"),
        ("5", "ReplayReader (consume + decode)", m["replay"], 0,
         f"{ratio(m['replay'], m['raw_consume']):.3f} of 3"),
        ("", "ref: Codec.encode only, no Kafka", work.encode, 0, ""),
        ("", "ref: Codec.decode only, no Kafka", m["codec_decode"], 0, ""),
        ("", "ref: ceiling of 3 + decode, serially", None, ceiling,
         f"{ceiling / m['raw_consume'].rate:.3f} of 3; 4 = {m['runtime'].rate / ceiling:.2f} of it"),
    ]
    for number, label, value, rate, note in rows:
        if value is not None and value.longest_gap_s is not None and value.longest_gap_s > STALL_NOTE_S:
            note = f"{note}; stalled {value.longest_gap_s:.2f}s once"
        if value is None:
            table.add_row(number, label, "", f"{rate:,.0f}", f"{1e6 / rate:.2f}*", note)
        else:
            table.add_row(number, label, f"{value.seconds:.2f}", f"{value.rate:,.0f}",
                          f"{value.cpu_us_per_message:.2f}", note)
    return table


def profile_table(profiler: cProfile.Profile, path: Path, top: int = 20) -> Table:
    total, rows = profile_rows(profiler, top)
    table = Table(title=f"cProfile of stage 4, by own time ({total:.2f}s in all; {path})", title_justify="left")
    table.add_column("function")
    table.add_column("calls", justify="right")
    table.add_column("own s", justify="right")
    table.add_column("own %", justify="right")
    table.add_column("cum s", justify="right")
    for where, calls, own, cum in rows:
        table.add_row(where, f"{calls:,}", f"{own:.2f}", f"{100 * own / total:.1f}", f"{cum:.2f}")
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--messages", type=int, default=200_000,
                        help="messages per stage (default 200000; keep it a multiple of 500, the runtime's "
                             "batch, or its last batch waits out the poll timeout)")
    parser.add_argument("--tasks", type=int, default=10_000, help="distinct task ids (keys), default 10000")
    parser.add_argument("--profile", action="store_true",
                        help="also profile one extra (untimed) pass of the consumer runtime with cProfile")
    parser.add_argument("--keep-topics", action="store_true", help="do not delete the benchmark's topics")
    args = parser.parse_args(argv)
    n: int = args.messages
    if n < 1:
        parser.error("--messages must be >= 1")

    settings = KafkaSettings()
    log_path = settings.home / "bench-eventstore.log"
    console = Console(width=None if sys.stdout.isatty() else 120)
    configure_logging("WARNING")  # the runtime's logs: warnings only, on stderr (the log file)
    started = datetime.now(UTC)
    load_before = os.getloadavg()
    profiler = cProfile.Profile() if args.profile else None

    with quiet_stderr(log_path) as terminal:
        progress = Console(file=terminal, stderr=True)

        def step(text: str) -> None:
            progress.print(f"[dim]{time.strftime('%H:%M:%S')}[/dim] {text}", highlight=False)

        bootstrap, broker, _pid = resolve_bootstrap(settings)
        step(f"broker: {bootstrap} ({broker})")
        codec = default_codec()
        step(f"building {n:,} events over {args.tasks:,} task ids")
        work = make_workload(n, args.tasks, codec)
        prefix = f"bench-eventstore-{started:%Y%m%d%H%M%S}-{uuid.uuid4().hex[:6]}."
        topics = create_topics(bootstrap, prefix)
        step(f"topics {prefix}{{raw,events,dlq,warmup}} ({PARTITIONS} partitions); "
             f"{work.average_bytes:.0f} bytes per message")
        try:
            results = run_stages(bootstrap, topics, work, codec, n, step)
            if profiler is not None:
                step("profiling one more pass of the consumer runtime (cProfile, not timed)")
                gc.collect()
                runtime_consume(bootstrap, topics.events, topics.dlq, n, profiler)
        finally:
            if not args.keep_topics:
                for error in delete_topics(bootstrap, topics.names):
                    step(f"[yellow]could not delete topic {error}[/yellow]")
        step("done")
    load_after = os.getloadavg()

    figures: dict[str, Any] = {
        **run_facts("eventstore", started, bootstrap, broker, prefix, load_before, load_after),
        **build_figures(results, work, n, args.tasks),
        "client_log": str(log_path),
    }
    console.print(results_table(results, work, n, args.tasks))
    console.print(f"broker {bootstrap} ({broker}); {started:%Y-%m-%d %H:%M} UTC; {os.cpu_count()} CPUs; "
                  f"Python {platform.python_version()}; 1-minute load average {load_before[0]:.2f} before, "
                  f"{load_after[0]:.2f} after; client logs: {log_path}", highlight=False)
    if profiler is not None:
        prof_path = settings.home / "bench-eventstore-runtime.prof"
        profiler.dump_stats(prof_path)
        console.print(profile_table(profiler, prof_path))
        figures["profile"] = str(prof_path)

    sys.stdout.flush()
    sys.stdout.write(orjson.dumps(figures).decode() + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
