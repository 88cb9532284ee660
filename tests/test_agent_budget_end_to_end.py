"""End to end: a service down for longer than a step allows gets at most the step's call budget.

Every service runs as a process against the real broker. The agents' central policy (a file, as in
production) lets them retry 50 times per attempt with no breaker or retry budget, and the workflows'
failure threshold is 100: the only thing left to stop the calls is the step's end-to-end budget, which the
scheduler splits into per-attempt allowances and charges with the calls each attempt reports (a timed-out
attempt with its whole allowance). The calls are counted where they land, at the service.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from schemas.messages import StepFailed, StepStarted, TaskFailed
from tests.system import System
from tests.workflows import BUDGET_CAPPED, BUDGET_CAPPED_HANG

pytestmark = pytest.mark.kafka

GREEDY_AGENTS = """
[dependencies.orders.retry]
max_retries = 50
initial_backoff_s = 0.02
max_backoff_s = 0.05

[dependencies.orders.breaker]
enabled = false

[dependencies.orders.budget]
enabled = false
"""


def test_a_service_down_longer_than_the_step_allows_never_gets_more_calls_than_the_steps_budget(
    system: System, tmp_path: Path,
) -> None:
    policy = tmp_path / "agent-policy.toml"
    policy.write_text(GREEDY_AGENTS)
    system.env["STEPSTREAM_AGENT_POLICY_FILE"] = str(policy)
    system.admin.set_faults("inventory/reserve", error_rate=1.0)
    system.admin.set_faults("payments/charge", hang=True, hang_max_s=60)
    system.start("projector", "scheduler", "inventory", "payments", "supervisor")

    system.submit("down-503", workflow=BUDGET_CAPPED.name)
    system.submit("down-hang", workflow=BUDGET_CAPPED_HANG.name)
    assert system.wait_terminal(["down-503", "down-hang"], timeout_s=90) == {"down-503": "error",
                                                                            "down-hang": "error"}

    for task_id, workflow, operation in (("down-503", BUDGET_CAPPED, "inventory/reserve"),
                                         ("down-hang", BUDGET_CAPPED_HANG, "payments/charge")):
        (step,) = workflow.steps
        budget = step.attempt_budget
        calls = system.admin.requests_for(operation, f"{task_id}:{step.name}")  # type: ignore[arg-type]
        assert 1 <= calls <= budget, f"{task_id}: {calls} calls reached the service; the budget is {budget}"
        events = system.events(task_id)
        failed = [e for e in events if isinstance(e, StepFailed)]
        assert calls <= sum(e.calls for e in failed) <= budget, "every call was charged, within the budget"
        assert all(e.calls_allowed <= step.calls_per_attempt for e in events if isinstance(e, StepStarted))
        assert len(failed) < workflow.failure_threshold, "the budget, not the failure threshold, ended the step"
        (gave_up,) = [e for e in events if isinstance(e, TaskFailed)]
        assert "attempt budget exhausted" in gave_up.reason

    for agent in ("inventory", "payments"):
        log = system.procs.log(agent)
        assert "policy loaded" in log and "Traceback" not in log, log[-2000:]
    # Where the agent got answers, it used the allowance it was given: it really did retry.
    first_allowance = BUDGET_CAPPED.steps[0].calls_per_attempt
    assert system.admin.requests_for("inventory/reserve", "down-503:reserve") >= first_allowance
