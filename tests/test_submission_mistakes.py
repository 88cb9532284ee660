"""The mistakes a newcomer makes on the submission path, and the answer each gets: the message, the exit
code, and that nothing reaches ``inbox`` when the command is refused before producing. Real broker, real
store, ``stepstream`` run as a process; the scheduler and projector run only where the answer needs them.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from eventstore.dlq import read_dlq_headers
from eventstore.settings import KafkaSettings
from schemas.messages import TaskAccepted
from stepstream.client import Client, InvalidSubmission
from tests.kafka_helpers import read_all, read_to_end, wait_for
from tests.system import ROOT, System
from tests.workflows import REGISTRY

pytestmark = pytest.mark.kafka

ORDER = '{"order_id": "o-1", "sku": "A-1", "qty": 1, "amount": 10}'
OTHER_ORDER = '{"order_id": "o-1", "sku": "A-1", "qty": 5, "amount": 50}'
WORKFLOWS = ", ".join(sorted({w.name for w in REGISTRY.workflows()}))  # what the system's scheduler runs


def _nothing_on_inbox(system: System) -> bool:
    return read_to_end(system.bootstrap, system.layout.inbox) == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["ordres"], f"invalid workflow: no workflow named 'ordres' (this deployment runs {WORKFLOWS})"),
        (["orders", "--version", "9"], "invalid version: workflow 'orders' has no version 9 (it has 1, 2)"),
    ],
    ids=["misspelled workflow", "unknown version"],
)
def test_cli_submit_of_an_unknown_workflow_or_version_exits_2_naming_the_field_and_produces_nothing(
    system: System, args: list[str], message: str,
) -> None:
    done = system.cli("submit", *args, "--input", ORDER, "--wait", "--timeout", "60")
    assert (done.returncode, done.stderr.strip()) == (2, f"stepstream submit: {message}")
    assert done.stdout == "" and _nothing_on_inbox(system)


def test_client_submit_of_an_unknown_workflow_or_version_raises_naming_the_field_and_produces_nothing(
    system: System,
) -> None:
    kafka = KafkaSettings(bootstrap_servers=system.bootstrap, topic_prefix=system.layout.prefix)
    with Client(kafka=kafka, store_path=system.store_path, registry=REGISTRY) as client:
        with pytest.raises(InvalidSubmission) as workflow:
            client.submit("ordres", {})
        with pytest.raises(InvalidSubmission) as version:
            client.submit("orders", {}, version=99)
    assert (workflow.value.field, version.value.field) == ("workflow", "version")
    assert _nothing_on_inbox(system)


def test_cli_submit_of_an_input_the_workflows_model_refuses_exits_2_naming_the_field_and_produces_nothing(
    system: System,
) -> None:
    done = system.cli("submit", "orders-typed", "--input", '{"order_id": "o-1", "sku": "A-1", "qty": 1}')
    assert (done.returncode, done.stderr.strip()) == (2, "stepstream submit: invalid input.amount: Field required")
    wrong = system.cli("submit", "orders-typed", "--input", '{"order_id": "o-1", "sku": "A-1", "qty": "one", '
                                                            '"amount": 1}')
    assert (wrong.returncode, wrong.stderr.strip()) == (
        2, "stepstream submit: invalid input.qty: Input should be a valid integer, unable to parse string as an "
           "integer")
    assert _nothing_on_inbox(system)


def test_cli_submit_help_lists_each_workflow_and_its_input_fields(system: System) -> None:
    shown = system.cli("submit", "--help")
    assert shown.returncode == 0
    assert ("orders-typed v1: order_id (string, required), sku (string, required), qty (integer, required), "
            "amount (number, required)") in shown.stdout
    assert "orders v1: any JSON object" in shown.stdout


def test_cli_submit_wait_that_times_out_exits_124_saying_the_wait_timed_out(system: System) -> None:
    done = system.cli("submit", "orders", "--input", ORDER, "--task-id", "slow", "--wait", "--timeout", "1")
    assert (done.returncode, done.stderr.strip()) == (
        124, "stepstream submit: --wait timed out: task slow not finished after 1.0s (not seen yet)")


def test_cli_submit_of_a_known_id_with_other_data_exits_6_as_a_contradiction_and_produces_nothing(
    system: System,
) -> None:
    system.start("scheduler", "projector")  # no agents: the first task stays running, which is enough
    system.submit("clash", {"order_id": "o-1", "sku": "A-1", "qty": 1, "amount": 10}, version=1)
    assert wait_for(lambda: system.task("clash") is not None, timeout_s=60), system.logs_tail()
    done = system.cli("submit", "orders", "--version", "1", "--input", OTHER_ORDER, "--task-id", "clash", "--wait")
    assert (done.returncode, done.stderr.strip()) == (
        6, "stepstream submit: refused as a contradiction: task 'clash' exists with other data "
           "(orders v1, running); nothing was submitted")
    assert len(read_to_end(system.bootstrap, system.layout.inbox)) == 1


def test_cli_submit_wait_of_a_contradiction_the_store_had_not_seen_yet_exits_6_with_the_schedulers_reason(
    system: System,
) -> None:
    system.start("scheduler")  # the projector comes later: the store cannot know the task at submit time
    system.submit("late-clash", {"order_id": "o-1", "sku": "A-1", "qty": 1, "amount": 10}, version=1)
    assert wait_for(lambda: any(isinstance(e, TaskAccepted) for e in system.events("late-clash")), timeout_s=60)
    waiting = subprocess.Popen(
        [sys.executable, "-m", "stepstream", "submit", "orders", "--version", "1", "--input", OTHER_ORDER,
         "--task-id", "late-clash", "--wait", "--timeout", "120"],
        env=system.env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    dead = read_all(system.bootstrap, system.layout.dlq, expect=1, timeout_s=60)
    assert len(dead) == 1 and "contradictory" in read_dlq_headers(dead[0].headers())["reason"]
    system.start("projector")
    out, err = waiting.communicate(timeout=120)
    assert waiting.returncode == 6, (out, err)
    assert err.startswith("stepstream submit: refused as a contradiction: task 'late-clash' was refused by the "
                          "scheduler: contradictory duplicate submission of task 'late-clash'")
    assert err.rstrip().endswith("the existing task is untouched")


def test_task_cancel_of_an_unknown_id_exits_3_and_sends_nothing(system: System) -> None:
    done = system.cli("task", "cancel", "typo")
    assert (done.returncode, done.stdout.strip()) == (
        3, "no task 'typo' in the state store or the event log; nothing was sent")
    assert _nothing_on_inbox(system)
