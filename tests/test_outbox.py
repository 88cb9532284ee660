"""Dual write: the transactional outbox (stepstream.client.outbox) and the example application that uses it.

Real PostgreSQL (tests/postgres.py) and the real broker: a committed order's submission reaches inbox
once, a rolled-back one never; a relay killed between its produce and its commit re-sends, and the task
still runs once; two relays share the rows with none lost; bad settings and input name the field.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from confluent_kafka import KafkaException
from prometheus_client import REGISTRY

from eventstore.producer import is_retriable
from eventstore.replay import ReplayReader
from eventstore.topics import TopicLayout
from examples.outbox_app import install as install_app
from examples.outbox_app import place_order, place_order_and_submit, submission_for, task_id_for
from schemas.messages import SubmitTask, TaskAccepted
from stepstream.client import Client, InvalidSubmission, outbox
from stepstream.client.outbox import InvalidOutboxInput, OutboxError, OutboxRelay, OutboxRow, OutboxSettings
from tests.kafka_helpers import wait_for
from tests.system import System

ROOT = Path(__file__).parent.parent
ORDER = {"order_id": "o-1", "sku": "A-1", "qty": 1, "amount": 10}


@pytest.fixture
def conn(postgres_url: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(postgres_url, autocommit=True) as connection:
        install_app(connection)
        yield connection


def _relay(postgres_url: str, bootstrap: str, layout: TopicLayout, **settings: Any) -> OutboxRelay:
    return OutboxRelay(OutboxSettings(dsn=postgres_url, **settings), bootstrap=bootstrap, topic=layout.inbox,
                       keys_topic=layout.keys)


def _submissions(bootstrap: str, layout: TopicLayout) -> list[SubmitTask]:
    """The submissions on inbox up to its end now (every relay waited for acks=all before returning); with a
    system running, the agents' acknowledgements of the tasks' attempts are there too, and are not counted."""
    for attempt in range(20):
        try:
            records = list(ReplayReader(bootstrap, layout.inbox))
            break
        except KafkaException as exc:  # a topic this new may still be electing its partitions' leaders
            if attempt == 19 or not is_retriable(exc):
                raise
            time.sleep(0.5)
    out = []
    for record in records:
        if isinstance(record.message, SubmitTask):
            assert record.key == record.message.task_id
            out.append(record.message)
    return out


def _submission(order_id: str) -> SubmitTask:
    return submission_for({**ORDER, "order_id": order_id})


def _pending(conn: psycopg.Connection[Any]) -> int:
    return outbox.backlog(conn).pending


@pytest.mark.kafka
def test_a_committed_order_is_submitted_exactly_once(
    conn: psycopg.Connection[Any], postgres_url: str, bootstrap: str, layout: TopicLayout
) -> None:
    task_id = place_order(conn, ORDER)
    assert task_id == task_id_for("o-1") and _pending(conn) == 1
    before = REGISTRY.get_sample_value("stepstream_outbox_relayed_total", {"schema": outbox.DEFAULT_SCHEMA}) or 0
    with _relay(postgres_url, bootstrap, layout, keep_sent=True) as relay:
        assert relay.drain() == 1
        assert relay.drain() == 0, "a sent row is never claimed again"
    after = REGISTRY.get_sample_value("stepstream_outbox_relayed_total", {"schema": outbox.DEFAULT_SCHEMA})
    assert after == before + 1
    assert REGISTRY.get_sample_value("stepstream_outbox_pending", {"schema": outbox.DEFAULT_SCHEMA}) == 0
    sent = conn.execute("select task_id, sent_at from stepstream_outbox.outbox").fetchall()
    assert [row[0] for row in sent] == [task_id] and sent[0][1] is not None, "keep_sent marks instead of deleting"
    submissions = _submissions(bootstrap, layout)
    assert len(submissions) == 1
    assert submissions[0].task_id == task_id and submissions[0].input == ORDER and submissions[0].workflow_version == 1


@pytest.mark.kafka
def test_a_rolled_back_order_submits_nothing(
    conn: psycopg.Connection[Any], postgres_url: str, bootstrap: str, layout: TopicLayout
) -> None:
    with pytest.raises(RuntimeError), conn.transaction():
        conn.execute("insert into orders (order_id, sku, qty, amount, task_id) values ('o-2', 'A-1', 1, 10, 'x')")
        outbox.enqueue(conn, _submission("o-3"))
        raise RuntimeError("the application changed its mind")
    place_order(conn, ORDER)
    with pytest.raises(psycopg.errors.UniqueViolation):
        place_order(conn, ORDER)  # the business write fails: its enqueue goes with it
    assert conn.execute("select count(*) from orders").fetchone() == (1,)
    with _relay(postgres_url, bootstrap, layout) as relay:
        assert relay.drain() == 1
    assert conn.execute("select count(*) from stepstream_outbox.outbox").fetchone() == (0,), "sent rows deleted"
    submissions = _submissions(bootstrap, layout)
    assert [s.task_id for s in submissions] == [task_id_for("o-1")]


CRASHING_RELAY = """
import os, sys
from stepstream.client.outbox import OutboxRelay, OutboxSettings

class Crash(OutboxRelay):
    def after_produce(self, rows):
        print("acknowledged", [row.task_id for row in rows], flush=True)
        os._exit(137)  # no rollback, no goodbye: the process is gone, its locks die with its connection

Crash(OutboxSettings(dsn=sys.argv[1]), bootstrap=sys.argv[2], topic=sys.argv[3], keys_topic=sys.argv[4]).relay_once()
"""


@pytest.mark.kafka
def test_a_relay_killed_between_produce_and_mark_resends_and_the_task_still_runs_once(
    system: System, conn: psycopg.Connection[Any], postgres_url: str
) -> None:
    system.start()
    order = {**ORDER, "order_id": "crash-1"}
    task_id = place_order(conn, order)
    crashed = subprocess.run([sys.executable, "-c", CRASHING_RELAY, postgres_url, system.bootstrap,
                              system.layout.inbox, system.layout.keys], env=system.env, cwd=ROOT,
                             capture_output=True, text=True, timeout=60, check=False)
    assert crashed.returncode == 137, crashed.stderr
    assert task_id in crashed.stdout, "it produced (acks=all) before it died"
    assert _pending(conn) == 1, "the row is still unsent"
    with _relay(postgres_url, system.bootstrap, system.layout) as relay:
        assert wait_for(lambda: relay.drain() == 1 or _pending(conn) == 0, timeout_s=20)
    assert _pending(conn) == 0
    copies = _submissions(system.bootstrap, system.layout)
    assert [s.task_id for s in copies] == [task_id, task_id], "the restarted relay sent it again"
    assert system.wait_terminal([task_id], timeout_s=40) == {task_id: "completed"}
    assert len([e for e in system.events(task_id) if isinstance(e, TaskAccepted)]) == 1
    assert system.admin.applied_for("payments/charge", f"{task_id}:charge") == 1


class _SlowRelay(OutboxRelay):
    """Holds each claimed batch a little, so the two relays really do run side by side."""

    def after_produce(self, rows: list[OutboxRow]) -> None:
        threading.Event().wait(0.02)


@pytest.mark.kafka
def test_two_relays_share_the_rows_and_lose_none(
    conn: psycopg.Connection[Any], postgres_url: str, bootstrap: str, layout: TopicLayout
) -> None:
    n = 150
    with conn.transaction():
        for i in range(n):
            outbox.enqueue(conn, _submission(f"many-{i}"))
    stop = threading.Event()
    settings = OutboxSettings(dsn=postgres_url, batch_size=10, poll_interval_s=0.05)
    relays = [_SlowRelay(settings, bootstrap=bootstrap, topic=layout.inbox, keys_topic=layout.keys,
                         stop=stop) for _ in range(2)]
    threads = [threading.Thread(target=relay.run) for relay in relays]
    for thread in threads:
        thread.start()
    try:
        assert wait_for(lambda: _pending(conn) == 0, timeout_s=30)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=30)
        for relay in relays:
            relay.close()
    counts = [relay.relayed for relay in relays]
    assert sum(counts) == n and min(counts) > 0, counts
    ids = [s.task_id for s in _submissions(bootstrap, layout)]
    assert len(ids) == n and set(ids) == {task_id_for(f"many-{i}") for i in range(n)}, "each row once, none lost"


@pytest.mark.kafka
def test_the_retry_variant_submits_what_was_committed_under_the_same_id(
    conn: psycopg.Connection[Any], bootstrap: str, layout: TopicLayout
) -> None:
    from eventstore.settings import KafkaSettings

    kafka = KafkaSettings(bootstrap_servers=bootstrap, topic_prefix=layout.prefix, partitions=layout.partitions)
    with Client(kafka=kafka) as client:
        first = place_order_and_submit(conn, client, {**ORDER, "order_id": "r-1"})
        again = place_order_and_submit(conn, client, {**ORDER, "order_id": "r-1", "qty": 7})  # the caller retries
    assert first == again == task_id_for("r-1")
    submissions = _submissions(bootstrap, layout)
    assert [s.task_id for s in submissions] == [first, first]
    assert submissions[0].input == submissions[1].input == {**ORDER, "order_id": "r-1"}, "the committed order"


@pytest.mark.kafka
def test_the_relay_command_relays_and_drains_on_sigterm(
    conn: psycopg.Connection[Any], postgres_url: str, bootstrap: str, layout: TopicLayout, test_env: dict[str, str]
) -> None:
    env = {**test_env, "STEPSTREAM_OUTBOX_DSN": postgres_url, "STEPSTREAM_OUTBOX_POLL_INTERVAL_S": "0.05"}
    proc = subprocess.Popen([sys.executable, "-m", "stepstream", "outbox", "relay"], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        place_order(conn, ORDER)
        assert wait_for(lambda: _pending(conn) == 0 or proc.poll() is not None, timeout_s=30)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "relayed 1" in out and '"outbox relay stopped"' in err
    assert [s.task_id for s in _submissions(bootstrap, layout)] == [task_id_for("o-1")]


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"batch_size": 0}, "batch_size"),
        ({"poll_interval_s": -1}, "poll_interval_s"),
        ({"dsn": "mysql://db/app"}, "dsn"),
        ({"db_schema": "orders; drop table orders"}, "db_schema"),
    ],
)
def test_invalid_settings_are_refused_naming_the_field(overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidOutboxInput) as caught:
        outbox.load_settings(**overrides)
    assert caught.value.field == field


def test_settings_from_the_environment_name_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STEPSTREAM_OUTBOX_BATCH_SIZE", "lots")
    with pytest.raises(InvalidOutboxInput) as caught:
        outbox.load_settings()
    assert caught.value.field == "STEPSTREAM_OUTBOX_BATCH_SIZE"
    monkeypatch.delenv("STEPSTREAM_OUTBOX_BATCH_SIZE")
    monkeypatch.delenv("STEPSTREAM_STORE_URL", raising=False)
    with pytest.raises(InvalidOutboxInput) as caught:
        OutboxSettings().resolved_dsn()
    assert caught.value.field == "STEPSTREAM_OUTBOX_DSN", "no DSN, and the state store is SQLite"
    monkeypatch.setenv("STEPSTREAM_STORE_URL", "postgresql://app@db:5432/shop?schema=projections")
    assert OutboxSettings().resolved_dsn() == "postgresql://app@db:5432/shop", "the store's database by default"
    with pytest.raises(InvalidOutboxInput) as caught:
        OutboxSettings(db_schema="projections").resolved_dsn()
    assert caught.value.field == "STEPSTREAM_OUTBOX_DB_SCHEMA", "a projections rebuild would drop the outbox"


def test_invalid_input_is_refused_naming_the_field_and_writes_nothing(conn: psycopg.Connection[Any]) -> None:
    with pytest.raises(InvalidOutboxInput) as bad_schema:
        outbox.install(conn, "x; drop schema public")
    assert bad_schema.value.field == "schema"
    with pytest.raises(InvalidOutboxInput) as bad_submission, conn.transaction():
        outbox.enqueue(conn, {"task_id": "t"})  # type: ignore[arg-type]
    assert bad_submission.value.field == "submission"
    with pytest.raises(OutboxError, match="transaction"):
        outbox.enqueue(conn, _submission("alone"))  # autocommit, outside a transaction: would commit alone
    unpriced = submission_for(ORDER).model_copy(update={"input": {k: v for k, v in ORDER.items() if k != "amount"}})
    with pytest.raises(InvalidOutboxInput) as bad_input, conn.transaction():
        outbox.enqueue(conn, unpriced)  # the orders workflow's input model needs an amount
    assert (bad_input.value.field, str(bad_input.value)) == ("input.amount", "input.amount: Field required")
    for order, field in [({**ORDER, "order_id": ""}, "order_id"), ({**ORDER, "qty": 0}, "qty")]:
        with pytest.raises(InvalidSubmission) as bad_order:
            place_order(conn, order)
        assert bad_order.value.field == field
    assert conn.execute("select count(*) from orders").fetchone() == (0,)
    assert _pending(conn) == 0


def test_the_relay_command_refuses_bad_settings_naming_the_variable() -> None:
    env = {**os.environ, "STEPSTREAM_OUTBOX_DSN": "postgresql://nobody@127.0.0.1:1/none",
           "STEPSTREAM_OUTBOX_BATCH_SIZE": "0"}
    done = subprocess.run([sys.executable, "-m", "stepstream", "outbox", "relay", "--once"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and "STEPSTREAM_OUTBOX_BATCH_SIZE" in done.stderr, done.stderr
