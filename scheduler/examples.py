"""The demo's workflow: an order reserved, charged and shipped. Version 2 gives payment more room."""

from __future__ import annotations

from scheduler.workflow import Step, Workflow, WorkflowRegistry

ORDERS_V1 = Workflow(
    name="orders",
    version=1,
    steps=(
        Step("reserve", agent="inventory", timeout_s=5.0, attempt_budget=6, calls_per_attempt=3),
        Step("charge", agent="payments", timeout_s=5.0, attempt_budget=6, calls_per_attempt=3),
        Step("ship", agent="shipping", timeout_s=5.0, attempt_budget=6, calls_per_attempt=3),
    ),
    failure_threshold=3,
)

ORDERS_V2 = Workflow(
    name="orders",
    version=2,
    steps=(
        Step("reserve", agent="inventory", timeout_s=5.0, attempt_budget=6, calls_per_attempt=3),
        Step("charge", agent="payments", timeout_s=8.0, attempt_budget=10, calls_per_attempt=4),
        Step("ship", agent="shipping", timeout_s=5.0, attempt_budget=6, calls_per_attempt=3),
    ),
    failure_threshold=4,
)

REGISTRY = WorkflowRegistry.of([ORDERS_V1, ORDERS_V2])
