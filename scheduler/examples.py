"""The demo's workflow: an order reserved, charged and shipped.

Version 1 leaves a task that cannot finish in ``error`` for an operator; version 2 (the latest) undoes
what completed (release the reservation, refund the charge) in reverse order.
"""

from __future__ import annotations

from scheduler.workflow import Compensation, Step, Workflow, WorkflowRegistry


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


ORDERS_V1 = Workflow(name="orders", version=1, steps=_order_steps(compensated=False), failure_threshold=3)
ORDERS_V2 = Workflow(name="orders", version=2, steps=_order_steps(compensated=True), failure_threshold=3,
                     escalation="compensate")

REGISTRY = WorkflowRegistry.of([ORDERS_V1, ORDERS_V2])
