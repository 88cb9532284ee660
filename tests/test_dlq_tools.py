"""``stepstream dlq list|show|replay`` against real dead letters, and the projector's dlq_entries table."""

from __future__ import annotations

import contextlib
import io
import threading
from pathlib import Path
from typing import Any

import orjson
import pytest
from confluent_kafka.admin import AdminClient

from eventstore.errors import PoisonMessageError
from eventstore.producer import EventProducer
from eventstore.runtime import Record
from eventstore.settings import ConsumerSettings
from eventstore.topics import TopicLayout
from projections.projector import DlqFollower
from projections.store import SqliteStore
from schemas.codec import default_codec
from stepstream.cli import main
from tests.kafka_helpers import read_all, wait_for
from tests.runtime_harness import running
from tests.test_dead_letters import _alert, _schema_invalid_bytes

pytestmark = pytest.mark.kafka


@pytest.fixture
def dead_letters(bootstrap: str, layout: TopicLayout, monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Three dead letters of inbox: corrupt bytes, a schema-invalid record, a contradictory message."""
    monkeypatch.setenv("STEPSTREAM_BOOTSTRAP_SERVERS", bootstrap)
    monkeypatch.setenv("STEPSTREAM_TOPIC_PREFIX", layout.prefix)
    monkeypatch.setenv("COLUMNS", "400")  # rich tables: one line per dead letter, whatever the terminal
    producer = EventProducer(bootstrap)
    producer.send(layout.inbox, _alert(1))
    producer.send_raw(layout.inbox, "task-1", b"\x00garbage bytes", [("trace", b"abc")])
    producer.send_raw(layout.inbox, "task-1", _schema_invalid_bytes())
    producer.send(layout.inbox, _alert(2).model_copy(update={"reason": "contradicts the first"}))
    producer.send(layout.inbox, _alert(3))
    producer.flush()
    handled: list[Record] = []

    def handler(record: Record, _out: EventProducer) -> None:
        if "contradicts" in record.message.reason:  # type: ignore[attr-defined]
            raise PoisonMessageError("same task id, other data")
        handled.append(record)

    with running(bootstrap, layout, layout.inbox, handler):
        assert wait_for(lambda: len(handled) == 2)
        assert len(read_all(bootstrap, layout.dlq, expect=3, timeout_s=30)) == 3
    return _list()


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _list() -> list[dict[str, Any]]:
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        assert main(["dlq", "list", "--json"]) == 0
    entries: list[dict[str, Any]] = orjson.loads(buffer.getvalue())
    return entries


def test_list_shows_every_dead_letter_with_its_reason_and_origin(
    dead_letters: list[dict[str, Any]], layout: TopicLayout, capsys: pytest.CaptureFixture[str],
) -> None:
    assert [e["error_kind"] for e in dead_letters] == ["corrupt", "schema_invalid", "contradictory"]
    assert [e["error_class"] for e in dead_letters] == ["DecodeError", "DecodeError", "PoisonMessageError"]
    assert dead_letters[2]["reason"] == "same task id, other data"
    assert {e["origin"]["topic"] for e in dead_letters} == {layout.inbox}
    assert [e["origin"]["offset"] for e in dead_letters] == [1, 2, 3]
    assert all(e["key"] == "task-1" and e["replays"] == [] and e["consumer_group"] for e in dead_letters)

    code, out, _err = _run(capsys, "dlq", "list")
    assert code == 0
    assert "3 dead letters, 3 neither replayed nor discarded" in out
    assert "contradictory" in out and "same task id" in out
    code, out, _err = _run(capsys, "dlq", "list", "--json", "--limit", "1")
    assert [e["entry"] for e in orjson.loads(out)] == [dead_letters[2]["entry"]]


def test_show_decodes_a_message_and_gives_undecodable_bytes_raw(
    dead_letters: list[dict[str, Any]], capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _err = _run(capsys, "dlq", "show", dead_letters[0]["entry"], "--json")
    corrupt = orjson.loads(out)
    assert code == 0
    assert corrupt["value"]["kind"] == "corrupt" and corrupt["value"]["hex"] == b"\x00garbage bytes".hex()
    assert corrupt["value"]["base64"] == "AGdhcmJhZ2UgYnl0ZXM="
    headers = {h["key"]: h for h in corrupt["headers"]}
    assert headers["trace"]["text"] == "abc", "the original headers are kept"
    assert headers["stepstream.dlq.error.kind"]["text"] == "corrupt"

    code, out, _err = _run(capsys, "dlq", "show", dead_letters[2]["entry"], "--json")
    contradictory = orjson.loads(out)
    assert contradictory["value"]["type"] == "OperatorAlert"
    assert contradictory["value"]["message"]["reason"] == "contradicts the first"

    code, out, _err = _run(capsys, "dlq", "show", dead_letters[2]["entry"])
    assert code == 0 and "same task id, other data" in out and "contradicts the first" in out


def test_replay_republishes_to_the_origin_once_and_records_it_on_the_log(
    dead_letters: list[dict[str, Any]], bootstrap: str, layout: TopicLayout, capsys: pytest.CaptureFixture[str],
) -> None:
    chosen = dead_letters[2]
    code, out, _err = _run(capsys, "dlq", "replay", chosen["entry"], "--dry-run", "--json")
    assert code == 0 and orjson.loads(out)[0]["skipped"] == "dry run"

    code, out, _err = _run(capsys, "dlq", "replay", chosen["entry"], "--json")
    [outcome] = orjson.loads(out)
    origin = chosen["origin"]
    assert code == 0 and outcome["replayed_to"].startswith(f"{layout.inbox}[{origin['partition']}]@")
    copy = next(m for m in read_all(bootstrap, layout.inbox, expect=6)
                if m.offset() == int(outcome["replayed_to"].rsplit("@", 1)[1]))
    assert copy.partition() == origin["partition"] and copy.key() == b"task-1"
    assert default_codec().decode(copy.value()).reason == "contradicts the first"  # type: ignore[attr-defined]
    assert dict(copy.headers() or [])["stepstream.replayed.from"] == f"{layout.dlq}[{chosen['partition']}]@" \
                                                                      f"{chosen['offset']}".encode()

    [after] = [e for e in _list() if e["entry"] == chosen["entry"]]
    assert [r["to"] for r in after["replays"]] == [outcome["replayed_to"]]
    code, out, _err = _run(capsys, "dlq", "replay", chosen["entry"])
    assert code == 0 and "already replayed" in out
    code, out, _err = _run(capsys, "dlq", "replay", chosen["entry"], "--force")
    assert code == 0 and out.startswith(f"replayed {chosen['entry']} -> ")


def test_the_projector_follows_the_dlq_into_dlq_entries_replays_and_discards_included(
    dead_letters: list[dict[str, Any]], bootstrap: str, layout: TopicLayout, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert _run(capsys, "dlq", "replay", dead_letters[0]["entry"])[0] == 0
    discarded = dead_letters[1]["entry"]
    code, out, _err = _run(capsys, "dlq", "discard", discarded, dead_letters[0]["entry"])
    assert code == 0 and out.splitlines() == [
        f"discarded {discarded}",  # no sealed input: no data key to tombstone
        f"skipped {dead_letters[0]['entry']}: already replayed: its copy went to its origin (discard that copy's "
        "dead letter, if it is one)"]
    code, out, _err = _run(capsys, "dlq", "replay", discarded, "--force")
    assert code == 0 and "a discarded dead letter is never replayed" in out
    store = SqliteStore(tmp_path / "state.db")
    stop = threading.Event()
    follower = DlqFollower(bootstrap, layout.dlq, store, ConsumerSettings(poll_timeout_s=0.1), stop)
    thread = threading.Thread(target=follower.run)
    thread.start()
    try:
        assert wait_for(lambda: sum(store.dlq_depth().values()) == 1 and _replayed(store), timeout_s=30)
    finally:
        stop.set()
        thread.join(timeout=30)
    rows = {(r["partition"], r["dlq_offset"]): r for r in store.dlq_entries(limit=10)}
    first = rows[(dead_letters[0]["partition"], dead_letters[0]["offset"])]
    assert first["replayed_to"] and first["origin_topic"] == layout.inbox and first["error_kind"] == "corrupt"
    second = rows[(dead_letters[1]["partition"], dead_letters[1]["offset"])]
    assert second["discarded_at"] and second["replayed_at"] is None and second["discard_shredded"] is None
    assert store.dlq_depth() == {"contradictory": 1}, "neither the replayed nor the discarded one waits"
    store.close()


def _replayed(store: SqliteStore) -> bool:
    return bool(store.dlq_entries(replayed=True))


@pytest.fixture
def dlq_topic(monkeypatch: pytest.MonkeyPatch, bootstrap: str, layout: TopicLayout) -> None:
    """An empty DLQ topic, its metadata visible (a topic just created takes a moment to be)."""
    monkeypatch.setenv("STEPSTREAM_BOOTSTRAP_SERVERS", bootstrap)
    monkeypatch.setenv("STEPSTREAM_TOPIC_PREFIX", layout.prefix)
    admin = AdminClient({"bootstrap.servers": bootstrap})
    assert wait_for(lambda: admin.list_topics(layout.dlq, timeout=5).topics[layout.dlq].error is None)


@pytest.mark.parametrize(("argv", "message"), [
    (["dlq", "show", "abc"], "ENTRY 'abc' is not PARTITION:OFFSET"),
    (["dlq", "show", "7:0"], "has partitions 0-2"),
    (["dlq", "show", "0:999"], "no record there"),
    (["dlq", "replay", "1:2", "x:1"], "ENTRY 'x:1' is not PARTITION:OFFSET"),
    (["dlq", "discard", "0:999"], "no record there"),
    (["dlq", "list", "--limit", "0"], "--limit 0"),
])
def test_bad_arguments_are_refused_naming_them(
    dlq_topic: None, argv: list[str], message: str, capsys: pytest.CaptureFixture[str],
) -> None:
    code, _out, err = _run(capsys, *argv)
    assert code == 1 and message in err, err
