"""End to end: a service that throttles paces the run; it does not fail it.

Every service runs as a process against the real broker, with the agents' default fault policy (no
policy file, no retry settings from the environment). The order service throttles as payment rails do:
the first two calls of every charge are answered ``503`` with ``Retry-After: 2``. Every task must
complete, each charge with at most four calls and four attempts, and the counts must agree with what the
service itself recorded -- where the breaker counted those throttles as failures, this run took minutes
and spent dozens of attempts per charge.
"""

from __future__ import annotations

import time
from collections import Counter

import pytest

from schemas.messages import StepFailed, StepStarted
from tests.agreement import disagreements
from tests.system import System
from tests.workflows import ORDERS_V1

pytestmark = pytest.mark.kafka

TASKS = 200
ENDS_WITHIN_S = 60.0
RETRY_SETTINGS = ("STEPSTREAM_AGENT_INITIAL_BACKOFF_S", "STEPSTREAM_AGENT_MAX_BACKOFF_S",
                  "STEPSTREAM_AGENT_CALL_TIMEOUT_S")


def run_orders(system: System, prefix: str, tasks: int,
               patience_s: float = ENDS_WITHIN_S) -> tuple[float, dict[str, str]]:
    """Start the services with the default agent policy, submit ``tasks`` orders (three steps each), wait
    for their ends: the seconds from the first submission to the last end, and the ends."""
    for name in RETRY_SETTINGS:
        system.env.pop(name, None)
    system.start("projector", "scheduler", "inventory", "payments", "shipping")
    ids = [f"{prefix}-{n:03d}" for n in range(tasks)]
    started = time.monotonic()
    for task_id in ids:
        system.submit(task_id, version=1)
    statuses = system.wait_terminal(ids, timeout_s=patience_s)
    return time.monotonic() - started, statuses


def test_a_service_throttling_the_first_two_calls_of_every_charge_paces_all_tasks_to_completion(
    system: System,
) -> None:
    system.admin.set_faults("payments/charge", throttle_first=2, throttle_status=503, retry_after_s=2)
    took_s, statuses = run_orders(system, "paced", TASKS)

    assert Counter(statuses.values()) == {"completed": TASKS}, f"every task completes (took {took_s:.1f}s)"
    assert took_s < ENDS_WITHIN_S
    assert disagreements(system, statuses, statuses) == {}, "each end agrees with the service's own records"
    events = system.events()
    attempts = Counter(e.task_id for e in events if isinstance(e, StepStarted) and e.step == "charge")
    failures = [e for e in events if isinstance(e, StepFailed) and e.step == "charge"]
    seen = system.admin.calls()["requests"]["payments/charge"]
    for task_id in statuses:
        calls = seen.get(f"{task_id}:charge", 0)
        assert 3 <= calls <= 4, f"{task_id}: two throttled calls and the one served, at most one more: {calls}"
        assert 3 <= attempts[task_id] <= 4, f"{task_id}: {attempts[task_id]} attempts of its charge"
        charged = sum(e.calls for e in failures if e.task_id == task_id)
        assert charged == calls - 1, "every throttled call the service saw is charged to the step's budget"
    assert all(e.failure_count == 0 for e in failures), "a throttle is not a failure of the step"


def test_a_service_answering_429_to_three_calls_in_ten_completes_every_task_it_does_not_throttle_for_good(
    system: System,
) -> None:
    system.admin.set_faults("shipping/create", throttle_rate=0.3, retry_after_s=1)
    took_s, statuses = run_orders(system, "busy", TASKS // 2)

    # A shipment refused on every call of its budget (8 calls: 0.3 ** 8, one order in 15,000) may end the
    # order in error; any other order completes.
    outcomes = system.admin.calls()["outcomes"]["shipping/create"]
    (ship,) = [step for step in ORDERS_V1.steps if step.name == "ship"]
    unlucky = {t for t in statuses if outcomes.get(f"{t}:ship") == {"429": ship.attempt_budget}}
    assert {t for t, s in statuses.items() if s != "completed"} <= unlucky, f"took {took_s:.1f}s"
    assert disagreements(system, statuses, statuses) == {}
    ended = [e for e in system.events() if isinstance(e, StepFailed) and e.step == "ship"]
    throttled = sum(per_key.get("429", 0) for per_key in outcomes.values())
    assert 0 < len(ended) <= throttled, "an attempt ended short only on a call the service throttled"
    assert all(e.failure_count == 0 for e in ended), "and none of them counts as a failure of the step"
