"""``stepstream projections rebuild|verify``: the state store rebuilt from the log, or checked against it.

Human output by default (progress and tables on the terminal), ``--json`` for scripts: then stdout is one
JSON object. Bad arguments raise ``UsageError`` naming the option.
"""

from __future__ import annotations

import argparse
import sys
from datetime import UTC, datetime
from typing import Any

import orjson

from eventstore.console import command_console
from eventstore.settings import KafkaSettings
from eventstore.topics import TopicLayout
from projections.rebuild import (
    Offsets,
    Replayer,
    default_workers,
    progress_bar,
    rebuild_into,
    rebuild_live,
    until_time,
    verify_against_replay,
    verify_stores,
)
from projections.replaying import sources
from projections.settings import StoreSettings, StoreSpec
from stepstream.errors import UsageError


def parse_until_offset(text: str) -> dict[int, int]:
    """``P:O[,P:O...]``: the events partitions to stop early, each before offset O."""
    out = {}
    for part in text.split(","):
        partition, sep, offset = part.strip().partition(":")
        if not sep or not partition.isdigit() or not offset.isdigit():
            raise UsageError(f"--until-offset {text!r}: expected PARTITION:OFFSET[,PARTITION:OFFSET...] "
                             "(e.g. 0:120,1:88)")
        out[int(partition)] = int(offset)
    return out


def parse_time(option: str, text: str) -> datetime:
    try:
        when = datetime.fromisoformat(text)
    except ValueError as exc:
        raise UsageError(f"{option} {text!r}: expected an ISO 8601 time (e.g. 2026-12-02T14:00:00Z)") from exc
    return when if when.tzinfo else when.replace(tzinfo=UTC)


def _emit(as_json: bool, payload: dict[str, Any], human: str) -> None:
    if as_json:
        sys.stdout.write(orjson.dumps(payload).decode() + "\n")
    else:
        command_console().print(human)


def _check_sizes(batch_size: int, workers: int) -> None:
    if batch_size < 1:
        raise UsageError(f"--batch-size {batch_size}: must be at least 1")
    if workers < 1:
        raise UsageError(f"--workers {workers}: must be at least 1 (1 replays in order in one process)")


def rebuild(*, into: str | None, until_offset: str | None, until_time_text: str | None, batch_size: int,
            workers: int, as_json: bool, progress: bool) -> int:
    _check_sizes(batch_size, workers)
    if until_offset and until_time_text:
        raise UsageError("--until-offset and --until-time: choose one")
    kafka = KafkaSettings()
    layout = TopicLayout.from_settings(kafka)
    live_spec = StoreSettings().spec(kafka.home)
    target = _spec("--into", into) if into else None
    if target is not None and target == live_spec:
        raise UsageError(f"--into {into}: that is the live store; rebuild it with `stepstream projections rebuild`")
    if (until_offset or until_time_text) and target is None:
        raise UsageError("--until-offset/--until-time rebuild the log as it was then into a store of its own: "
                         "name it with --into STORE (the live store is never rolled back)")
    offsets = parse_until_offset(until_offset) if until_offset else None
    moment = parse_time("--until-time", until_time_text) if until_time_text else None
    bootstrap = kafka.reachable_bootstrap()  # once the options are known good: a usage error needs no cluster
    until: Offsets | None = None
    if offsets is not None:
        until = {layout.events: offsets}
    elif moment is not None:
        until = until_time(bootstrap, [layout.events, layout.dlq], moment)
    with progress_bar(command_console(stderr=True) if progress else None) as bar:
        replayer = Replayer(bootstrap, sources(layout), batch_size=batch_size, progress=bar, workers=workers)
        store = (target or live_spec).open()
        try:
            report = rebuild_into(store, replayer, until) if target else rebuild_live(store, replayer)
        finally:
            store.close()
    rate = f"{report.records / report.seconds:,.0f} records/s" if report.seconds else ""
    verb = "rebuilt and swapped in" if report.swapped else "built"
    refused = (f"; {report.replay.rejected} refused by a constraint (see projection_errors)"
               if report.replay.rejected else "")
    _emit(as_json, report.as_json(), f"{verb}: {report.store} ({report.records:,} records in "
                                     f"{report.seconds:.1f}s, {rate}){refused}")
    return 0


def verify(*, against: str | None, batch_size: int, workers: int, as_json: bool, progress: bool) -> int:
    """Exit 0 when the stores are equal, 1 when they differ."""
    _check_sizes(batch_size, workers)
    kafka = KafkaSettings()
    layout = TopicLayout.from_settings(kafka)
    other_spec = _spec("--against", against) if against else None
    bootstrap = kafka.reachable_bootstrap() if other_spec is None else None  # before any progress bar shows
    console = command_console(stderr=True) if progress else None
    with progress_bar(console) as bar:
        live = StoreSettings().open(kafka.home)
        try:
            if bootstrap is not None:
                replayer = Replayer(bootstrap, sources(layout), batch_size=batch_size, progress=bar,
                                    workers=workers)
                comparison = verify_against_replay(live, replayer)
            elif other_spec is not None:
                other = other_spec.open()
                try:
                    comparison = verify_stores(live, other, bar)
                finally:
                    other.close()
        finally:
            live.close()
    if as_json:
        _emit(True, comparison.as_json(), "")
    else:
        comparison.render(command_console())
    return 0 if comparison.equal else 1


def _spec(option: str, text: str) -> StoreSpec:
    try:
        return StoreSpec.parse(text)
    except ValueError as exc:
        raise UsageError(f"{option}: {exc}") from exc


def add_parsers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``stepstream projections rebuild|verify``."""
    projections = commands.add_parser("projections", help="rebuild the state store from the log, or verify it")
    actions = projections.add_subparsers(dest="action", required=True)
    build = actions.add_parser("rebuild", help="replay the log into a fresh store and swap it in (or --into a "
                                               "store of its own, optionally as the log stood --until ...)")
    build.add_argument("--into", metavar="STORE", help="build this store instead and swap nothing (a file, "
                                                       "sqlite:PATH or postgresql://...[?schema=NAME])")
    build.add_argument("--until-offset", metavar="P:O[,P:O...]",
                       help="stop each named events partition before offset O (needs --into)")
    build.add_argument("--until-time", metavar="ISO-8601", help="the log as it stood at this time (needs --into)")
    check = actions.add_parser("verify", help="compare the store with a fresh replay of the log (or --against "
                                              "another store), row by row; exit 1 if they differ")
    check.add_argument("--against", metavar="STORE", help="compare with this store instead of a replay")
    for parser in (build, check):
        parser.add_argument("--batch-size", type=int, default=2000, help="records per transaction (default 2000)")
        parser.add_argument("--workers", type=int, default=default_workers(),
                            help="processes that replay partitions side by side into an empty store (default "
                                 f"{default_workers()}: twice the cores; 1: in order in this process)")
        parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
        parser.add_argument("--no-progress", action="store_true", help="no progress display on stderr")
    build.set_defaults(func=lambda a: rebuild(into=a.into, until_offset=a.until_offset, until_time_text=a.until_time,
                                              batch_size=a.batch_size, workers=a.workers, as_json=a.json,
                                              progress=not a.no_progress))
    check.set_defaults(func=lambda a: verify(against=a.against, batch_size=a.batch_size, workers=a.workers,
                                             as_json=a.json, progress=not a.no_progress))

