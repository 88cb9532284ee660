"""Sensitive inputs on a real system (broker, order service, every service a process, PostgreSQL for the
outbox): a card token submitted every way in is nowhere in clear -- no topic's raw bytes, no state store
table, no outbox row, no dead letter, no service log, no metric -- while the payment service charges it;
erasing a task shreds its data key; rotating the master key keeps old tasks readable."""

from __future__ import annotations

import base64
import sqlite3
from collections.abc import Iterator
from typing import Any

import orjson
import psycopg
import pytest
from confluent_kafka.admin import AdminClient

from eventstore.keys import KeyProposer, StrayProposals, proposal_record, read_key_records, read_keys
from eventstore.producer import EventProducer
from eventstore.replay import LogRange, ReplayReader
from eventstore.settings import KafkaSettings
from scheduler.sealing import SubmissionSealer
from schemas.messages import AgentRequest, OperatorAlert, StepSucceeded, SubmitTask, TaskAccepted, TaskDataErased
from schemas.sealed import Keyring, SealingError, input_place, is_sealed
from stepstream.client import Client, SubmissionContradicts, outbox
from stepstream.client.outbox import OutboxRelay, OutboxSettings
from tests.kafka_helpers import wait_for
from tests.system import System
from tests.workflows import SENSITIVE_REGISTRY

pytestmark = pytest.mark.kafka

K1 = f"k1:{base64.b64encode(bytes(range(7, 39))).decode()}"
K2 = f"k2:{base64.b64encode(bytes(range(50, 82))).decode()}"
TOKEN = "shop-secret"


@pytest.fixture
def card_system(system: System) -> System:
    """The system on the paid-order workflow with master key k1; nothing started."""
    system.env.update({"STEPSTREAM_SCHEDULER_WORKFLOWS": "tests.workflows:SENSITIVE_REGISTRY",
                       "STEPSTREAM_ENCRYPTION_KEYS": K1,
                       "STEPSTREAM_API_TOKENS": orjson.dumps({"shop": TOKEN}).decode()})
    return system


def start(system: System) -> None:
    for name in ("inventory-release", "payments-refund", "shipping-cancel"):
        system.procs.service(name, "agent", name)
    system.start()
    for name in ("inventory-release", "payments-refund", "shipping-cancel"):
        system.procs.wait_started(name)


def order(order_id: str) -> dict[str, Any]:
    return {"order_id": order_id, "sku": "A-1", "qty": 1, "amount": 10, "card_token": f"tok_{order_id}_4242"}


def client(system: System, keys: str = K1) -> Client:
    kafka = KafkaSettings(bootstrap_servers=system.bootstrap, topic_prefix=system.layout.prefix,
                          partitions=system.layout.partitions)
    return Client(kafka=kafka, store_path=system.store_path, registry=SENSITIVE_REGISTRY, keyring=Keyring.parse(keys))


def every_topic(system: System) -> Iterator[tuple[str, bytes]]:
    """(topic, bytes) of each record's key, value and headers on every topic of the deployment, raw."""
    topics = AdminClient({"bootstrap.servers": system.bootstrap}).list_topics(timeout=30).topics
    for topic in sorted(t for t in topics if t.startswith(system.layout.prefix)):
        for msg in LogRange(system.bootstrap, topic):
            headers = b"".join(k.encode() + (v or b"") for k, v in msg.headers() or [])
            yield topic, (msg.key() or b"") + (msg.value() or b"") + headers


def key_copies(system: System, task_ids: set[str]) -> list[bytes]:
    """Every form in which the data keys of ``task_ids`` were ever on ``keys`` (as raw as it still holds them):
    each wrapped key, a task's own or one a submitter proposed, and each data key itself, raw and base64."""
    keyring = Keyring.parse(K1)
    copies: list[bytes] = []
    for msg in LogRange(system.bootstrap, system.layout.keys):
        task = (msg.key() or b"").decode().split("#")[0]
        if task in task_ids and msg.value() is not None:
            key = keyring.unwrap(msg.value().decode(), task).key
            copies += [msg.value(), key, base64.b64encode(key)]
    return copies


def holding(system: System, copies: list[bytes]) -> set[str]:
    """The topics other than ``keys`` whose raw bytes hold any of ``copies``."""
    return {topic for topic, data in every_topic(system)
            if topic != system.layout.keys and any(copy in data for copy in copies)}


def store_tables(system: System) -> str:
    """Every row of every table of the state store, as text."""
    with sqlite3.connect(system.store_path) as db:
        names = [r[0] for r in db.execute("select name from sqlite_master where type = 'table'")]
        return "\n".join(f"{name}: {db.execute(f'select * from {name}').fetchall()}" for name in names)


def service_logs(system: System) -> str:
    return "".join(system.procs.log(name) for name in system.procs.procs)


def charged_token(system: System, order_id: str) -> str | None:
    charges = list(system.admin.records(order_id)["charges"].values())
    return charges[0].get("card_token") if charges else None


def test_a_card_token_submitted_every_way_in_is_charged_yet_it_and_the_marked_output_are_nowhere_in_clear(
    card_system: System, postgres_url: str
) -> None:
    system = card_system
    start(system)
    http = system.start_api()
    tokens = {task: order(task)["card_token"] for task in ("by-client", "by-cli", "by-http", "by-outbox")}

    with client(system) as python:
        python.submit("orders-card", order("by-client"), task_id="by-client")
    cli = system.cli("submit", "orders-card", "--input", orjson.dumps(order("by-cli")).decode(), "--task-id", "by-cli")
    assert cli.returncode == 0, cli.stderr
    body = {"workflow": "orders-card", "input": order("by-http"), "task_id": "by-http"}
    headers = {"Authorization": f"Bearer {TOKEN}"}
    assert http.post("/api/tasks", json=body, headers=headers).status_code == 201
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        outbox.install(conn)
        with conn.transaction():
            outbox.enqueue(conn, SubmitTask(task_id="by-outbox", workflow="orders-card", input=order("by-outbox")),
                           registry=SENSITIVE_REGISTRY, keyring=Keyring.parse(K1))
        pending = str(conn.execute("select * from stepstream_outbox.outbox").fetchall())
        assert "tok_by-outbox" not in pending, "the outbox row holds the token sealed"
        with OutboxRelay(OutboxSettings(dsn=postgres_url), bootstrap=system.bootstrap,
                         topic=system.layout.inbox, keys_topic=system.layout.keys) as relay:
            assert relay.drain() == 1

    assert system.wait_terminal(tokens, timeout_s=90) == dict.fromkeys(tokens, "completed")
    for task, token in tokens.items():
        assert charged_token(system, task) == token, "the payments agent opened it for the service"

    # A repeat over HTTP seals under the task's own key and is known as the same submission; other data under
    # the same id is a contradiction the client refuses, and one sent past it is dead-lettered, sealed.
    assert http.post("/api/tasks", json=body, headers=headers).status_code == 200
    with client(system) as python, pytest.raises(SubmissionContradicts):
        python.submit("orders-card", {**order("by-client"), "card_token": "tok_other_9999"}, task_id="by-client")
    contradiction = SubmissionSealer(SENSITIVE_REGISTRY, Keyring.parse(K1)).seal(SubmitTask(
        task_id="by-cli", workflow="orders-card", input={**order("by-cli"), "card_token": "tok_other_9999"}))
    contradiction, = KeyProposer(system.bootstrap, system.layout.keys, system.layout.inbox).publish([contradiction])
    producer = EventProducer(system.bootstrap)
    producer.send(system.layout.inbox, contradiction)
    producer.flush()
    assert wait_for(lambda: any(isinstance(e, OperatorAlert) for e in system.events("by-cli")), timeout_s=30)
    assert wait_for(lambda: any(t == system.layout.dlq for t, _ in every_topic(system)), timeout_s=30)
    metrics = http.get("/metrics").text

    # charge marks its charge id: sealed by the payments agent in its answer, so on inbox too.
    charge_ids = [charge for task in tokens for charge in system.admin.records(task)["charges"]]
    assert len(charge_ids) == len(tokens)
    secrets = [*tokens.values(), "tok_other_9999", *charge_ids]
    raw = list(every_topic(system))
    seen = {topic for topic, _ in raw}
    assert {system.layout.inbox, system.layout.events, system.layout.keys, system.layout.dlq,
            system.layout.agent("payments")} <= seen
    tables, logs = store_tables(system), service_logs(system)
    for secret in secrets:
        assert not [topic for topic, data in raw if secret.encode() in data], f"{secret} in clear on a topic"
        assert secret not in tables, "nor in the state store"
        assert secret not in logs, "nor in a service's log"
        assert secret not in metrics, "nor in a metric"
    accepted = next(e for e in system.events("by-http") if isinstance(e, TaskAccepted))
    assert is_sealed(accepted.input["card_token"]) and accepted.input["order_id"] == "by-http"

    # Only charge is granted the card token: the payments agent's requests hold it sealed, the others' none.
    for agent, granted in (("inventory", False), ("payments", True), ("shipping", False)):
        requests = [r.message for r in ReplayReader(system.bootstrap, system.layout.agent(agent))
                    if isinstance(r.message, AgentRequest)]
        assert requests, agent
        assert all(("card_token" in r.input["task"]) == granted for r in requests), agent
        assert all(("card_token" in r.withheld) != granted for r in requests), agent

    # Each way in proposed its key on keys (none on inbox): the scheduler took it and tombstoned the proposal.
    copies = key_copies(system, set(tokens))
    assert len(copies) >= 3 * 2 * len(tokens), "each task's own key and the key proposed for it"
    assert holding(system, copies) == set(), "no data key, wrapped or not, on any other topic"
    proposals = read_key_records(system.bootstrap, system.layout.keys, {}).proposals
    assert {name.split("#")[0] for name in proposals} >= set(tokens)
    kept = proposal_record("by-cli", str(contradiction.key_ref))
    assert {name for name, wrapped in proposals.items() if wrapped is not None} == {kept}, \
        "every proposal taken and tombstoned, but the dead-lettered contradiction's: kept for a replay"
    # Erasing the task shreds the key of its dead letter too.
    erased = system.cli("task", "erase", "by-cli", "--wait")
    assert erased.returncode == 0, erased.stdout + erased.stderr
    assert wait_for(lambda: read_key_records(system.bootstrap, system.layout.keys, {}).proposals[kept] is None,
                    timeout_s=30)
    strays = StrayProposals(system.bootstrap, system.layout.keys)
    try:
        assert strays.find(kept) is None, "the erasure's tombstone is heeded by a scheduler's follower made afresh"
    finally:
        strays.close()
    http.close()


def test_an_erased_task_opens_nowhere_shows_erased_after_a_rebuild_and_cannot_be_compensated(
    card_system: System,
) -> None:
    system = card_system
    start(system)
    http = system.start_api()
    with client(system) as python:
        for task in ("forget-me", "keep-me", "forget-me-too"):
            python.submit("orders-card", order(task), task_id=task)
        assert {python.wait(task).status for task in ("forget-me", "keep-me", "forget-me-too")} == {"completed"}
    copies = key_copies(system, {"forget-me"})

    erase = system.cli("task", "erase", "forget-me", "--wait")
    assert erase.returncode == 0, erase.stderr + erase.stdout
    assert "task data erased" in erase.stdout
    erased = [e for e in system.events("forget-me") if isinstance(e, TaskDataErased)]
    assert len(erased) == 1
    by_http = http.post("/api/tasks/forget-me-too/commands", json={"action": "erase"},
                        headers={"Authorization": f"Bearer {TOKEN}"})
    assert by_http.status_code == 200 and by_http.json()["detail"] == "task data erased: its data key is deleted"
    http.close()

    records = read_key_records(system.bootstrap, system.layout.keys, {})
    keys = records.tasks
    assert keys["forget-me"] is None and keys["forget-me-too"] is None, "the tombstone is the last word on keys"
    assert [wrapped for name, wrapped in records.proposals.items() if name.startswith("forget-me#")] == [None]
    assert holding(system, copies) == set(), "inbox, events, agent topics, dlq: no copy of the erased key"
    wrapped = keys["keep-me"]
    assert wrapped is not None
    keyring = Keyring.parse(K1)
    kept = next(e for e in system.events("keep-me") if isinstance(e, TaskAccepted))
    assert keyring.unwrap(wrapped, "keep-me").unseal(kept.input["card_token"], input_place("keep-me", "card_token")) \
        == order("keep-me")["card_token"], "the other task is untouched"
    gone = next(e for e in system.events("forget-me") if isinstance(e, TaskAccepted))
    with pytest.raises(SealingError):  # not even the other task's key opens it: each task has its own
        keyring.unwrap(wrapped, "keep-me").unseal(gone.input["card_token"], input_place("forget-me", "card_token"))

    refused = system.cli("task", "compensate", "forget-me", "--wait")
    assert refused.returncode == 6
    assert "task data erased: its input and outputs open nowhere" in refused.stdout

    assert wait_for(lambda: (system.task("forget-me") or {}).get("erased_at") is not None, timeout_s=30)
    shown = system.cli("status", "forget-me")
    assert shown.returncode == 0 and "data erased at" in shown.stdout, shown.stdout + shown.stderr
    assert "erased" not in system.cli("status", "keep-me").stdout
    system.procs.terminate("projector")
    rebuilt = system.cli("projections", "rebuild", "--no-progress")
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert (system.task("forget-me") or {}).get("erased_at") is not None, "the rebuilt store shows it erased"
    assert (system.task("keep-me") or {}).get("erased_at") is None
    verified = system.cli("projections", "verify", "--no-progress")
    assert verified.returncode == 0, verified.stdout + verified.stderr

    # The scheduler restores a partition holding an erased task (its values left sealed) and runs on.
    system.procs.terminate("scheduler")
    system.restart("scheduler")
    system.restart("projector")
    with client(system) as python:
        python.submit("orders-card", order("after-erase"), task_id="after-erase")
        assert python.wait("after-erase", timeout_s=60).status == "completed"
    charge = next(e for e in system.events("forget-me") if isinstance(e, StepSucceeded) and e.step == "charge")
    assert is_sealed(charge.output["charge_id"])


def test_a_finished_tasks_card_data_is_erased_when_its_workflows_retention_runs_out(card_system: System) -> None:
    system = card_system
    start(system)
    with client(system) as python:
        python.submit("orders-card-brief", order("brief"), task_id="brief")
        python.submit("orders-card", order("kept"), task_id="kept")
        assert python.wait("brief").status == python.wait("kept").status == "completed"
    shown = system.task("brief") or {}
    assert shown["erase_due_at"] is not None and shown["retention_ms"] == 2000, "when it will be erased is visible"
    assert (system.task("kept") or {})["erase_due_at"] is None, "a workflow without retention keeps it"

    assert wait_for(lambda: (system.task("brief") or {}).get("erased_at") is not None, timeout_s=30)
    erased = system.task("brief") or {}
    assert erased["erased_by"] == "retention" and erased["erased_at"] >= erased["erase_due_at"]
    assert [e.operator for e in system.events("brief") if isinstance(e, TaskDataErased)] == ["retention"]
    keys = read_keys(system.bootstrap, system.layout.keys, {})
    assert keys["brief"] is None and keys["kept"] is not None


def test_a_new_master_key_seals_new_tasks_old_ones_still_open_and_their_keys_are_rewrapped(card_system: System) -> None:
    system = card_system
    start(system)
    with client(system) as python:
        python.submit("orders-card", order("before-rotation"), task_id="before-rotation")
        assert python.wait("before-rotation").status == "completed"
    still = system.cli("keys", "report", "--retiring", "k1", "--json")
    assert still.returncode == 3, "k1 wraps a task's key: not to be deleted yet"
    assert orjson.loads(still.stdout)["data_keys"] == {"k1": 1}

    system.env["STEPSTREAM_ENCRYPTION_KEYS"] = f"{K2},{K1}"
    for name in ("scheduler", "inventory", "payments", "shipping"):
        system.procs.terminate(name)
        system.restart(name)
    with client(system, f"{K2},{K1}") as python:
        python.submit("orders-card", order("after-rotation"), task_id="after-rotation")
        assert python.wait("after-rotation", timeout_s=60).status == "completed"
        python.submit("orders-card", order("before-rotation"), task_id="before-rotation")  # a repeat: no-op

    assert str(read_keys(system.bootstrap, system.layout.keys, {})["after-rotation"]).startswith("k2:")
    assert charged_token(system, "after-rotation") == order("after-rotation")["card_token"]
    # The repeat went to the old task's partition: the scheduler rewrapped its data key under k2 there.
    assert wait_for(lambda: str(read_keys(system.bootstrap, system.layout.keys, {})["before-rotation"])
                    .startswith("k2:"), timeout_s=30)
    rewrapped = str(read_keys(system.bootstrap, system.layout.keys, {})["before-rotation"])
    accepted = next(e for e in system.events("before-rotation") if isinstance(e, TaskAccepted))
    assert Keyring.parse(K2).unwrap(rewrapped, "before-rotation").unseal(
        accepted.input["card_token"], input_place("before-rotation", "card_token")) \
        == order("before-rotation")["card_token"], "opens without the retired key: the log was not rewritten"
    assert len([e for e in system.events("before-rotation") if isinstance(e, TaskAccepted)]) == 1
    retired = system.cli("keys", "report", "--retiring", "k1")
    assert retired.returncode == 0, retired.stdout + retired.stderr
    assert "k1: wraps no data key: it may be deleted" in retired.stdout
    assert [line.split() for line in retired.stdout.splitlines() if line.startswith("k2")] == [["k2", "2", "0"]]
    assert not any(isinstance(e, OperatorAlert) for e in system.events("before-rotation")), \
        "the repeat sealed under the old task's key (opened with the old master key) is no contradiction"


def test_a_scheduler_without_a_key_for_a_workflow_marking_inputs_refuses_to_start(card_system: System) -> None:
    system = card_system
    system.env["STEPSTREAM_ENCRYPTION_KEYS"] = ""
    system.procs.service("scheduler", "scheduler")
    assert wait_for(lambda: not system.procs.alive("scheduler"), timeout_s=60)
    log = system.procs.log("scheduler")
    assert "workflows orders-card v1, orders-card-brief v1 mark sensitive data but no encryption key" in log
    assert K1.split(":")[1] not in log


def test_a_card_token_the_service_says_back_in_its_refusal_and_its_answer_is_nowhere_in_clear(
    card_system: System,
) -> None:
    """The order service names a blocked card in its 422 and echoes a charged card in its answer: the agent
    that opened the token masks it in its answer and its log, so topics, store, logs, API and CLI never hold
    it, while the service's own records show the one refused and the other charged."""
    system = card_system
    start(system)
    http = system.start_api()
    tokens = {"refused": "tok_blocked_5500_0000_0004", "echoed": "tok_echoed_4242_4242_4242"}
    with client(system) as python:
        for task, token in tokens.items():
            python.submit("orders-card", {**order(task), "card_token": token}, task_id=task)
    assert system.wait_terminal(tokens, timeout_s=90) == {"refused": "compensated", "echoed": "completed"}
    assert system.admin.records("refused")["charges"] == {}, "the service refused the blocked card"
    assert charged_token(system, "echoed") == tokens["echoed"], "and charged the other, opened for it"

    charged = next(e for e in system.events("echoed") if isinstance(e, StepSucceeded) and e.step == "charge")
    assert charged.output["card_token"] == "[sealed]" and is_sealed(charged.output["charge_id"]), \
        "the echo, an unmarked field, is masked; the marked field is sealed"
    shown = {task: http.get(f"/api/tasks/{task}").text for task in tokens}
    assert "card [sealed] is blocked" in shown["refused"], "why it failed is still told, the token masked"
    cli = [system.cli("status", task, *json) for task in tokens for json in ((), ("--json",))]
    assert all(run.returncode in (0, 4) for run in cli), [run.stderr for run in cli]
    assert "[sealed]" in "".join(run.stdout for run in cli)
    store = b"".join(path.read_bytes() for path in system.store_path.parent.glob(f"{system.store_path.name}*"))
    raw = list(every_topic(system))
    assert {system.layout.inbox, system.layout.events, system.layout.agent("payments")} <= {t for t, _ in raw}
    logs = service_logs(system)
    assert "card [sealed] is blocked" in logs, "the payments agent logged the refusal, masked"
    for token in tokens.values():
        assert not [topic for topic, data in raw if token.encode() in data], f"{token} in clear on a topic"
        assert token.encode() not in store, "nor in the state store's file"
        assert token not in logs, "nor in a service's log"
        assert not [task for task, body in shown.items() if token in body], "nor in the API"
        assert not [run.args for run in cli if token in run.stdout + run.stderr], "nor in the CLI"
    http.close()
