"""A task's attempts folded from its history: each attempt's queue wait, work and outcome classified from the
events (throttled, deferred, timed out, refused, failed), and the wait after it."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import orjson

from projections.attempts import attempts
from projections.rows import ms
from schemas.messages import (
    Event,
    RetryBroughtForward,
    StepAccepted,
    StepCompensationFailed,
    StepCompensationStarted,
    StepFailed,
    StepRetryScheduled,
    StepStarted,
    StepSucceeded,
)

T0 = datetime(2026, 1, 1, tzinfo=UTC)


class History:
    """Events of one task, a second apart, as the API hands them to ``attempts`` (decoded bodies)."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def at(self, seconds: float) -> datetime:
        return T0 + timedelta(seconds=seconds)

    def add(self, cls: type[Event], seconds: float, **fields: Any) -> None:
        self.events.append(cls(task_id="t", sequence=len(self.events) + 1, workflow="w", workflow_version=1,
                               causation_id="c", occurred_at=self.at(seconds), **fields))

    def started(self, seconds: float, attempt_id: str, attempt: int, step: str = "pay") -> None:
        self.add(StepStarted, seconds, step=step, step_index=0, attempt=attempt, attempt_id=attempt_id,
                 complete_by=self.at(seconds + 60), calls_allowed=3, start_by=self.at(seconds + 30))

    def rows(self) -> list[dict[str, Any]]:
        return [{"event_type": type(e).__name__, "occurred_at": ms(e.occurred_at),
                 "event": orjson.loads(e.model_dump_json())} for e in self.events]


def test_each_attempt_is_classified_from_what_its_events_say_and_carries_its_queue_wait_and_the_wait_after() -> None:
    h = History()
    h.started(0, "a1", 1)
    h.add(StepAccepted, 2, step="pay", attempt_id="a1", accepted_at=h.at(2), complete_by=h.at(30), waited_ms=2000)
    h.add(StepFailed, 3, step="pay", attempt_id="a1", error="429 slow down", permanent=False, calls=1,
          failure_count=1)
    h.add(StepRetryScheduled, 3, step="pay", step_index=0, attempt=2, not_before=h.at(13), reason="throttled",
          error_kind="throttled")
    h.started(13, "a2", 2)
    h.add(StepRetryScheduled, 14, step="pay", step_index=0, attempt=2, not_before=h.at(40), reason="breaker open",
          error_kind="breaker_open", deferred_attempt_id="a2")
    h.add(RetryBroughtForward, 20, step="pay", command_id="cmd")
    h.started(20, "a3", 2)
    h.add(StepAccepted, 21, step="pay", attempt_id="a3", accepted_at=h.at(21), complete_by=h.at(30), waited_ms=1000)
    h.add(StepFailed, 30, step="pay", attempt_id="a3", error="deadline passed", permanent=False, timed_out=True,
          calls=1, failure_count=2)
    h.started(31, "a4", 3)
    h.add(StepAccepted, 31, step="pay", attempt_id="a4", accepted_at=h.at(31), complete_by=h.at(60), waited_ms=0)
    h.add(StepFailed, 32, step="pay", attempt_id="a4", error="500", permanent=False, calls=1, failure_count=3)
    h.started(33, "s1", 1, step="ship")
    h.add(StepAccepted, 34, step="ship", attempt_id="s1", accepted_at=h.at(34), complete_by=h.at(60), waited_ms=0)
    h.add(StepSucceeded, 35, step="ship", attempt_id="s1", output={}, calls=1)
    h.add(StepCompensationStarted, 36, step="ship", step_index=1, attempt=1, attempt_id="u1",
          complete_by=h.at(90), calls_allowed=1, start_by=h.at(60))
    h.add(StepAccepted, 37, step="ship", attempt_id="u1", compensation=True, accepted_at=h.at(37),
          complete_by=h.at(60), waited_ms=1000)
    h.add(StepCompensationFailed, 38, step="ship", attempt_id="u1", error="400 already shipped", permanent=True,
          calls=1, failure_count=1)

    found = attempts(h.rows())
    assert [(a.attempt_id, a.outcome) for a in found] == [
        ("a1", "throttled"), ("a2", "deferred"), ("a3", "timed out"), ("a4", "failed"), ("s1", "succeeded"),
        ("u1", "refused")]
    first, deferred = found[0], found[1]
    assert (first.accepted_at, first.ended_at) == (ms(h.at(2)), ms(h.at(3)))
    assert (first.wait_until, first.wait_reason, first.error) == (ms(h.at(13)), "throttled", "429 slow down")
    assert deferred.wait_until == ms(h.at(20)), "an operator's try-now ends the wait early"
    assert deferred.error == "breaker open" and deferred.accepted_at is None
    assert found[5].compensation and found[5].error == "400 already shipped"


def test_an_attempt_not_ended_yet_is_queued_until_an_agent_takes_it_then_running() -> None:
    h = History()
    h.started(0, "a1", 1)
    assert [a.outcome for a in attempts(h.rows())] == ["queued"]
    h.add(StepAccepted, 1, step="pay", attempt_id="a1", accepted_at=h.at(1), complete_by=h.at(30), waited_ms=1000)
    assert [(a.outcome, a.ended_at) for a in attempts(h.rows())] == [("running", None)]


def test_a_last_attempt_with_no_timer_after_it_is_classified_by_the_kind_its_failure_event_records() -> None:
    h = History()
    h.started(0, "a1", 1)
    h.add(StepFailed, 1, step="pay", attempt_id="a1", error="429 slow down", permanent=False, calls=1,
          failure_count=0, error_kind="throttled")
    h.started(2, "a2", 2)
    h.add(StepFailed, 3, step="pay", attempt_id="a2", error="breaker open; past the step's total time",
          permanent=False, calls=0, failure_count=1, error_kind="breaker_open")
    h.add(StepCompensationStarted, 4, step="pay", step_index=0, attempt=1, attempt_id="u1", complete_by=h.at(90),
          calls_allowed=1, start_by=h.at(60))
    h.add(StepCompensationFailed, 5, step="pay", attempt_id="u1", error="503", permanent=False, calls=1,
          failure_count=1, error_kind="server_error")

    found = attempts(h.rows())
    assert [(a.attempt_id, a.outcome, a.error_kind) for a in found] == [
        ("a1", "throttled", "throttled"), ("a2", "deferred", "breaker_open"), ("u1", "failed", "server_error")]


def test_an_old_failure_event_without_a_kind_still_reads_failed_when_no_timer_follows_it() -> None:
    h = History()
    h.started(0, "a1", 1)
    h.add(StepFailed, 1, step="pay", attempt_id="a1", error="429 slow down", permanent=False, calls=1,
          failure_count=0)
    assert [(a.outcome, a.error_kind) for a in attempts(h.rows())] == [("failed", None)]
