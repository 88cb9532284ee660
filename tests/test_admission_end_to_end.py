"""The scheduler's door against real processes: submissions it cannot run are rejected where the submitter
looks (the store, its reply topic, ``submit --wait``) and in the DLQ, with nothing called at the service; and a
rollout of a new workflow version, from v1 tasks in flight to the new version's tasks completing."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import orjson
import pytest

from eventstore.dlq import read_dlq_headers
from schemas.messages import StatusUpdate, StepStarted, TaskAccepted
from tests.agreement import disagreements
from tests.kafka_helpers import read_all, wait_for
from tests.system import ROOT, System
from tests.test_submission import _client as client

pytestmark = pytest.mark.kafka

TYPED = {"order_id": "typed", "sku": "A-1", "qty": 1, "amount": 10}


def cli(system: System, registry: str, *args: str, background: bool = False) -> Any:
    """``stepstream ARGS`` run by a user whose workflows file is ``registry`` (``tests.workflows:NAME``)."""
    env = {**system.env, "STEPSTREAM_SCHEDULER_WORKFLOWS": f"tests.workflows:{registry}"}
    argv = [sys.executable, "-m", "stepstream", *args]
    if background:
        return subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=180, check=False)


def order(order_id: str) -> str:
    return orjson.dumps({"order_id": order_id, "sku": "A-1", "qty": 1, "amount": 10}).decode()


def called(system: System, task_id: str) -> list[str]:
    """Every operation the order service received a request of this task for."""
    return [operation for operation, keys in system.admin.arrivals().items()
            if any(key.startswith(f"{task_id}:") for key in keys)]


def test_a_missing_field_an_unknown_workflow_and_an_unknown_version_are_rejected_visibly_calling_nothing(
    system: System,
) -> None:
    system.start("projector", "scheduler", "inventory", "payments", "shipping")
    missing = {k: v for k, v in TYPED.items() if k != "amount"}
    # Produced as any Kafka client can, past every check of the edges.
    system.submit("missing-amount", missing, workflow="orders-typed", version=1, submitter="shop")
    system.submit("unknown-workflow", TYPED, workflow="no-such-flow", submitter="shop")
    system.submit("unknown-version", TYPED, workflow="orders", version=99, submitter="shop")
    system.submit("valid", TYPED, workflow="orders-typed", version=1, submitter="shop")
    reasons = {
        "missing-amount": "invalid input for 'orders-typed' v1: amount: Field required",
        "unknown-workflow": "not run by this scheduler: no workflow named 'no-such-flow'",
        "unknown-version": "not run by this scheduler: workflow 'orders' has no version 99 (this scheduler runs "
                           "'orders' v1, v2)",
    }
    assert system.wait_terminal([*reasons, "valid"], timeout_s=60) == {**dict.fromkeys(reasons, "rejected"),
                                                                       "valid": "completed"}
    for task_id, reason in reasons.items():
        assert reason in (system.task(task_id) or {})["error"], "the store says why"
    with client(system, submitter="shop") as shop:
        heard = [u for u in shop.updates(timeout_s=30, idle_s=3) if isinstance(u, StatusUpdate)]
    for task_id, reason in reasons.items():
        assert [(u.status, reason in (u.detail or "")) for u in heard if u.task_id == task_id] == [("rejected", True)]
    dead = [read_dlq_headers(m.headers())["reason"]
            for m in read_all(system.bootstrap, system.layout.dlq, expect=len(reasons), timeout_s=30)]
    assert all(any(reason in letter for letter in dead) for reason in reasons.values()), dead
    for task_id in reasons:
        assert called(system, task_id) == [], f"{task_id}: nothing called at the service"
    assert "inventory/reserve" in called(system, "valid"), "the agents were there to call"

    # A client whose workflows file is behind the scheduler's produces what the scheduler then refuses:
    # `submit --wait` ends with the scheduler's reason and exit 5.
    refused = cli(system, "LENIENT", "submit", "orders-typed", "--input", '{"order_id": "x"}', "--task-id",
                  "behind", "--wait", "--timeout", "60")
    assert refused.returncode == 5, refused.stdout + refused.stderr
    assert "task behind was rejected: invalid input for 'orders-typed' v1: sku: Field required" in refused.stderr
    assert "amount: Field required" in refused.stderr and called(system, "behind") == []
    again = cli(system, "LENIENT", "submit", "orders-typed", "--input", '{"order_id": "x"}', "--task-id", "behind",
                "--wait", "--timeout", "60")
    assert again.returncode == 5 and again.stderr == refused.stderr, "a repeat changes nothing: the same answer"
    assert (system.task("behind") or {}).get("sequence") == 1
    # A version no running scheduler runs is refused before anything is produced.
    ahead = cli(system, "ROLLED_OUT", "submit", "orders", "--version", "3", "--input", order("y"),
                "--task-id", "ahead")
    assert ahead.returncode == 2
    assert "no running scheduler runs 'orders' v3 (they run v1, v2)" in ahead.stderr
    assert system.task("ahead") is None


def test_a_rollout_finishes_v1_tasks_under_v1_refuses_v3_until_a_scheduler_runs_it_then_runs_v3(
    system: System,
) -> None:
    # No shipping agent yet: the v1 tasks wait at their last step, in flight across the rollout.
    system.start("projector", "scheduler", "inventory", "payments")
    old = [f"v1-{i}" for i in range(3)]
    for task_id in old:
        system.submit(task_id, version=1)
    assert wait_for(lambda: all(any(s["step"] == "ship" for s in system.steps(t)) for t in old), timeout_s=60)
    early = cli(system, "ROLLED_OUT", "submit", "orders", "--version", "3", "--input", order("e"))
    assert early.returncode == 2 and "no running scheduler runs 'orders' v3" in early.stderr
    waiting = cli(system, "ROLLED_OUT", "submit", "orders", "--version", "3", "--input", order("w"),
                  "--task-id", "v3-waited", "--await-version", "120", "--wait", "--timeout", "120", background=True)
    system.submit("v3-raw", version=3)  # from a producer that does not ask: rejected, visibly
    assert system.wait_terminal(["v3-raw"], timeout_s=60) == {"v3-raw": "rejected"}

    # The rollout: the scheduler restarts with v3 in its registry.
    assert system.procs.terminate("scheduler") == 0
    system.procs.service("scheduler", "scheduler", env={"STEPSTREAM_SCHEDULER_WORKFLOWS": "tests.workflows:ROLLED_OUT"})
    system.procs.wait_started("scheduler")
    system.restart("shipping")
    system.submit("v3-raw", version=3)  # the same submission again: admitted now
    latest = cli(system, "ROLLED_OUT", "submit", "orders", "--input", order("l"),
                 "--task-id", "v3-latest", "--await-version", "30")
    assert latest.returncode == 0, latest.stderr
    assert "submitted v3-latest (orders v3, the latest)" in latest.stdout
    stdout, stderr = waiting.communicate(timeout=180)
    assert waiting.returncode == 0, stdout + stderr
    new = ["v3-waited", "v3-raw", "v3-latest"]
    # v3-raw's first rejection is terminal: wait for what its repeat ended in.
    assert wait_for(lambda: all(system.statuses().get(t) == "completed" for t in [*old, *new]), timeout_s=90), \
        system.statuses()
    statuses = system.statuses()

    events = system.events()
    for task_id in old:
        assert {e.workflow_version for e in events if e.task_id == task_id} == {1}
    assert disagreements(system, statuses, old) == {}, "each v1 task reserved, charged and shipped once"
    for task_id in new:
        accepted = [e for e in events if e.task_id == task_id and isinstance(e, TaskAccepted)]
        assert [e.workflow_version for e in accepted] == [3]
        assert [e.step for e in events if e.task_id == task_id and isinstance(e, StepStarted)] == ["reserve", "ship"]
        assert sorted(called(system, task_id)) == ["inventory/reserve", "shipping/create"], "v3 charges nothing"
