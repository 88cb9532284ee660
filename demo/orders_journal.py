"""The order service's durable state: a snapshot and an append-only journal of what each request changed.

Rewriting the whole state before each response costs time that grows with every effect ever applied, and
the service does it under its one lock: a burst of 2,000 orders spent most of the service's CPU there and
slowed every agent waiting on it. A journal line holds only the entries the requests since the last line
changed (one per idempotency key, tombstone and resource touched, and the new effects), written under the
lock and fsync'd before the response that confirms them, so a request costs the same at the 10,000th order
as at the first. The fsync is a group commit: it runs outside the lock, in a thread, and one fsync covers
every line written before it started, so requests in flight together share it (an fsync took 0.3 ms on an
idle disk here and 8 ms beside a busy broker: one per request under the lock would cap the service there).
The snapshot (the state file, written atomically) is rewritten when the journal outgrows it, and at start
and clean shutdown, so the replay at start stays bounded and the amortised cost per request stays flat.

A crash (of the machine) can leave the lines written after the last fsync torn or missing, in any pattern:
none of them was confirmed, so the load folds the journal up to its first line that does not parse and
drops the rest, with a warning.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

JSON = dict[str, Any]
log = logging.getLogger("stepstream.orders_service")

#: Tables keyed by operation, then idempotency key: a request touches one entry of each.
KEYED_TABLES = ("requests", "arrivals", "applied", "outcomes", "highest_attempt", "results")
#: Tables of resources keyed by their id.
RESOURCE_TABLES = ("reservations", "charges", "shipments")
#: Rewrite the snapshot once the journal is this many times its size (and past a floor): the snapshot's
#: cost is then spread over at least as many bytes of journal as it writes.
COMPACT_RATIO = 2
COMPACT_FLOOR_BYTES = 1 << 20


@dataclass
class Changes:
    """What the requests since the last journal line changed, by coordinates (values are read at write)."""

    keyed: set[tuple[str, str]] = field(default_factory=set)  # (operation, idempotency key)
    tombstones: set[tuple[str, str]] = field(default_factory=set)  # (forward operation, key)
    resources: set[tuple[str, str]] = field(default_factory=set)  # (table, resource id)

    def __bool__(self) -> bool:
        return bool(self.keyed or self.tombstones or self.resources)


def delta(tables: JSON, changes: Changes, effects_from: int) -> JSON:
    """One journal line: the current value (or None, removed) of every changed entry, and new effects."""
    return {
        "keyed": [[op, key, {t: tables[t].get(op, {}).get(key) for t in KEYED_TABLES}]
                  for op, key in sorted(changes.keyed)],
        "tombstones": [[op, key, tables["tombstones"].get(op, {}).get(key)] for op, key in sorted(changes.tombstones)],
        "resources": [[table, rid, tables[table].get(rid)] for table, rid in sorted(changes.resources)],
        "effects_from": effects_from,
        "effects": tables["effects"][effects_from:],
    }


def apply_delta(tables: JSON, line: JSON) -> None:
    """Fold one journal line into the snapshot's tables (the inverse of ``delta``)."""
    for op, key, values in line["keyed"]:
        for table, value in values.items():
            _put(tables[table].setdefault(op, {}), key, value)
    for op, key, value in line["tombstones"]:
        _put(tables["tombstones"].setdefault(op, {}), key, value)
    for table, rid, value in line["resources"]:
        _put(tables[table], rid, value)
    del tables["effects"][line["effects_from"]:]
    tables["effects"].extend(line["effects"])


def _put(table: JSON, key: str, value: Any) -> None:
    if value is None:
        table.pop(key, None)
    else:
        table[key] = value


class Journal:
    """The snapshot file ``path`` and its journal ``path.journal``: ``load`` folds them, ``append`` writes a
    line, ``durable`` returns once every line written before it was called is fsync'd, ``compact`` rewrites the
    snapshot from the whole state and empties the journal."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.journal_path = path.with_name(path.name + ".journal")
        self._fd: int | None = None
        self._snapshot_bytes = 0
        self._journal_bytes = 0
        self._written = 0  # lines appended since start: a sync's target
        self._synced = 0
        self._syncing: asyncio.Future[None] | None = None

    def load(self) -> JSON | None:
        """The snapshot with every complete journal line folded in; None when there is no snapshot yet."""
        if not self.path.exists():
            return None
        data = self.path.read_bytes()
        self._snapshot_bytes = len(data)
        tables: JSON = orjson.loads(data)
        if self.journal_path.exists():
            lines = self.journal_path.read_bytes().split(b"\n")
            for number, raw in enumerate(lines, 1):
                if not raw:
                    continue
                try:
                    line = orjson.loads(raw)
                except orjson.JSONDecodeError:
                    dropped = sum(len(rest) + 1 for rest in lines[number - 1:])
                    log.warning("journal torn after its last fsync: folded %d lines, dropped %d bytes (never "
                                "confirmed to a caller)", number - 1, dropped)
                    break
                apply_delta(tables, line)
        return tables

    def append(self, line: JSON) -> None:
        """Write one line (to the page cache: a crash of the process keeps it; ``durable`` for the machine)."""
        if self._fd is None:
            self._fd = os.open(self.journal_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        data = orjson.dumps(line) + b"\n"
        os.write(self._fd, data)
        self._journal_bytes += len(data)
        self._written += 1

    async def durable(self) -> None:
        """Return once every line appended before this call is fsync'd, sharing an fsync with the callers
        that wait at the same time (the lock is not held meanwhile)."""
        target = self._written
        while self._synced < target:
            if self._syncing is None:
                self._syncing = asyncio.ensure_future(self._sync())
            await asyncio.shield(self._syncing)

    async def _sync(self) -> None:
        target, fd = self._written, self._fd
        try:
            if fd is not None:
                await asyncio.get_running_loop().run_in_executor(None, os.fsync, fd)
            self._synced = max(self._synced, target)
        finally:
            self._syncing = None

    def wants_compaction(self) -> bool:
        return self._journal_bytes > max(COMPACT_FLOOR_BYTES, COMPACT_RATIO * self._snapshot_bytes)

    def compact(self, tables: JSON) -> None:
        """The whole state as the new snapshot (atomically, fsync'd: every line so far is durable in it), then
        an empty journal. A crash between the two leaves the new snapshot and the old journal, whose lines,
        folded in order, end at the values the snapshot holds. The journal is truncated in place, so an fsync
        still running on it stays valid."""
        data = orjson.dumps(tables)
        write_atomically(self.path, data)
        self._snapshot_bytes = len(data)
        if self._fd is None:
            self._fd = os.open(self.journal_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.ftruncate(self._fd, 0)
        os.fsync(self._fd)
        self._journal_bytes = 0
        self._synced = self._written

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def write_atomically(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` so a crash leaves either the old or the new file, never half.

    Temp file in the same directory (same filesystem, so ``os.replace`` is atomic), fsync of the
    file before the rename and of the directory after it, so the rename itself is durable.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
