"""Set-up and tear-down the benchmark scripts share: quiet stderr, the broker, fresh topics, counts."""

from __future__ import annotations

import contextlib
import os
import platform
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO

from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient

from eventstore.broker import LocalBroker
from eventstore.settings import KafkaSettings
from eventstore.topics import TopicSpec, ensure_topics


@contextlib.contextmanager
def quiet_stderr(log_path: Path) -> Iterator[TextIO]:
    """Send fd 2 (librdkafka logs, service logs) to ``log_path``; yield a stream to the real stderr."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    sys.stderr.flush()
    saved = os.dup(2)
    terminal = os.fdopen(os.dup(saved), "w", buffering=1)
    with open(log_path, "ab") as log:
        os.dup2(log.fileno(), 2)
        try:
            yield terminal
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            terminal.close()


def resolve_bootstrap(settings: KafkaSettings) -> tuple[str, str, int | None]:
    """(bootstrap servers, description, broker pid if local): the configured cluster, else the local broker."""
    if settings.bootstrap_servers:
        return settings.bootstrap_servers, "STEPSTREAM_BOOTSTRAP_SERVERS", None
    info = LocalBroker(settings.home).start()
    return info.bootstrap_servers, f"local broker (pid {info.pid})", info.pid


def create_fresh_topics(bootstrap: str, specs: list[TopicSpec], replication_factor: int = 1) -> None:
    """Create every topic (none may exist yet) and return once each partition has a leader."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    names = [spec.name for spec in specs]
    created = ensure_topics(admin, specs, replication_factor)
    if sorted(created) != sorted(names):
        raise RuntimeError(f"expected fresh topics, but only {created} were created")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        listed = admin.list_topics(timeout=10).topics
        if all(name in listed and listed[name].error is None and listed[name].partitions
               and all(p.leader >= 0 for p in listed[name].partitions.values()) for name in names):
            return
        time.sleep(0.1)
    raise RuntimeError("the new topics got no partition leaders within 30s")


def delete_topics(bootstrap: str, names: list[str]) -> list[str]:
    """Delete ``names``; returns the errors. The admin client must outlive the futures it answers."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    errors = []
    for name, future in admin.delete_topics(names, operation_timeout=30).items():
        try:
            future.result(timeout=30)
        except Exception as exc:  # reported; the figures are still valid
            errors.append(f"{name}: {exc}")
    return errors


def message_count(bootstrap: str, topic: str, partitions: int) -> int:
    """Sum of high watermarks: exact for a topic nothing writes in transactions (no control records)."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"bench-watermarks-{uuid.uuid4().hex}"})
    try:
        return sum(consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1] for p in range(partitions))
    finally:
        consumer.close()


def short_filename(filename: str, root: Path) -> str:
    """A profiler's file name without the site-packages or project prefix."""
    for marker in ("site-packages/", f"{root}/", "lib/python3"):
        if marker in filename:
            return filename.split(marker, 1)[1]
    return filename


def run_facts(benchmark: str, started: datetime, bootstrap: str, broker: str, prefix: str,
              load_before: tuple[float, ...], load_after: tuple[float, ...]) -> dict[str, Any]:
    """What every benchmark's JSON line starts with: when, where, and how loaded the machine was."""
    return {
        "benchmark": benchmark,
        "date": started.isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "bootstrap": bootstrap,
        "broker": broker,
        "topic_prefix": prefix,
        "load_avg_1m_before": round(load_before[0], 2),
        "load_avg_1m_after": round(load_after[0], 2),
    }


def postgres_url(given: str | None) -> tuple[str, Any]:
    """The PostgreSQL server to measure: ``given``, else a throwaway cluster of the installed server binaries
    (``tests/postgres.py``), returned with it so the caller stops it."""
    if given:
        return given, None
    from tests.postgres import ThrowawayPostgres, server_binaries

    bindir = server_binaries()
    if bindir is None:
        raise SystemExit("no PostgreSQL server binaries: pass --postgres-url or --skip-postgres")
    cluster = ThrowawayPostgres(bindir)
    return cluster.start(), cluster
