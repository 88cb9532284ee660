"""A task's attempts, read from its history: when each was handed over, taken and ended, how it ended, and the
wait that followed it, for the console's timeline of a task.

The store keeps only a step's last attempt in its row; the history keeps every one, so the attempts are folded
from it here (a pure function of the events, like every projection). Each attempt's outcome is classified from
what the events say about it:

* ``succeeded`` (``undone`` for a compensation): its agent reported success;
* ``timed out``: its deadline passed (``StepFailed.timed_out``), or its agent said its call timed out;
* ``refused``: a permanent failure (``permanent``: the service refused it for good, never retried);
* ``throttled``: the service asked us to slow down (``error_kind`` throttled);
* ``deferred``: it made no call (an open breaker or a spent retry budget), ended by a timer, or by giving up;
* ``failed``: any other failure (a server error, a lost connection);
* ``queued`` or ``running``: not ended yet.

A failure event says its agent's ``error_kind`` itself. Events written before it did say it only on the timer the
scheduler wrote after them, so such a failure is classified from that timer when there is one; the last one before
escalation (no timer followed) reads ``failed`` then, even when it was throttled.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any, Literal

from projections.rows import ms

#: How an attempt ended, or that it has not (see the module docstring): the console colours its bar by it.
Outcome = Literal["queued", "running", "succeeded", "undone", "timed out", "refused", "throttled", "deferred",
                  "failed"]

#: A failure the agent said more about, by its ``error_kind`` (on the failure, or on the timer after it).
_KIND_OUTCOMES: dict[str, Outcome] = {"throttled": "throttled", "timeout": "timed out", "permanent": "refused",
                                      "breaker_open": "deferred", "budget_spent": "deferred"}


@dataclass
class Attempt:
    step: str
    compensation: bool
    attempt: int
    attempt_id: str
    handed_at: int  # epoch ms: the scheduler handed it to its agent (queued from then)
    accepted_at: int | None = None  # its agent took it: the work began
    ended_at: int | None = None
    outcome: Outcome = "queued"
    error: str | None = None
    error_kind: str | None = None
    wait_until: int | None = None  # the timer after it: the next attempt starts no earlier
    wait_reason: str | None = None

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def _ms(value: Any) -> int | None:
    """An event's time as epoch ms (event bodies hold ISO 8601 text)."""
    if value is None:
        return None
    return ms(datetime.fromisoformat(str(value)))  # Python 3.11 reads a trailing Z


def attempts(history: Iterable[Mapping[str, Any]]) -> list[Attempt]:
    """Every attempt of a task in the order they were handed over; ``history`` is the task's events in order,
    each ``{"event_type", "occurred_at" (ms), "event" (the decoded body)}``."""
    found: list[Attempt] = []
    by_id: dict[str, Attempt] = {}
    last_ended: dict[tuple[str, bool], Attempt] = {}
    for row in history:
        kind, at, event = row["event_type"], int(row["occurred_at"]), row["event"]
        if kind in ("StepStarted", "StepCompensationStarted"):
            attempt = Attempt(event["step"], kind == "StepCompensationStarted", event["attempt"], event["attempt_id"],
                              at, outcome="queued" if event.get("start_by") else "running")
            if event.get("start_by") is None:  # older events: running from the start, no queue
                attempt.accepted_at = at
            found.append(attempt)
            by_id[attempt.attempt_id] = attempt
            continue
        current = by_id.get(event.get("attempt_id") or event.get("deferred_attempt_id") or "")
        if kind == "StepAccepted" and current is not None:
            current.accepted_at = _ms(event["accepted_at"])
            current.outcome = "running"
        elif kind in ("StepSucceeded", "StepCompensated") and current is not None:
            _end(current, at, "undone" if kind == "StepCompensated" else "succeeded", None)
            last_ended[(current.step, current.compensation)] = current
        elif kind in ("StepFailed", "StepCompensationFailed") and current is not None:
            error_kind = event.get("error_kind")
            outcome: Outcome = ("timed out" if event.get("timed_out") else "refused" if event.get("permanent")
                                else _KIND_OUTCOMES.get(error_kind or "", "failed"))
            _end(current, at, outcome, event.get("error"))
            current.error_kind = error_kind
            last_ended[(current.step, current.compensation)] = current
        elif kind == "StepRetryScheduled":
            _timer(event, at, current, last_ended)
        elif kind == "RetryBroughtForward":  # an operator's try-now: the wait ended here
            for key in ((event["step"], False), (event["step"], True)):
                ended = last_ended.get(key)
                if ended is not None and ended.wait_until is not None and ended.wait_until > at:
                    ended.wait_until = at
    return found


def _end(attempt: Attempt, at: int, outcome: Outcome, error: str | None) -> None:
    attempt.ended_at, attempt.outcome, attempt.error = at, outcome, error


def _timer(event: Mapping[str, Any], at: int, deferred: Attempt | None,
           last_ended: dict[tuple[str, bool], Attempt]) -> None:
    """A timer ends a deferred attempt (no call made), or follows the attempt that failed before it, whose
    classification it sharpens with the agent's ``error_kind``."""
    kind = event.get("error_kind")
    if deferred is not None:
        _end(deferred, at, "deferred", event["reason"])
        target = deferred
        last_ended[(deferred.step, deferred.compensation)] = deferred
    else:
        found = last_ended.get((event["step"], bool(event.get("compensation"))))
        if found is None:
            return
        target = found
        if target.outcome == "failed" and kind in _KIND_OUTCOMES:
            target.outcome = _KIND_OUTCOMES[kind]
    target.error_kind = target.error_kind or kind
    target.wait_until = _ms(event["not_before"])
    target.wait_reason = event["reason"]
