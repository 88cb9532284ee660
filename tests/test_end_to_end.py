"""Tasks run end to end through every service as a real process, under the faults the pattern names."""

from __future__ import annotations

import time
from collections import Counter
from datetime import timedelta

import orjson
import pytest

from schemas.messages import (
    MessageIgnored,
    OperatorAlert,
    RecoverStep,
    StepAccepted,
    StepFailed,
    StepResult,
    StepStarted,
    StepSucceeded,
    TaskAccepted,
    TaskCompleted,
    TaskFailed,
)
from tests.kafka_helpers import read_to_end, wait_for
from tests.system import AGENTS, System

pytestmark = pytest.mark.kafka

OPERATIONS = ("inventory/reserve", "payments/charge", "shipping/create")


def _kinds(system: System, task_id: str) -> list[str]:
    return [type(e).__name__ for e in system.events(task_id)]


def _assert_each_side_effect_applied_once(system: System, task_ids: list[str]) -> None:
    applied = system.admin.calls()["applied"]
    for op in OPERATIONS:
        for task_id in task_ids:
            step = {"inventory/reserve": "reserve", "payments/charge": "charge", "shipping/create": "ship"}[op]
            assert applied.get(op, {}).get(f"{task_id}:{step}", 0) == 1, f"{op} for {task_id}"


def test_a_three_step_task_completes_and_its_events_are_exactly_the_transitions_in_order(system: System) -> None:
    system.start()
    system.submit("order-1", version=1)
    assert system.wait_terminal(["order-1"]) == {"order-1": "completed"}
    events = system.events("order-1")
    assert [type(e).__name__ for e in events] == [
        "TaskAccepted",
        "StepStarted", "StepAccepted", "StepSucceeded",
        "StepStarted", "StepAccepted", "StepSucceeded",
        "StepStarted", "StepAccepted", "StepSucceeded",
        "TaskCompleted",
    ]
    assert [e.sequence for e in events] == list(range(1, 12))
    assert [e.step for e in events if isinstance(e, StepStarted)] == ["reserve", "charge", "ship"]
    assert {(e.workflow, e.workflow_version) for e in events} == {("orders", 1)}
    _assert_each_side_effect_applied_once(system, ["order-1"])


def test_scheduler_sigkilled_mid_task_is_replaced_and_every_task_completes_without_duplicate_effects(
    system: System,
) -> None:
    system.admin.set_faults(latency_ms=150)
    system.start()
    ids = [f"kill-sched-{i}" for i in range(12)]
    for task_id in ids:
        system.submit(task_id, version=1)
    assert wait_for(lambda: sum(1 for t in ids if system.task(t)) >= 6, timeout_s=60)
    killed = _scheduler_instance(system)
    system.procs.kill("scheduler")
    system.restart("scheduler")
    # Its successor takes its name, so its transactional id fences what the killed one left open at once.
    assert _scheduler_instance(system) == killed
    statuses = system.wait_terminal(ids, timeout_s=120)
    assert set(statuses.values()) == {"completed"}, statuses
    _assert_each_side_effect_applied_once(system, ids)
    for task_id in ids:
        sequences = [e.sequence for e in system.events(task_id)]
        assert sequences == list(range(1, len(sequences) + 1)), f"{task_id}: one history, no gaps or repeats"


def _scheduler_instance(system: System) -> str:
    """The instance name the running scheduler logged (scheduler/instance.py)."""
    found: list[str] = []

    def logged() -> bool:
        found[:] = [orjson.loads(line)["instance"] for line in system.procs.log("scheduler").splitlines()
                    if '"scheduler instance"' in line]
        return bool(found)

    assert wait_for(logged, timeout_s=30), system.procs.log("scheduler")
    return found[0]


def test_agent_sigkilled_mid_call_is_recovered_by_the_supervisor_with_a_new_attempt(system: System) -> None:
    system.admin.set_faults("payments/charge", hang=True, hang_max_s=30)
    system.start()
    system.submit("order-hang", version=1)
    assert wait_for(lambda: system.admin.requests_for("payments/charge", "order-hang:charge") >= 1, timeout_s=60)
    system.procs.kill("payments")
    system.admin.clear_faults("payments/charge")
    system.restart("payments")
    assert system.wait_terminal(["order-hang"], timeout_s=60) == {"order-hang": "completed"}
    events = system.events("order-hang")
    charges = [e for e in events if isinstance(e, StepStarted) and e.step == "charge"]
    assert len(charges) >= 2, "a new attempt was started after the deadline"
    timed_out = [e for e in events if isinstance(e, StepFailed) and e.timed_out]
    assert timed_out and timed_out[0].attempt_id == charges[0].attempt_id
    (taken,) = [e for e in events if isinstance(e, StepAccepted) and e.attempt_id == charges[0].attempt_id]
    assert timed_out[0].occurred_at >= taken.complete_by, "recovered by the supervisor after its work deadline"
    succeeded = [e for e in events if isinstance(e, StepSucceeded) and e.step == "charge"]
    assert [e.attempt_id for e in succeeded] == [charges[-1].attempt_id]
    assert system.admin.applied_for("payments/charge", "order-hang:charge") == 1


def test_a_late_answer_for_an_old_attempt_changes_nothing(system: System) -> None:
    system.start()
    system.submit("order-late", version=1)
    assert system.wait_terminal(["order-late"]) == {"order-late": "completed"}
    first = next(e for e in system.events("order-late") if isinstance(e, StepStarted))
    system.producer.send(system.layout.inbox, StepResult(task_id="order-late", step=first.step,
                                                         attempt_id=first.attempt_id, ok=False, error="late"))
    system.producer.send(system.layout.inbox, RecoverStep(task_id="order-late", attempt_id=first.attempt_id,
                                                          reason="late"))
    system.producer.flush()
    assert wait_for(lambda: sum(isinstance(e, MessageIgnored) for e in system.events("order-late")) == 2)
    assert (system.task("order-late") or {})["status"] == "completed"


def test_a_step_that_always_times_out_is_retried_to_the_threshold_then_errors_with_an_alert(system: System) -> None:
    system.admin.set_faults("shipping/create", hang=True, hang_max_s=60)
    system.start()
    system.submit("order-stuck", version=1)
    assert system.wait_terminal(["order-stuck"], timeout_s=90) == {"order-stuck": "error"}
    events = system.events("order-stuck")
    ship_attempts = [e for e in events if isinstance(e, StepStarted) and e.step == "ship"]
    failures = [e for e in events if isinstance(e, StepFailed) and e.step == "ship"]
    assert len(ship_attempts) == 3 and len(failures) == 3, "retried up to the failure threshold of 3"
    assert [f.failure_count for f in failures] == [1, 2, 3]
    taken = {e.attempt_id: e for e in events if isinstance(e, StepAccepted)}
    for failed in failures:
        # Each attempt was taken by the agent, its 2 s of work counted from then; the hung call used them up.
        accepted = taken[failed.attempt_id]
        assert accepted.complete_by - accepted.accepted_at == timedelta(seconds=2)
        assert accepted.accepted_at <= failed.occurred_at
    assert any(isinstance(e, TaskFailed) for e in events)
    assert any(isinstance(e, OperatorAlert) and e.step == "ship" for e in events)
    count = len(events)
    time.sleep(4)  # longer than a step timeout plus a supervisor cadence
    later = system.events("order-stuck")
    assert not [e for e in later[count:] if isinstance(e, StepStarted)], "nothing keeps retrying"


def test_a_burst_many_times_the_agents_capacity_waits_queued_and_every_task_completes_each_step_applied_once(
    system: System,
) -> None:
    """Two calls in flight per agent at 250 ms a call: 30 tasks keep the reserve agent busy about 4 s,
    twice the step's 2 s timeout. Waiting is not failing: no attempt fails, every task completes."""
    system.env["STEPSTREAM_AGENT_CONCURRENCY"] = "2"
    system.admin.set_faults(latency_ms=250)
    system.start()
    ids = [f"burst-{i}" for i in range(30)]
    for task_id in ids:
        system.submit(task_id, version=1)
    statuses = system.wait_terminal(ids, timeout_s=120)
    assert set(statuses.values()) == {"completed"}, statuses
    events = system.events()
    assert not [e for e in events if isinstance(e, StepFailed | MessageIgnored)], "no attempt failed for waiting"
    waits = [e.waited_ms for e in events if isinstance(e, StepAccepted) and e.step == "reserve"]
    assert len(waits) == len(ids) and max(waits) > 2000, f"requests waited past the step timeout: {max(waits)} ms"
    for task_id in ids:
        records = system.admin.records(task_id)
        assert [e["operation"] for e in records["effects"]] == list(OPERATIONS), f"{task_id}: each step applied once"
    _assert_each_side_effect_applied_once(system, ids)
    assert wait_for(lambda: all((system.task(t) or {}).get("status") == "completed" for t in ids))
    stored = [step for t in ids for step in system.steps(t)]
    assert all(step["waited_ms"] is not None and step["accepted_at"] for step in stored)
    assert max(step["waited_ms"] for step in stored) > 2000, "the store shows how long steps waited"


def test_a_permanent_error_puts_the_task_in_error_at_once_without_retries(system: System) -> None:
    system.admin.set_faults("payments/charge", permanent_error_rate=1.0)
    system.start()
    system.submit("order-refused", version=1)
    assert system.wait_terminal(["order-refused"]) == {"order-refused": "error"}
    events = system.events("order-refused")
    assert len([e for e in events if isinstance(e, StepStarted) and e.step == "charge"]) == 1
    assert system.admin.requests_for("payments/charge", "order-refused:charge") == 1
    failed = next(e for e in events if isinstance(e, StepFailed))
    assert failed.permanent


def test_two_supervisors_only_the_leader_requests_recovery_and_the_other_takes_over(system: System) -> None:
    system.start("projector", "scheduler", "inventory")  # no payments agent: charge attempts expire (start-by 2 s)
    system.restart("supervisor-a")
    time.sleep(3)
    system.restart("supervisor-b")
    system.submit("order-orphan", workflow="orders-quick-start")

    def senders() -> Counter[str]:
        recoveries = read_to_end(system.bootstrap, system.layout.inbox)
        return Counter(dict(m.headers() or []).get("stepstream.supervisor", b"?").decode() for m in recoveries
                       if dict(m.headers() or []).get("stepstream.supervisor"))

    assert wait_for(lambda: sum(senders().values()) >= 2, timeout_s=60)
    first = senders()
    assert len(first) == 1, f"recoveries came from one supervisor only: {first}"
    (leader_id,) = first
    leader = next(name for name in ("supervisor-a", "supervisor-b") if leader_id in system.procs.log(name))
    system.procs.kill(leader)
    system.submit("order-orphan-2", workflow="orders-quick-start")
    assert wait_for(lambda: len(senders()) == 2, timeout_s=60), "the other supervisor took over"


def test_two_workflow_versions_in_flight_each_finish_on_their_own_version(system: System) -> None:
    system.admin.set_faults(latency_ms=100)
    system.start()
    system.submit("on-v1", version=1)
    system.submit("on-v2", version=2)
    system.submit("on-latest")
    assert set(system.wait_terminal(["on-v1", "on-v2", "on-latest"]).values()) == {"completed"}
    steps = {t: [e.step for e in system.events(t) if isinstance(e, StepStarted)] for t in ("on-v1", "on-v2")}
    assert steps == {"on-v1": ["reserve", "charge", "ship"], "on-v2": ["reserve", "charge"]}
    accepted = next(e for e in system.events("on-latest") if isinstance(e, TaskAccepted))
    assert accepted.workflow_version == 2, "no version means the latest, pinned at submission"


def test_sigterm_of_each_service_under_load_drains_exits_zero_and_loses_or_repeats_nothing(system: System) -> None:
    system.admin.set_faults(latency_ms=30)
    system.start()
    ids = [f"drain-{i}" for i in range(24)]
    for name in ("scheduler", *AGENTS, "projector", "supervisor"):
        batch = ids[:4]
        ids = ids[4:] + batch  # rotate: 4 new tasks in flight before each service is stopped
        for task_id in batch:
            system.submit(task_id, version=1)
        time.sleep(0.5)
        assert system.procs.terminate(name) == 0, f"{name} drained and exited 0\n{system.procs.log(name)[-2000:]}"
        system.restart(name)
    statuses = system.wait_terminal(ids, timeout_s=120)
    assert set(statuses.values()) == {"completed"}, statuses
    _assert_each_side_effect_applied_once(system, ids)
    for task_id in ids:
        kinds = _kinds(system, task_id)
        assert kinds.count("TaskCompleted") == 1 and kinds.count("TaskAccepted") == 1
    assert not any(isinstance(e, TaskCompleted) and e.task_id not in ids for e in system.events())
    for name in system.procs.procs:
        assert "Traceback" not in system.procs.log(name), name
