"""Small helpers for tests that read and write real topics."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

from confluent_kafka import Consumer, Message

from eventstore.replay import LogRange


def read_all(bootstrap: str, topic: str, *, expect: int, timeout_s: float = 30.0) -> list[Message]:
    """Read a topic from the beginning (read_committed) until ``expect`` messages or the timeout."""
    consumer = Consumer({
        "bootstrap.servers": bootstrap,
        "group.id": f"test-reader-{uuid.uuid4().hex}",
        "auto.offset.reset": "earliest",
        "enable.auto.commit": False,
        "isolation.level": "read_committed",
    })
    consumer.subscribe([topic])
    out: list[Message] = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < expect and time.monotonic() < deadline:
            for msg in consumer.consume(500, 0.2):
                if msg.error() is None:
                    out.append(msg)
    finally:
        consumer.close()
    return out


def read_to_end(bootstrap: str, topic: str) -> list[Message]:
    """Every record of ``topic`` up to its end now, committed or not: for what a process that has returned (an
    answer given, a command exited, a producer flushed) put there, with no waiting for records that should
    not come."""
    return list(LogRange(bootstrap, topic, committed_only=False))


def wait_for(condition: Callable[[], bool], timeout_s: float = 30.0, interval_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval_s)
    return condition()
