"""``stepstream task ...``: what the parser takes and how an answer is reported (end to end, with a broker,
in tests/test_compensation_end_to_end.py)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from schemas.messages import CompensationRetried, CompensationStarted, Event, OperatorCommandRefused, StepResubmitted
from stepstream.cli import build_parser
from stepstream.client.outcomes import Outcome, TaskEvents


def make(kind: type[Event], **fields: Any) -> Event:
    return kind(task_id="t1", sequence=9, workflow="w", workflow_version=1, causation_id="c",
                occurred_at=datetime(2025, 1, 1, tzinfo=UTC), **fields)


def test_resubmit_and_retry_take_a_step_compensate_and_cancel_act_on_the_whole_task(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = build_parser()
    args = parser.parse_args(["task", "resubmit", "t1", "--step", "ship", "--command-id", "c1", "--wait"])
    assert (args.action, args.task_id, args.step, args.command_id, args.wait) == ("resubmit", "t1", "ship", "c1", True)
    assert parser.parse_args(["task", "retry-compensation", "t1"]).step is None
    for action in ("compensate", "cancel"):
        with pytest.raises(SystemExit):
            parser.parse_args(["task", action, "t1", "--step", "ship"])
    assert "--step" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("event", "status", "detail"),
    [
        (make(OperatorCommandRefused, command_id="c", action="compensate", reason="task is completed: no"),
         "refused", "task is completed: no"),
        (make(StepResubmitted, step="ship", command_id="c"), "accepted", "step 'ship' resubmitted"),
        (make(CompensationRetried, step="charge", command_id="c"), "accepted", "compensation of step 'charge' retried"),
        (make(CompensationStarted, trigger="cancel", reason="r", steps=["charge", "reserve"], command_id="c"),
         "accepted", "compensating (cancel): charge, reserve"),
        (make(CompensationStarted, trigger="operator", reason="r", steps=[], command_id="c"),
         "accepted", "compensating (operator): nothing to undo"),
    ],
)
def test_the_answer_to_a_command_is_the_event_naming_it(event: Event, status: str, detail: str) -> None:
    assert Outcome.of(event) == Outcome(status, detail)  # type: ignore[arg-type]


def test_waiting_finds_an_answer_already_in_the_log_without_reading_further() -> None:
    watcher = TaskEvents("unused:9092", "events", "t1")
    answer = make(StepResubmitted, step="ship", command_id="c1")
    assert watcher.wait("c1", timeout_s=0, seen=[make(StepResubmitted, step="x", command_id="c0"), answer]) == \
        Outcome("accepted", "step 'ship' resubmitted")
    assert watcher.wait("c2", timeout_s=0, seen=[answer]) is None
