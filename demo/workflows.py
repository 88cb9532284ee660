"""The demo's workflow: an order reserved, charged and shipped.

Version 1 leaves a task that cannot finish in ``error`` for an operator; version 2 undoes what completed
(release the reservation, refund the charge) in reverse order; version 3 first waits out an outage of its
services: back-off between attempts, and past the failure threshold a long back-off and fresh rounds
(``OUTAGE_RIDDEN_S``), before it undoes anything; version 4 (the latest, what ``stepstream up`` and ``make demo``
run) is version 3 paid with a card: its input carries a ``card_token``, marked sensitive, which the order
service takes at ``charge``. Sealed from submission on, it is in clear only in the payments agent's call and
the service.
"""

from __future__ import annotations

from dataclasses import replace

from pydantic import BaseModel, ConfigDict, Field

from scheduler.workflow import Backoff, Compensation, Step, Workflow, WorkflowRegistry


class OrderInput(BaseModel):
    """An order as the order service takes it. ``qty`` 0 is well-formed: the service refuses it for good at
    the first step (the demo's invalid order), which is a business answer, not a malformed submission."""

    model_config = ConfigDict(extra="forbid")

    order_id: str = Field(min_length=1)
    sku: str = Field(min_length=1)
    qty: int = Field(ge=0)
    amount: float = Field(ge=0)


class PaidOrderInput(OrderInput):
    """An order paid with a card: the token the payment service charges (sensitive: sealed end to end)."""

    card_token: str = Field(min_length=1)


def _order_steps(*, compensated: bool) -> tuple[Step, ...]:
    def undo(agent: str) -> Compensation | None:
        return Compensation(agent, timeout_s=5.0, attempt_budget=6, calls_per_attempt=3) if compensated else None

    return (
        Step("reserve", agent="inventory", timeout_s=5.0, attempt_budget=6, calls_per_attempt=3,
             compensation=undo("inventory-release")),
        Step("charge", agent="payments", timeout_s=5.0, attempt_budget=6, calls_per_attempt=3,
             compensation=undo("payments-refund")),
        Step("ship", agent="shipping", timeout_s=5.0, attempt_budget=6, calls_per_attempt=3,
             compensation=undo("shipping-cancel")),
    )


ORDERS_V1 = Workflow(name="orders", version=1, steps=_order_steps(compensated=False), failure_threshold=3,
                     input_model=OrderInput)
ORDERS_V2 = Workflow(name="orders", version=2, steps=_order_steps(compensated=True), failure_threshold=3,
                     escalation="compensate", input_model=OrderInput)

OUTAGE_RIDDEN_S = 60.0
"""The outage of its services an order of version 3 or 4 waits out without failing or compensating, even
when every attempt fails at once (tests/test_decider_timers.py): a round of three attempts backed off by 1 s
and 2 s, then 20 s of waiting and a fresh round, three times, is over 60 s before the last round starts.
Each attempt may make two calls and the step 30, enough for four rounds of three attempts (24 calls)."""

ORDERS_V3 = Workflow(
    name="orders", version=3,
    steps=tuple(replace(step, attempt_budget=30, calls_per_attempt=2, backoff=Backoff(initial_s=1.0, max_s=10.0))
                for step in _order_steps(compensated=True)),
    failure_threshold=3, escalation="backoff", long_backoff_s=20.0, backoff_rounds=3, after_backoff="compensate",
    input_model=OrderInput)
ORDERS_V4 = replace(ORDERS_V3, version=4, input_model=PaidOrderInput, sensitive_input=frozenset({"card_token"}),
                    steps=tuple(replace(step, opens=frozenset({"card_token"})) if step.name == "charge" else step
                                for step in ORDERS_V3.steps))
"""Only ``charge`` is given the card token (its payments agent, and the refund): inventory and shipping
requests never hold it, not even sealed."""

REGISTRY = WorkflowRegistry.of([ORDERS_V1, ORDERS_V2, ORDERS_V3, ORDERS_V4])
