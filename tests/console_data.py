"""Task histories for the console's tests, decided by the real decider (``scheduler.decider``) on a virtual clock
and written straight to a store: hundreds of tasks in a second, each a history the scheduler would have written,
compensations and their refusals included.

Each task follows a script: how each attempt of each step (or of its undo) answers, as its agent would report it.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from scheduler.decider import Limits, decide, fold
from scheduler.workflow import Backoff, Compensation, Step, Workflow, WorkflowRegistry
from schemas.messages import (
    AttemptAccepted,
    Event,
    Message,
    RetryDue,
    StepCompensationStarted,
    StepResult,
    StepStarted,
    SubmitTask,
)

# Three steps, the first two with an undo; a step that gives up (2 failures, or a refusal) undoes the others.
ORDERS = Workflow("orders", 1, (
    Step("reserve", "inventory", compensation=Compensation("inventory-release")),
    Step("charge", "payments", backoff=Backoff(initial_s=2, max_s=2), compensation=Compensation("payments-refund")),
    Step("ship", "shipping"),
), failure_threshold=2, escalation="compensate")
REGISTRY = WorkflowRegistry.of([ORDERS])

# What an attempt answers: (ok, error, permanent, error_kind, retry_after_s), by (step, undo?, attempt number).
Answer = tuple[bool, str | None, bool, str | None, float | None]
Script = Callable[[str, bool, int], Answer]
OK: Answer = (True, None, False, None, None)


def completes(_step: str, _undo: bool, _attempt: int) -> Answer:
    return OK


def throttled_once(step: str, _undo: bool, attempt: int) -> Answer:
    """The payment service asks us to slow down once (429, Retry-After 3 s), then takes the charge."""
    return (False, "429 Too Many Requests", False, "throttled", 3.0) if step == "charge" and attempt == 1 else OK


def shipping_refuses(step: str, undo: bool, _attempt: int) -> Answer:
    """Shipping refuses the order for good: the charge is refunded and the reservation released."""
    return (False, "422 address not served", True, "permanent", None) if step == "ship" and not undo else OK


def refund_refused(step: str, undo: bool, attempt: int) -> Answer:
    """As ``shipping_refuses``, and the payment service refuses the refund for good: compensation_failed."""
    if step == "charge" and undo:
        return (False, "409 charge already settled: refund by hand", True, "permanent", None)
    return shipping_refuses(step, undo, attempt)


SCRIPTS: dict[str, Script] = {"completed": completes, "throttled": throttled_once, "compensated": shipping_refuses,
                              "compensation_failed": refund_refused}


def decided(task_id: str, script: Script, start: datetime, *, submitter: str = "shop",
            queue_s: float = 0.2, work_s: float = 0.3) -> list[Event]:
    """Every event of one task as the scheduler decides them, its agents answering by ``script``: each attempt
    waits ``queue_s`` for its agent and works ``work_s``; a timer is fired when it is due."""
    now = start
    events: list[Event] = []

    def send(command: Message) -> None:
        decision = decide(command, fold(events) if events else None, registry=REGISTRY, now=now, in_flight=0,
                          limits=Limits())
        events.extend(decision.events)

    send(SubmitTask(task_id=task_id, workflow="orders", input={}, submitter=submitter))
    for _ in range(40):
        state = fold(events)
        assert state is not None
        if state.is_terminal:
            return events
        handed = next((e for e in reversed(events) if isinstance(e, StepStarted | StepCompensationStarted)), None)
        waiting = [s for s in state.steps if s.timer is not None]
        if state.current_step is not None and handed is not None:
            undo = isinstance(handed, StepCompensationStarted)
            now += timedelta(seconds=queue_s)
            send(AttemptAccepted(task_id=task_id, step=handed.step, attempt_id=handed.attempt_id, compensation=undo,
                                 accepted_at=now))
            now += timedelta(seconds=work_s)
            ok, error, permanent, kind, retry_after = script(handed.step, undo, handed.attempt)
            fields: dict[str, Any] = {"output": {}} if ok else {"error": error, "error_kind": kind,
                                                                 "retry_after_s": retry_after}
            send(StepResult(task_id=task_id, step=handed.step, attempt_id=handed.attempt_id, ok=ok,
                            permanent=permanent, calls=1, **fields))
        elif waiting:
            timer = waiting[0].timer
            assert timer is not None
            now = max(now, timer.not_before)
            send(RetryDue(task_id=task_id, step=waiting[0].name, attempt=timer.attempt, not_before=timer.not_before,
                          compensation=timer.compensation))
        else:
            return events
    raise AssertionError(f"{task_id} did not end: {[type(e).__name__ for e in events]}")
