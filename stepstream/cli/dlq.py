"""``stepstream dlq list|show|replay|discard``: dead letters with their reasons, one decoded, chosen ones
replayed, or discarded for good.

They read the DLQ topic itself (``eventstore.dead_letters``, not a projection), so they work with nothing else
running. Tables on the terminal by default, ``--json`` for scripts.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import orjson
from rich.table import Table

from eventstore.console import command_console
from eventstore.dead_letters import DeadLetters, DlqToolError
from eventstore.dlq import parse_entry
from eventstore.settings import KafkaSettings
from eventstore.topics import TopicLayout


def _deployment() -> tuple[str, TopicLayout]:
    settings = KafkaSettings()
    return settings.reachable_bootstrap(), TopicLayout.from_settings(settings)


def _print_json(payload: Any) -> None:
    sys.stdout.write(orjson.dumps(payload).decode() + "\n")


def list_command(*, limit: int | None, as_json: bool) -> int:
    if limit is not None and limit < 1:
        raise DlqToolError(f"--limit {limit}: must be at least 1")
    bootstrap, layout = _deployment()
    topic = layout.dlq
    entries = sorted(DeadLetters(bootstrap, topic, layout.keys).entries(), key=lambda e: e.letter.dead_at_ms)
    shown = entries[-limit:] if limit else entries
    if as_json:
        _print_json([e.as_json() for e in shown])
        return 0
    table = Table(title=f"{topic}: {len(entries)} dead letters, {sum(e.waiting for e in entries)} neither replayed "
                        "nor discarded")
    for column in ("entry", "dead at", "origin", "group", "kind", "error", "reason", "replayed", "discarded"):
        table.add_column(column, overflow="fold")
    for entry in shown:
        row = entry.as_json()
        origin = row["origin"]
        where = f"{origin['topic']}[{origin['partition']}]@{origin['offset']}" if origin else "?"
        table.add_row(row["entry"], row["dead_at"], where, row["consumer_group"] or "", row["error_kind"] or "",
                      row["error_class"] or "", (row["reason"] or "")[:120],
                      ", ".join(r["to"] for r in entry.replays) or "no",
                      entry.discarded["time"] if entry.discarded else "no")
    command_console().print(table)
    return 0


def show_command(*, entry: str, as_json: bool) -> int:
    bootstrap, layout = _deployment()
    dead_letters = DeadLetters(bootstrap, layout.dlq, layout.keys)
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
    bootstrap, layout = _deployment()
    outcomes = DeadLetters(bootstrap, layout.dlq, layout.keys).replay([parse_entry(e) for e in entries],
                                                                     force=force, dry_run=dry_run)
    return _report(outcomes, as_json, lambda o: o["replayed_to"] and f"replayed {o['entry']} -> {o['replayed_to']}")


def discard_command(*, entries: list[str], dry_run: bool, as_json: bool) -> int:
    bootstrap, layout = _deployment()
    outcomes = DeadLetters(bootstrap, layout.dlq, layout.keys).discard([parse_entry(e) for e in entries],
                                                                      dry_run=dry_run)
    return _report(outcomes, as_json, lambda o: o["discarded"] and f"discarded {o['entry']}" + (
        f" (its data key {o['shredded']} tombstoned)" if o["shredded"] else ""))


def _report(outcomes: list[dict[str, Any]], as_json: bool, done: Callable[[dict[str, Any]], str | None]) -> int:
    """Each outcome on a line: what ``done`` says of it, or why it was skipped."""
    if as_json:
        _print_json(outcomes)
        return 0
    console = command_console()
    for outcome in outcomes:
        console.print(done(outcome) or f"skipped {outcome['entry']}: {outcome['skipped']}", highlight=False)
    return 0


def add_parsers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    dlq = commands.add_parser("dlq", help="inspect dead letters, replay them after a fix or discard them")
    actions = dlq.add_subparsers(dest="action", required=True)
    listing = actions.add_parser("list", help="every dead letter with its reason, origin and replays")
    listing.add_argument("--limit", type=int, default=None, help="the newest N only")
    show = actions.add_parser("show", help="one dead letter with its headers, its value decoded (raw if it cannot be)")
    show.add_argument("entry", metavar="ENTRY", help="PARTITION:OFFSET of the dead letter, as `dlq list` shows")
    replay = actions.add_parser("replay", help="re-publish dead letters to their origin topic and partition")
    replay.add_argument("entries", metavar="ENTRY", nargs="+", help="PARTITION:OFFSET of each dead letter")
    replay.add_argument("--force", action="store_true", help="replay even those replayed before")
    replay.add_argument("--dry-run", action="store_true", help="say what would be replayed, replay nothing")
    discard = actions.add_parser("discard", help="give dead letters up for good: never replayed, a sealed "
                                                 "submission's data key tombstoned")
    discard.add_argument("entries", metavar="ENTRY", nargs="+", help="PARTITION:OFFSET of each dead letter")
    discard.add_argument("--dry-run", action="store_true", help="say what would be discarded, discard nothing")
    for parser in (listing, show, replay, discard):
        parser.add_argument("--json", action="store_true", help="JSON on stdout, for scripts")
    listing.set_defaults(func=lambda a: list_command(limit=a.limit, as_json=a.json))
    show.set_defaults(func=lambda a: show_command(entry=a.entry, as_json=a.json))
    replay.set_defaults(func=lambda a: replay_command(entries=a.entries, force=a.force, dry_run=a.dry_run,
                                                      as_json=a.json))
    discard.set_defaults(func=lambda a: discard_command(entries=a.entries, dry_run=a.dry_run, as_json=a.json))
