"""The console's per-minute charts folded from event types and times: tasks completed and compensated, step
latency percentiles and queue depth."""

from __future__ import annotations

from projections.charts import per_minute, percentile

M = 60_000


def test_percentiles_are_nearest_rank() -> None:
    assert percentile([], 0.5) is None
    assert percentile([5], 0.99) == 5
    assert percentile(list(range(1, 101)), 0.5) == 50
    assert percentile(list(range(1, 101)), 0.99) == 99


def test_each_minute_counts_finished_tasks_the_latency_of_attempts_ended_in_it_and_the_queue_at_its_end() -> None:
    rows = [
        # a: queued 0.5 min, works, succeeds in minute 1, completes
        ("a", 1, "StepStarted", 10_000), ("a", 2, "StepAccepted", 40_000), ("a", 3, "StepSucceeded", 70_000),
        ("a", 4, "TaskCompleted", 70_000),
        # b: queued from minute 0 to minute 2, then fails and is compensated in minute 2
        ("b", 1, "StepStarted", 20_000), ("b", 2, "StepAccepted", 2 * M + 1), ("b", 3, "StepFailed", 2 * M + 500),
        ("b", 4, "StepCompensationStarted", 2 * M + 600), ("b", 5, "StepAccepted", 2 * M + 700),
        ("b", 6, "StepCompensated", 2 * M + 900), ("b", 7, "TaskCompensated", 2 * M + 900),
        # c: handed over in minute 1, never taken
        ("c", 1, "StepStarted", M + 5),
    ]
    series = per_minute(rows, 0, 3)
    assert [p["minute"] for p in series] == [0, M, 2 * M]
    assert [(p["completed"], p["compensated"]) for p in series] == [(0, 0), (1, 0), (0, 1)]
    assert [p["queue_depth"] for p in series] == [1, 2, 1]  # b waits; then b and c; then c
    assert [(p["latency_p50_ms"], p["latency_p99_ms"]) for p in series] == [
        (None, None), (60_000, 60_000), (300, 2 * M + 500 - 20_000)]
