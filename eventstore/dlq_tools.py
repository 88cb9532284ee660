"""Operators' tools for dead letters: list them with their reasons, show one decoded, replay chosen ones.

They read the DLQ topic itself (not a projection), so they work with nothing else running. A replay
re-publishes the original key, value and headers to the origin topic and partition with the idempotent
producer, then records itself on the DLQ topic: a marker record (no value) in the dead letter's own
partition whose headers name the dead letter and where its copy landed. The record of what was
replayed is therefore on the log, in order after the dead letter, for these tools (a second replay
of the same dead letter needs ``--force``) and for the projector's ``dlq_entries`` table alike.

The tools read the log with ``eventstore.replay.LogRange`` (raw records, headers included); the record
model they show (``DeadLetter``) is the event store's own, in ``eventstore.dlq``.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import orjson
from confluent_kafka import KafkaError, Producer
from confluent_kafka import Message as KafkaMessage
from rich.table import Table

from eventstore.console import command_console
from eventstore.dlq import (
    HEADER_PREFIX,
    REPLAY_OF,
    REPLAY_TIME,
    REPLAY_TO,
    REPLAYED_FROM_HEADER,
    DeadLetter,
    parse_entry,
)
from eventstore.errors import LogReadError, StepstreamError
from eventstore.kafka_config import producer_config
from eventstore.replay import LogRange
from eventstore.settings import KafkaSettings
from eventstore.topics import TopicLayout
from schemas.codec import Codec, default_codec


class DlqToolError(StepstreamError):
    """A request the tools cannot serve; the message names the argument or the record at fault."""


@dataclass
class DlqEntry:
    """A dead letter and the replays recorded for it."""

    letter: DeadLetter
    replays: list[dict[str, str]] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {**self.letter.summary(), "replays": self.replays}


class DeadLetters:
    """The DLQ topic of one deployment, as the operators' tools see it."""

    def __init__(self, bootstrap: str, topic: str, codec: Codec | None = None) -> None:
        self.bootstrap = bootstrap
        self.topic = topic
        self.codec = codec or default_codec()

    def entries(self) -> list[DlqEntry]:
        """Every dead letter, oldest first per partition, with the replays recorded for it."""
        found: dict[tuple[int, int], DlqEntry] = {}
        for msg in LogRange(self.bootstrap, self.topic):
            letter = DeadLetter.from_message(msg)
            target = letter.replay_of
            if target is None:
                found[(letter.partition, letter.offset)] = DlqEntry(letter)
            elif target in found:
                info = letter.info
                found[target].replays.append({"to": info.get(REPLAY_TO, "?"), "time": info.get(REPLAY_TIME, "?"),
                                              "marker": f"{letter.partition}:{letter.offset}"})
        return list(found.values())

    def fetch(self, partition: int, offset: int) -> DeadLetter:
        """One dead letter by position; a clear error when there is none there."""
        try:
            reader = LogRange(self.bootstrap, self.topic, partitions=[partition], starts={partition: offset},
                              ends={partition: offset + 1})
        except LogReadError as exc:
            raise DlqToolError(f"ENTRY {partition}:{offset}: {exc}") from exc
        low, high = reader.watermarks[partition]
        found = [DeadLetter.from_message(m) for m in reader if m.offset() == offset]
        if not found:
            held = f"offsets {low}-{high - 1}" if high > low else "no records"
            raise DlqToolError(f"ENTRY {partition}:{offset}: no record there ({self.topic}[{partition}] holds {held})")
        if found[0].replay_of is not None:
            raise DlqToolError(f"ENTRY {partition}:{offset} is a replay marker, not a dead letter")
        return found[0]

    def replay(self, chosen: list[tuple[int, int]], *, force: bool = False,
               dry_run: bool = False) -> list[dict[str, Any]]:
        """Re-publish the chosen dead letters to their origin, each once unless ``force``; record each."""
        entries = {(e.letter.partition, e.letter.offset): e for e in self.entries()}
        plan: list[tuple[DlqEntry, str | None]] = []
        for partition, offset in chosen:
            entry = entries.get((partition, offset))
            if entry is None:
                self.fetch(partition, offset)  # raises the precise error: no such partition, offset or marker
                raise DlqToolError(f"ENTRY {partition}:{offset}: not a dead letter")
            if entry.letter.origin is None:
                raise DlqToolError(f"ENTRY {partition}:{offset}: has no origin.topic/partition headers")
            skip = "already replayed (use --force to replay again)" if entry.replays and not force else None
            plan.append((entry, skip))
        outcomes = [{**entry.letter.summary(), "replayed_to": None, "skipped": skip or ("dry run" if dry_run else None)}
                    for entry, skip in plan]
        todo = [(i, entry) for i, (entry, skip) in enumerate(plan) if skip is None and not dry_run]
        if not todo:
            return outcomes
        # Idempotent (no duplicate from a retried send); every delivery reported: its offset is recorded.
        producer = Producer(producer_config(self.bootstrap, **{"delivery.report.only.error": False}))
        landed: dict[int, str] = {}
        failures: list[str] = []

        def delivered(index: int) -> Any:
            def callback(err: KafkaError | None, msg: KafkaMessage) -> None:
                if err is not None:
                    failures.append(str(err))
                else:
                    landed[index] = f"{msg.topic()}[{msg.partition()}]@{msg.offset()}"
            return callback

        for index, entry in todo:
            letter = entry.letter
            topic, partition, _offset = letter.origin  # type: ignore[misc]  # checked above
            headers = [(k, v) for k, v in letter.headers if not k.startswith(HEADER_PREFIX)
                       and k != REPLAYED_FROM_HEADER]
            headers.append((REPLAYED_FROM_HEADER, f"{self.topic}[{letter.partition}]@{letter.offset}".encode()))
            producer.produce(topic, value=letter.value, key=letter.key, headers=headers, partition=partition,
                             on_delivery=delivered(index))
        producer.flush(60)
        if failures:
            raise DlqToolError(f"replay not delivered: {failures[0]}")
        now = datetime.now(UTC).isoformat(timespec="milliseconds")
        for index, entry in todo:
            letter = entry.letter
            marker = [(HEADER_PREFIX + REPLAY_OF, f"{letter.partition}:{letter.offset}".encode()),
                      (HEADER_PREFIX + REPLAY_TO, landed[index].encode()),
                      (HEADER_PREFIX + REPLAY_TIME, now.encode())]
            producer.produce(self.topic, value=None, key=letter.key, headers=marker, partition=letter.partition)
            outcomes[index]["replayed_to"] = landed[index]
        producer.flush(60)
        return outcomes


# -- the command line: `stepstream dlq list|show|replay` -----------------------------------------------


def _topic_and_bootstrap() -> tuple[str, str]:
    settings = KafkaSettings()
    return settings.reachable_bootstrap(), TopicLayout.from_settings(settings).dlq


def _print_json(payload: Any) -> None:
    sys.stdout.write(orjson.dumps(payload).decode() + "\n")


def list_command(*, limit: int | None, as_json: bool) -> int:
    if limit is not None and limit < 1:
        raise DlqToolError(f"--limit {limit}: must be at least 1")
    bootstrap, topic = _topic_and_bootstrap()
    entries = sorted(DeadLetters(bootstrap, topic).entries(), key=lambda e: e.letter.dead_at_ms)
    shown = entries[-limit:] if limit else entries
    if as_json:
        _print_json([e.as_json() for e in shown])
        return 0
    table = Table(title=f"{topic}: {len(entries)} dead letters, {sum(not e.replays for e in entries)} not replayed")
    for column in ("entry", "dead at", "origin", "group", "kind", "error", "reason", "replayed"):
        table.add_column(column, overflow="fold")
    for entry in shown:
        row = entry.as_json()
        origin = row["origin"]
        where = f"{origin['topic']}[{origin['partition']}]@{origin['offset']}" if origin else "?"
        table.add_row(row["entry"], row["dead_at"], where, row["consumer_group"] or "", row["error_kind"] or "",
                      row["error_class"] or "", (row["reason"] or "")[:120],
                      ", ".join(r["to"] for r in entry.replays) or "no")
    command_console().print(table)
    return 0


def show_command(*, entry: str, as_json: bool) -> int:
    bootstrap, topic = _topic_and_bootstrap()
    dead_letters = DeadLetters(bootstrap, topic)
    letter = dead_letters.fetch(*parse_entry(entry))
    detail = letter.detail(dead_letters.codec)
    if as_json:
        _print_json(detail)
        return 0
    console = command_console()
    for name in ("entry", "key", "dead_at", "origin", "consumer_group", "error_kind", "error_class", "reason", "size"):
        console.print(f"[bold]{name}[/bold]: {detail[name]}", highlight=False)
    headers = Table(title="headers")
    headers.add_column("key")
    headers.add_column("value", overflow="fold")
    for header in detail["headers"]:
        headers.add_row(header["key"], header.get("text") or f"hex {header['hex']}")
    console.print(headers)
    console.print("[bold]value[/bold]:")
    console.print_json(orjson.dumps(detail["value"]).decode())
    return 0


def replay_command(*, entries: list[str], force: bool, dry_run: bool, as_json: bool) -> int:
    chosen = [parse_entry(e) for e in entries]
    bootstrap, topic = _topic_and_bootstrap()
    outcomes = DeadLetters(bootstrap, topic).replay(chosen, force=force, dry_run=dry_run)
    if as_json:
        _print_json(outcomes)
        return 0
    console = command_console()
    for outcome in outcomes:
        if outcome["replayed_to"]:
            console.print(f"replayed {outcome['entry']} -> {outcome['replayed_to']}", highlight=False)
        else:
            console.print(f"skipped {outcome['entry']}: {outcome['skipped']}", highlight=False)
    return 0


def add_parsers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    dlq = commands.add_parser("dlq", help="inspect dead letters and replay them after a fix")
    actions = dlq.add_subparsers(dest="action", required=True)
    listing = actions.add_parser("list", help="every dead letter with its reason, origin and replays")
    listing.add_argument("--limit", type=int, default=None, help="the newest N only")
    show = actions.add_parser("show", help="one dead letter with its headers, its value decoded (raw if it cannot be)")
    show.add_argument("entry", metavar="ENTRY", help="PARTITION:OFFSET of the dead letter, as `dlq list` shows")
    replay = actions.add_parser("replay", help="re-publish dead letters to their origin topic and partition")
    replay.add_argument("entries", metavar="ENTRY", nargs="+", help="PARTITION:OFFSET of each dead letter")
    replay.add_argument("--force", action="store_true", help="replay even those replayed before")
    replay.add_argument("--dry-run", action="store_true", help="say what would be replayed, replay nothing")
    for parser in (listing, show, replay):
        parser.add_argument("--json", action="store_true", help="JSON on stdout, for scripts")
    listing.set_defaults(func=lambda a: list_command(limit=a.limit, as_json=a.json))
    show.set_defaults(func=lambda a: show_command(entry=a.entry, as_json=a.json))
    replay.set_defaults(func=lambda a: replay_command(entries=a.entries, force=a.force, dry_run=a.dry_run,
                                                      as_json=a.json))
