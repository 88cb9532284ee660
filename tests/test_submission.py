"""The submission path: the Python client and the CLI, idempotency, admission control, reply topics."""

from __future__ import annotations

from pathlib import Path

import pytest

from eventstore.dlq import read_dlq_headers
from eventstore.settings import KafkaSettings
from schemas.messages import OperatorAlert, StatusUpdate, TaskAccepted
from stepstream.client import Client, InvalidSubmission, SubmissionContradicts, SubmissionRejected
from tests.kafka_helpers import read_all, wait_for
from tests.system import System
from tests.workflows import REGISTRY

pytestmark = pytest.mark.kafka

ORDER = {"order_id": "o-1", "sku": "A-1", "qty": 1, "amount": 10}


def _client(system: System, submitter: str | None = None) -> Client:
    kafka = KafkaSettings(bootstrap_servers=system.bootstrap, topic_prefix=system.layout.prefix,
                          partitions=system.layout.partitions)
    return Client(kafka=kafka, submitter=submitter, store_path=system.store_path, registry=REGISTRY)


def test_the_same_task_submitted_twice_runs_once(system: System) -> None:
    system.start()
    with _client(system) as client:
        client.submit("orders", ORDER, version=1, task_id="twice")
        client.submit("orders", ORDER, version=1, task_id="twice")
        assert client.wait("twice").status == "completed"
    accepted = [e for e in system.events("twice") if isinstance(e, TaskAccepted)]
    assert len(accepted) == 1
    assert system.admin.applied_for("payments/charge", "twice:charge") == 1


def test_the_same_id_with_other_data_is_dead_lettered_with_an_alert_and_the_first_task_is_untouched(
    system: System,
) -> None:
    system.start()
    with _client(system) as client:
        client.submit("orders", ORDER, version=1, task_id="clash")
        first = client.wait("clash")
        with pytest.raises(SubmissionContradicts):  # the client refuses what the store shows to contradict...
            client.submit("orders", {**ORDER, "qty": 5}, version=1, task_id="clash")
    system.submit("clash", {**ORDER, "qty": 5}, version=1)  # ...a producer that does not check reaches the log
    dead = read_all(system.bootstrap, system.layout.dlq, expect=1, timeout_s=30)
    assert len(dead) == 1 and "contradict" in read_dlq_headers(dead[0].headers())["reason"]
    events = system.events("clash")
    assert any(isinstance(e, OperatorAlert) and "contradict" in e.reason for e in events)
    accepted = next(e for e in events if isinstance(e, TaskAccepted))
    assert accepted.input["qty"] == 1, "nothing was overwritten"
    assert (system.task("clash") or {})["status"] == first.status == "completed"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"workflow": "", "input": ORDER}, "workflow"),
        ({"workflow": "orders", "input": [1, 2]}, "input"),
        ({"workflow": "orders", "input": ORDER, "task_id": ""}, "task_id"),
        ({"workflow": "orders", "input": ORDER, "version": 0}, "version"),
    ],
)
def test_an_invalid_submission_names_the_field_and_produces_nothing(
    system: System, kwargs: dict[str, object], field: str
) -> None:
    with _client(system) as client, pytest.raises(InvalidSubmission) as caught:
        client.submit(**kwargs)  # type: ignore[arg-type]
    assert caught.value.field == field
    assert read_all(system.bootstrap, system.layout.inbox, expect=1, timeout_s=2) == []


def test_a_submitter_following_its_reply_topic_hears_its_own_tasks_from_accepted_to_completed(
    system: System,
) -> None:
    system.start()
    with _client(system, submitter="shop-a") as shop_a, _client(system, submitter="shop-b") as shop_b:
        ours = [shop_a.submit("orders", {**ORDER, "order_id": f"a{i}"}, version=1, task_id=f"a-{i}") for i in range(3)]
        theirs = shop_b.submit("orders", ORDER, version=1, task_id="b-0")
        for task_id in [*ours, theirs]:
            shop_a.wait(task_id)
        updates: list[StatusUpdate] = list(shop_a.updates(timeout_s=30, idle_s=3))
    assert {u.task_id for u in updates} == set(ours), "nothing about other submitters' tasks"
    for task_id in ours:
        statuses = [u.status for u in updates if u.task_id == task_id]
        assert statuses[0] == "accepted" and statuses[-1] == "completed", statuses
        assert statuses.count("step_succeeded") == 3


def test_past_the_in_flight_bound_submissions_are_rejected_visibly_and_admitted_when_retried_later(
    system: System,
) -> None:
    system.env["STEPSTREAM_SCHEDULER_MAX_IN_FLIGHT"] = "1"  # per inbox partition: at most 3 in flight
    system.admin.set_faults("inventory/reserve", hang=True, hang_max_s=60)  # the remote service is down
    system.start()
    ids = [f"bound-{i}" for i in range(12)]
    with _client(system) as client:
        for task_id in ids:
            client.submit("orders", {**ORDER, "order_id": task_id}, version=1, task_id=task_id)
        # Sorted by the scheduler's decisions once the state store shows every task, not by a timed wait
        # (which would count a task still undecided when it ran out as admitted).
        assert wait_for(lambda: set(system.statuses()) >= set(ids), 60), system.statuses()
        statuses = system.statuses()
        rejected = [t for t in ids if statuses[t] == "rejected"]
        admitted = [t for t in ids if t not in rejected]
        for task_id in rejected:  # the client sees each rejection
            with pytest.raises(SubmissionRejected):
                client.wait(task_id, timeout_s=30)
        assert rejected and 0 < len(admitted) <= system.layout.partitions
        system.admin.clear_faults("inventory/reserve")
        for task_id in admitted:
            assert client.wait(task_id, timeout_s=90).status == "completed"
        # Submitted again under the same id once there is room, a rejected task is admitted; waiting on the
        # retry is not answered by the earlier rejection.
        client.submit("orders", {**ORDER, "order_id": rejected[0]}, version=1, task_id=rejected[0])
        assert client.wait(rejected[0], timeout_s=60).status == "completed"


def test_cli_submit_waits_and_exit_codes_tell_scripts_what_happened(system: System, tmp_path: Path) -> None:
    system.start()
    done = system.cli("submit", "orders", "--version", "1", "--input", '{"order_id": "c1", "qty": 1}',
                "--task-id", "cli-1", "--wait", "--json")
    assert done.returncode == 0, done.stderr
    assert '"status":"completed"' in done.stdout
    (tmp_path / "bad.json").write_text('{"order_id": "c2", "qty": 0}')
    refused = system.cli("submit", "orders", "--version", "1", "--input", f"@{tmp_path / 'bad.json'}",
                   "--task-id", "cli-2", "--wait")
    assert refused.returncode == 4, "the service refused it: the task ended in error"
    invalid = system.cli("submit", "orders", "--input", "[1, 2]")
    assert invalid.returncode == 2 and "input" in invalid.stderr
    assert system.cli("status", "cli-1").returncode == 0
    missing = system.cli("status", "no-such-task")
    assert missing.returncode == 3 and "no-such-task" in missing.stderr
