"""Workflows with short timeouts, loaded by the scheduler processes the tests start."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from demo.workflows import OrderInput, PaidOrderInput
from scheduler.workflow import Backoff, Compensation, Step, Workflow, WorkflowRegistry

# charge allows 4 s an attempt: three attempts outlast a dead agent's group session (6 s) plus a restart,
# so a test that SIGKILLs the payments agent sees the step recovered rather than escalated.
ORDERS_V1 = Workflow(
    name="orders",
    version=1,
    steps=(
        Step("reserve", agent="inventory", timeout_s=2.0, attempt_budget=8, calls_per_attempt=2),
        Step("charge", agent="payments", timeout_s=4.0, attempt_budget=8, calls_per_attempt=2),
        Step("ship", agent="shipping", timeout_s=2.0, attempt_budget=8, calls_per_attempt=2),
    ),
    failure_threshold=3,
)

# Version 2 drops shipping: a task pinned to v1 still ships, one on v2 does not.
ORDERS_V2 = Workflow(
    name="orders",
    version=2,
    steps=(
        Step("reserve", agent="inventory", timeout_s=2.0, attempt_budget=8, calls_per_attempt=2),
        Step("charge", agent="payments", timeout_s=2.0, attempt_budget=8, calls_per_attempt=2),
    ),
    failure_threshold=3,
)

# Requests must be taken within 2 s: a test without the payments agent sees its charge attempts expire (and the
# supervisor ask for their recovery) without waiting out the default start-by of five minutes.
ORDERS_QUICK_START = Workflow(
    name="orders-quick-start",
    version=1,
    steps=tuple(replace(step, queue_timeout_s=2.0) for step in ORDERS_V1.steps),
    failure_threshold=3,
)

REGISTRY = WorkflowRegistry.of([ORDERS_V1, ORDERS_V2, ORDERS_QUICK_START])

# Appended for tests/test_agent_budget_end_to_end.py: steps whose end-to-end call budget is far below what
# the agent's retry limit and the workflow's failure threshold would allow, so only the budget can stop
# the calls. One step each: a service answering 503 to everything, and one that hangs (attempts time out).
BUDGET_CAPPED = Workflow(
    name="budget-capped",
    version=1,
    steps=(Step("reserve", agent="inventory", timeout_s=2.0, attempt_budget=5, calls_per_attempt=3),),
    failure_threshold=100,
)
BUDGET_CAPPED_HANG = Workflow(
    name="budget-capped-hang",
    version=1,
    steps=(Step("charge", agent="payments", timeout_s=1.0, attempt_budget=3, calls_per_attempt=2),),
    failure_threshold=100,
)
REGISTRY.register(BUDGET_CAPPED)
REGISTRY.register(BUDGET_CAPPED_HANG)

# The demo's order with its input model (tests/test_submission_mistakes.py, test_task_api.py): an input the
# model refuses never reaches the log, whichever way it comes in.
ORDERS_TYPED = Workflow(name="orders-typed", version=1, steps=ORDERS_V1.steps, input_model=OrderInput)
REGISTRY.register(ORDERS_TYPED)

# ---- compensation (tests/test_compensation_end_to_end.py) ------------------------------------------
# Every step has the order service's compensating action. ``charge`` marks its charge id sensitive: the
# event log holds it sealed, while the refund still receives it in clear. A failure threshold of 2 keeps
# the supervisor's escalations quick. The compensation tests run the scheduler on COMPENSATION_REGISTRY,
# with an encryption key configured.


def _compensated_order_steps(charge_budget: int = 8) -> tuple[Step, ...]:
    return (
        Step("reserve", agent="inventory", timeout_s=2.0, attempt_budget=8, calls_per_attempt=2,
             compensation=Compensation("inventory-release", timeout_s=2.0, attempt_budget=6, calls_per_attempt=2)),
        Step("charge", agent="payments", timeout_s=3.0, attempt_budget=charge_budget, calls_per_attempt=2,
             compensation=Compensation("payments-refund", timeout_s=2.0, attempt_budget=6, calls_per_attempt=2),
             sensitive_output=frozenset({"charge_id"})),
        Step("ship", agent="shipping", timeout_s=2.0, attempt_budget=8, calls_per_attempt=2,
             compensation=Compensation("shipping-cancel", timeout_s=2.0, attempt_budget=6, calls_per_attempt=2)),
    )


def _with_opens(steps: tuple[Step, ...], **opens: set[str]) -> tuple[Step, ...]:
    """``steps`` with the sensitive values each named step is granted (``Step.opens``)."""
    return tuple(replace(step, opens=frozenset(opens[step.name])) if step.name in opens else step for step in steps)


def _with_undo(steps: tuple[Step, ...], only: str | None = None, **changes: Any) -> tuple[Step, ...]:
    """``steps`` with ``changes`` made to the compensation of each step (or of step ``only``)."""
    return tuple(step if step.compensation is None or only not in (None, step.name)
                 else replace(step, compensation=replace(step.compensation, **changes)) for step in steps)


# A step that gives up undoes the completed ones at once.
ORDERS_COMP = Workflow(name="orders-comp", version=1, steps=_compensated_order_steps(), failure_threshold=2,
                       escalation="compensate")
# A step that gives up leaves the task in error: an operator resubmits the step or orders compensation.
ORDERS_HOLD = Workflow(name="orders-hold", version=1, steps=_compensated_order_steps(), failure_threshold=2,
                       escalation="error")

# A payment that may take many attempts (a long outage): the task stays running until an operator acts.
ORDERS_PATIENT = Workflow(
    name="orders-patient",
    version=1,
    steps=_compensated_order_steps(charge_budget=100),
    failure_threshold=40,
    escalation="error",
)

# One failed attempt gives up at once (tests/test_undo_end_to_end.py): a step whose only attempt ended with an
# unknown outcome is compensated straight away.
ORDERS_ONCE = Workflow(name="orders-once", version=1, steps=_compensated_order_steps(), failure_threshold=1,
                       escalation="compensate")

# Five failed attempts before giving up (tests/test_undo_chaos.py): enough for a compensation to outlast a
# SIGKILLed agent's partitions waiting out its consumer session (10 s) before a restarted agent takes them.
ORDERS_CHAOS = Workflow(name="orders-chaos", version=1, steps=_compensated_order_steps(), failure_threshold=5,
                        escalation="compensate")

# Undo requests must be taken within 2 s: with the refund agent stopped, each undo attempt waits queued and
# is recovered by the supervisor at its start-by, without waiting out the default five minutes.
ORDERS_COMP_QUICK_START = Workflow(
    name="orders-comp-quick-start",
    version=1,
    steps=_with_undo(_compensated_order_steps(), queue_timeout_s=2.0),
    failure_threshold=2,
    escalation="compensate",
)

# The payment service as one that cannot refuse a late forward call (tests/test_undo_end_to_end.py): its
# refund claims no tombstone and waits until a charge started by the last attempt can no longer land.
ORDERS_UNFENCED = Workflow(
    name="orders-unfenced",
    version=1,
    steps=_with_undo(_compensated_order_steps(), only="charge", forward_may_land_s=2.0),
    failure_threshold=1,
    escalation="compensate",
)

# ---- timers (tests/test_timers_end_to_end.py) ----------------------------------------------------------
# Steps that wait between attempts: a fixed back-off (no jitter, so a test knows when each timer is due) of
# 6 s, long enough for a scheduler SIGKILLed while timers pend to come back before most of them are due, and
# one call an attempt, so every failed call is a failed attempt the scheduler waits after. The charge's
# attempt (3 s) is shorter than a Retry-After of 10 s: the agent hands that wait back to the scheduler.
ORDERS_WAITING = Workflow(
    name="orders-waiting",
    version=1,
    steps=tuple(replace(step, backoff=Backoff(initial_s=6.0, jitter=0.0), calls_per_attempt=1,
                        compensation=replace(step.compensation, backoff=Backoff(initial_s=1.0))
                        if step.compensation is not None else None)
                for step in _compensated_order_steps()),
    failure_threshold=5,
    escalation="compensate",
)

# Waits out an outage (tests/test_timers_end_to_end.py): a back-off growing from 1 s to 8 s, and five failed
# attempts a step before it gives up. Attempts the agents' open breakers refuse are deferred, not failures,
# so an outage of 20 s spends few of them.
ORDERS_OUTAGE = Workflow(
    name="orders-outage",
    version=1,
    steps=tuple(replace(step, backoff=Backoff(initial_s=1.0, max_s=8.0)) for step in _compensated_order_steps()),
    failure_threshold=5,
    escalation="compensate",
)

# A long back-off past the threshold (tests/test_timers_end_to_end.py): two failed attempts, then 8 s of
# waiting and a fresh round, up to two more rounds, then undo.
ORDERS_BACKOFF = Workflow(
    name="orders-backoff",
    version=1,
    steps=tuple(replace(step, backoff=Backoff(initial_s=0.5, jitter=0.0), calls_per_attempt=1)
                for step in _compensated_order_steps()),
    failure_threshold=2,
    escalation="backoff",
    long_backoff_s=8.0,
    backoff_rounds=2,
    after_backoff="compensate",
)

# An undo that keeps failing waits (tests/test_timers_end_to_end.py): two failed undo attempts (one call each,
# 0.5 s apart), then 5 s of waiting and a fresh round, up to two more rounds, before the task is left to an
# operator in compensation_failed.
ORDERS_UNDO_WAITS = Workflow(
    name="orders-undo-waits",
    version=1,
    steps=_with_undo(_compensated_order_steps(), calls_per_attempt=1, backoff=Backoff(initial_s=0.5, jitter=0.0),
                     long_backoff_s=5.0, backoff_rounds=2),
    failure_threshold=2,
    escalation="compensate",
)

# orders-chaos that waits (tests/test_waiting_out_kills.py, benchmarks/waiting_out_kills.py): the same steps and
# threshold, but every attempt (and undo) backs off from 0.5 s (1 s) to 4 s (8 s), and a step past its threshold
# waits 4 s for a fresh round, up to four times, before it undoes; a budget of 30 calls a step pays for them.
ORDERS_RIDING = Workflow(
    name="orders-riding",
    version=1,
    steps=tuple(replace(step, attempt_budget=30, backoff=Backoff(initial_s=0.5, max_s=4.0),
                        compensation=replace(step.compensation, backoff=Backoff(initial_s=1.0, max_s=8.0))
                        if step.compensation is not None else None)
                for step in _compensated_order_steps()),
    failure_threshold=ORDERS_CHAOS.failure_threshold,
    escalation="backoff",
    long_backoff_s=4.0,
    backoff_rounds=4,
    after_backoff="compensate",
)

COMPENSATION_REGISTRY = WorkflowRegistry.of([ORDERS_V1, ORDERS_V2, ORDERS_COMP, ORDERS_HOLD, ORDERS_PATIENT,
                                             ORDERS_ONCE, ORDERS_CHAOS, ORDERS_COMP_QUICK_START, ORDERS_UNFENCED,
                                             ORDERS_WAITING, ORDERS_OUTAGE, ORDERS_BACKOFF, ORDERS_RIDING,
                                             ORDERS_UNDO_WAITS])

# ---- sensitive inputs (tests/test_sensitive_end_to_end.py) -----------------------------------------
# The demo's paid order: ``card_token`` is sealed from submission on and opened by the payments agent only
# (charge is the one step granted it; inventory and shipping requests never hold it); charge's output keeps
# its own marking, and a failed ship undoes what completed (the refund is given the card token and the charge
# whole). Run with an encryption key configured.
ORDERS_CARD = Workflow(name="orders-card", version=1,
                       steps=_with_opens(_compensated_order_steps(), charge={"card_token"}),
                       failure_threshold=2, escalation="compensate", input_model=PaidOrderInput,
                       sensitive_input=frozenset({"card_token"}))
# The same, keeping a finished task's card data for 2 s only: then the supervisor erases it.
ORDERS_CARD_BRIEF = replace(ORDERS_CARD, name="orders-card-brief", sensitive_retention_s=2.0)
SENSITIVE_REGISTRY = WorkflowRegistry.of([ORDERS_V1, ORDERS_CARD, ORDERS_CARD_BRIEF])

# ---- a rollout (tests/test_admission_end_to_end.py) ------------------------------------------------
# Version 3 of orders reserves and ships, charging nothing: what a task ran under shows at the service. The
# deployment runs REGISTRY, then ROLLED_OUT; a client may read either (ahead of its schedulers, or behind).
ORDERS_V3 = Workflow(name="orders", version=3, steps=(ORDERS_V1.steps[0], ORDERS_V1.steps[2]), failure_threshold=3)
ROLLED_OUT = WorkflowRegistry.of([*REGISTRY.workflows(), ORDERS_V3])
# A client whose registry is behind the scheduler's: its orders-typed took any input.
LENIENT = WorkflowRegistry.of([replace(ORDERS_TYPED, input_model=None)])
