"""``stepstream dlq list|show|replay``: dead letters with their reasons, one decoded, chosen ones replayed.

They read the DLQ topic itself (``eventstore.dead_letters``, not a projection), so they work with nothing else
running. Tables on the terminal by default, ``--json`` for scripts.
"""

from __future__ import annotations

import argparse
import sys
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
    bootstrap, layout = _deployment()
    dead_letters = DeadLetters(bootstrap, layout.dlq)
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
    bootstrap, layout = _deployment()
    outcomes = DeadLetters(bootstrap, layout.dlq, keys_topic=layout.keys).replay(chosen, force=force,
                                                                                 dry_run=dry_run)
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
