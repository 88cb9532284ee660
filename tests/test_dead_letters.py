"""Poison messages go to the DLQ with their reason, and the partition moves on."""

from __future__ import annotations

import io
import sqlite3
from pathlib import Path

import pytest
from fastavro import schemaless_writer

from eventstore.dlq import read_dlq_headers
from eventstore.errors import InfrastructureError
from eventstore.producer import EventProducer
from eventstore.runtime import Record
from eventstore.topics import TopicLayout
from schemas.codec import MAGIC, default_codec
from schemas.messages import OperatorAlert
from tests.kafka_helpers import read_all, wait_for
from tests.runtime_harness import running

pytestmark = pytest.mark.kafka


def _alert(i: int, task_id: str = "task-1") -> OperatorAlert:
    return OperatorAlert(task_id=task_id, sequence=i, workflow="w", workflow_version=1, causation_id="c",
                         reason=f"alert {i}")


def _schema_invalid_bytes() -> bytes:
    """Valid Avro for OperatorAlert, but with sequence 0, which the model forbids (sequence >= 1)."""
    latest = default_codec().registry.latest("stepstream.OperatorAlert")
    record = dict(_alert(1))
    record["sequence"] = 0
    out = io.BytesIO()
    out.write(MAGIC + latest.fingerprint)
    schemaless_writer(out, latest.parsed, record)
    return out.getvalue()


def test_garbage_unknown_fingerprint_and_schema_invalid_go_to_dlq_and_later_messages_are_processed(
    bootstrap: str, layout: TopicLayout
) -> None:
    producer = EventProducer(bootstrap)
    producer.send(layout.inbox, _alert(1))
    producer.send_raw(layout.inbox, "task-1", b"\x00garbage bytes")
    producer.send_raw(layout.inbox, "task-1", MAGIC + b"\x01\x02\x03\x04\x05\x06\x07\x08" + b"\x02")
    producer.send_raw(layout.inbox, "task-1", _schema_invalid_bytes())
    producer.send(layout.inbox, _alert(2))
    producer.flush()

    handled: list[Record] = []
    with running(bootstrap, layout, layout.inbox, lambda record, _out: handled.append(record)) as runtime:
        assert wait_for(lambda: len(handled) == 2)
        dead = read_all(bootstrap, layout.dlq, expect=3)
    assert [r.message.reason for r in handled] == ["alert 1", "alert 2"]
    assert len(dead) == 3
    headers = [read_dlq_headers(m.headers()) for m in dead]
    assert [h["error.kind"] for h in headers] == ["corrupt", "unknown_schema", "schema_invalid"]
    first = dead[0]
    assert first.key() == b"task-1" and first.value() == b"\x00garbage bytes", "original bytes kept"
    for h in headers:
        assert h["origin.topic"] == layout.inbox
        assert h["consumer.group"] == runtime.group_id
        assert h["error.class"] == "DecodeError"
        assert h["reason"] and h["time"]
    assert [int(h["origin.offset"]) for h in headers] == [1, 2, 3]
    assert {h["origin.partition"] for h in headers} == {str(handled[0].partition)}


def test_handler_whose_database_is_down_is_retried_not_dead_lettered(
    bootstrap: str, layout: TopicLayout, tmp_path: Path
) -> None:
    db_dir = tmp_path / "db-not-there-yet"
    attempts: list[int] = []

    def write_row(record: Record, _out: EventProducer) -> None:
        attempts.append(record.offset)
        # sqlite cannot open a file in a missing folder: an OperationalError, like a database that is down.
        # The handler says the fault is the world's, not the message's: an InfrastructureError (retryable).
        try:
            with sqlite3.connect(db_dir / "state.db") as conn:
                conn.execute("create table if not exists seen (offset integer)")
                conn.execute("insert into seen values (?)", (record.offset,))
        except sqlite3.OperationalError as exc:
            raise InfrastructureError(f"database unavailable: {exc}") from exc

    producer = EventProducer(bootstrap)
    producer.send(layout.inbox, _alert(1))
    producer.flush()
    with running(bootstrap, layout, layout.inbox, write_row):
        assert wait_for(lambda: len(attempts) >= 3), "the handler was retried"
        db_dir.mkdir()  # the database comes back

        def row_written() -> bool:
            if not (db_dir / "state.db").exists():
                return False
            with sqlite3.connect(db_dir / "state.db") as conn:
                # The handler may have made the file but not yet its table: not written yet, ask again.
                exists = conn.execute("select 1 from sqlite_master where name = 'seen'").fetchone()
                return exists is not None and bool(conn.execute("select count(*) from seen").fetchone()[0] >= 1)

        assert wait_for(row_written)
    assert read_all(bootstrap, layout.dlq, expect=1, timeout_s=3) == []


def test_messages_behind_a_retried_one_are_processed_once_in_order(bootstrap: str, layout: TopicLayout) -> None:
    producer = EventProducer(bootstrap)
    for i in range(1, 31):
        producer.send(layout.inbox, _alert(i, task_id="one-key"))
    producer.flush()
    failures_left = [4]
    done: list[int] = []

    def flaky(record: Record, _out: EventProducer) -> None:
        if record.offset == 5 and failures_left[0] > 0:
            failures_left[0] -= 1
            raise ConnectionError("database connection reset")
        done.append(record.offset)

    with running(bootstrap, layout, layout.inbox, flaky):
        assert wait_for(lambda: len(done) >= 30, timeout_s=30)
        assert not wait_for(lambda: len(done) > 30, timeout_s=1)
    assert done == sorted(done) and len(set(done)) == 30, done
