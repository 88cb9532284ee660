"""Realistic task histories as the scheduler writes them, without running the system.

Used by the projection tests (many events, fast) and by the replay benchmark (a million). Seeded, so a
given seed gives the same shapes (message ids and times aside).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

from eventstore.producer import EventProducer
from schemas.messages import (
    Event,
    MessageIgnored,
    OperatorAlert,
    StepAccepted,
    StepFailed,
    StepStarted,
    StepSucceeded,
    TaskAccepted,
    TaskCompleted,
    TaskFailed,
    TaskRejected,
)

STEPS = ("reserve", "charge", "ship")
WORKFLOWS = ("orders", "refunds")


def history(task_id: str, rng: random.Random, start: datetime, *, in_flight: bool = False) -> list[Event]:
    """One task's events in order. Attempts start queued and are mostly acknowledged by their agent (some
    results come without one). ``in_flight``: stop at a step still processing (its deadline ``start`` + 5 s),
    as a task whose agent died after taking it would."""
    workflow = rng.choice(WORKFLOWS)
    common: dict[str, Any] = {"task_id": task_id, "workflow": workflow, "workflow_version": 1,
                              "causation_id": f"c-{task_id}"}
    events: list[Event] = []
    elapsed_ms = 0

    def add(event_type: type[Event], **fields: Any) -> None:
        nonlocal elapsed_ms
        elapsed_ms += rng.randint(1, 40)
        events.append(event_type(**common, sequence=len(events) + 1,
                                 occurred_at=start + timedelta(milliseconds=elapsed_ms), **fields))

    if rng.random() < 0.04:
        add(TaskRejected, reason="in-flight bound reached", input_digest="d")
        return events
    add(TaskAccepted, input={"order_id": task_id, "qty": rng.randint(1, 5)}, input_digest="d")
    for index, step in enumerate(STEPS):
        failures = 0
        while True:
            attempt_id = f"{task_id}:{step}:{failures + 1}"
            start_by = start + timedelta(seconds=300)
            add(StepStarted, step=step, step_index=index, attempt=failures + 1, attempt_id=attempt_id,
                start_by=start_by, complete_by=start_by + timedelta(seconds=5), calls_allowed=3)
            if in_flight and index == len(STEPS) - 1:
                add(StepAccepted, step=step, attempt_id=attempt_id, accepted_at=start, waited_ms=0,
                    complete_by=start + timedelta(seconds=5))
                return events
            if rng.random() < 0.8:
                waited_ms = rng.randint(0, 2000)
                add(StepAccepted, step=step, attempt_id=attempt_id, waited_ms=waited_ms,
                    accepted_at=start + timedelta(milliseconds=elapsed_ms + waited_ms),
                    complete_by=start + timedelta(milliseconds=elapsed_ms + waited_ms, seconds=5))
            roll = rng.random()
            if roll < 0.12 and failures < 2:
                failures += 1
                add(StepFailed, step=step, attempt_id=attempt_id, error="503 from service", permanent=False,
                    timed_out=rng.random() < 0.3, calls=2, failure_count=failures)
                if rng.random() < 0.2:
                    add(MessageIgnored, attempt_id=attempt_id, message_type="StepResult", reason="late answer")
                continue
            if roll < 0.15:
                add(StepFailed, step=step, attempt_id=attempt_id, error="400 refused", permanent=True, calls=1,
                    failure_count=failures + 1)
                add(TaskFailed, step=step, reason="permanent error")
                add(OperatorAlert, step=step, reason=f"{step} refused for good")
                return events
            add(StepSucceeded, step=step, attempt_id=attempt_id, output={"ok": True}, calls=1)
            break
    add(TaskCompleted, output={"done": True})
    return events


def histories(count: int, *, seed: int = 7, prefix: str = "task", in_flight_every: int = 0,
              start: datetime | None = None) -> Iterator[Event]:
    """``count`` tasks' events, task after task; every ``in_flight_every``-th task is left in flight."""
    rng = random.Random(seed)
    origin = start or datetime.now(UTC) - timedelta(minutes=30)
    for i in range(count):
        at = origin + timedelta(milliseconds=i * 50)
        yield from history(f"{prefix}-{i:07d}", rng, at, in_flight=bool(in_flight_every) and i % in_flight_every == 0)


def publish(bootstrap: str, topic: str, events: Iterator[Event] | list[Event]) -> int:
    """Produce events keyed by task id (as the scheduler does); returns how many."""
    producer = EventProducer(bootstrap)
    sent = 0
    for event in events:
        producer.send(topic, event)
        sent += 1
    producer.flush()
    return sent
