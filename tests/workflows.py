"""Workflows with short timeouts, loaded by the scheduler processes the tests start."""

from __future__ import annotations

from scheduler.workflow import Step, Workflow, WorkflowRegistry

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

REGISTRY = WorkflowRegistry.of([ORDERS_V1, ORDERS_V2])
