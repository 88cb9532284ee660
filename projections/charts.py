"""The console's charts over a recent window, per minute: tasks completed and compensated, step latency (p50
and p99) and queue depth, folded from the events of the window.

Every figure is read from ``task_history`` (event type and time, no body), so the charts need no table of their
own and a rebuild gives them back. A task runs one attempt at a time, so an attempt's end is the next result
event of its task after its ``StepStarted`` (or ``StepCompensationStarted``): the pairing needs no step names.

* step latency: from an attempt's hand-over to its result (queue wait and work: what the task waited), by the
  minute of the result;
* queue depth: attempts handed over and not yet taken by an agent (nor ended) at the end of each minute.
  Attempts handed over before the window are not seen: the first minutes may read low.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

STARTED = ("StepStarted", "StepCompensationStarted")
TAKEN = ("StepAccepted",)
RESULTS = ("StepSucceeded", "StepFailed", "StepCompensated", "StepCompensationFailed", "StepRetryScheduled")
FINISHED = {"TaskCompleted": "completed", "TaskCompensated": "compensated"}
CHART_EVENTS = (*STARTED, *TAKEN, *RESULTS, *FINISHED)
MINUTE_MS = 60_000


def percentile(values: list[int], fraction: float) -> int | None:
    """The nearest-rank percentile of ``values`` (None: no values)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(math.ceil(len(ordered) * fraction), 1) - 1]


def per_minute(rows: Iterable[tuple[str, int, str, int]], first_minute_ms: int, minutes: int) -> list[dict[str, Any]]:
    """The series, one point per minute from ``first_minute_ms``; ``rows`` are (task_id, sequence, event_type,
    occurred_at ms) of ``CHART_EVENTS``, ordered by task and sequence."""
    finished = [dict.fromkeys(FINISHED.values(), 0) for _ in range(minutes)]
    latencies: list[list[int]] = [[] for _ in range(minutes)]
    queued: list[tuple[int, int]] = []  # (handed over, taken or ended) of each attempt that waited
    open_since: dict[str, tuple[int, bool]] = {}  # task -> (attempt handed over at, taken yet)

    def minute(at: int) -> int | None:
        index = (at - first_minute_ms) // MINUTE_MS
        return index if 0 <= index < minutes else None

    for task_id, _sequence, event_type, at in rows:
        index = minute(at)
        if event_type in FINISHED:
            if index is not None:
                finished[index][FINISHED[event_type]] += 1
        elif event_type in STARTED:
            open_since[task_id] = (at, False)
        elif task_id in open_since:
            handed, taken = open_since[task_id]
            if not taken:
                queued.append((handed, at))
            if event_type in TAKEN:
                open_since[task_id] = (handed, True)
                continue
            del open_since[task_id]
            if index is not None:
                latencies[index].append(at - handed)
    queued += [(handed, 2**62) for handed, taken in open_since.values() if not taken]
    # An attempt is in the depth of each minute whose end is after its hand-over and not after it left the
    # queue: +1 from the first such minute, -1 from the first minute past it (a running sum, not a scan).
    changes = [0] * (minutes + 1)

    def first_end_after(at: int) -> int:
        return min(max((at - first_minute_ms) // MINUTE_MS, 0), minutes)

    for handed, left in queued:
        changes[first_end_after(handed)] += 1
        changes[first_end_after(left)] -= 1
    series, depth = [], 0
    for i in range(minutes):
        depth += changes[i]
        series.append({"minute": first_minute_ms + i * MINUTE_MS, **finished[i],
                       "latency_p50_ms": percentile(latencies[i], 0.5),
                       "latency_p99_ms": percentile(latencies[i], 0.99), "queue_depth": depth})
    return series
