"""The tasks of one owned partition: live ones in memory, ended ones spilled to a file on local disk.

A scheduler that kept every task it ever saw in memory needed memory in proportion to its whole history:
4 KB a task, 4 GB after a million. Yet a task that ended (a ``TERMINAL`` status) can only receive rare
commands: a repeated submission, a late answer, an operator command. So a task leaves memory as it ends --
a final one (``FINAL``) settled (``TaskState.settled``), one in ``error``, ``compensation_failed`` or
``rejected`` whole, since an operator's resubmit or retry, or a repeat of a rejected submission, may bring it
back -- to a private SQLite database on local disk (SQLite's temporary database: deleted when closed, cached
within ``CACHE_KIB``), and is read back, decoded, when a command for it comes; a state set live again
returns to memory. Memory is then in proportion to the live tasks, plus a fixed cache per partition.

The spill is not a store of record and never outlives the process: the changelog (``scheduler.changelog``)
is the durable state, and every restore builds the spill again from it (an ended task's record is copied as
it is, not validated into a ``TaskState`` until a command needs it). So it needs no durability, no recovery
and no agreement with anything after a crash: ``journal_mode=OFF``, ``synchronous=OFF``.

A state spilled by the open transaction is also kept in memory until the transaction ends (``committed`` /
``recover_batch`` call ``forget_fresh``): the changelog write at the end of the batch reads each touched task,
and decoding what was just encoded would double the cost of ending a task.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator, MutableMapping

from pydantic import TypeAdapter

from scheduler.decider import TaskState
from schemas.states import TERMINAL

CACHE_KIB = 4096
"""SQLite's page cache per partition's spill: what of it stays resident (the rest is read from the file)."""

FRESH_LIMIT = 10_000
"""At most this many just-spilled states are kept in memory too (a restore that folds ``events`` whole
spills every ended task of the history before its first transaction)."""

_STATE = TypeAdapter(TaskState)


class UnreadableSettledState(ValueError):
    """A spilled state this version cannot read (a changelog record written by another version)."""


class PartitionTasks(MutableMapping[str, TaskState]):
    """A partition's tasks by id, as a mapping: live states in memory, ended ones in the spill.

    Setting a state whose status is terminal spills it, a live one takes it out of the spill; getting a task
    not in memory reads the spill. Iterating goes over every task (memory, then spill): ``live`` is what is in
    memory.
    """

    def __init__(self) -> None:
        self._live: dict[str, TaskState] = {}
        self._fresh: dict[str, TaskState] = {}
        self._spilled = 0
        # Writes go in a transaction the end of each batch (``forget_fresh``) or restore (``loaded``) commits:
        # one per statement would cost several times the statement.
        self._db = sqlite3.connect("", check_same_thread=False)
        self._db.executescript(f"""
            PRAGMA journal_mode=OFF; PRAGMA synchronous=OFF; PRAGMA cache_size=-{CACHE_KIB};
            CREATE TABLE settled (task_id TEXT PRIMARY KEY, state BLOB NOT NULL,
                                  overlap_from INTEGER NOT NULL, sequence INTEGER NOT NULL);
        """)

    # -- the mapping --------------------------------------------------------------------------

    def __getitem__(self, task_id: str) -> TaskState:
        state = self._live.get(task_id) or self._fresh.get(task_id)
        if state is not None:
            return state
        row = self._db.execute("SELECT state FROM settled WHERE task_id = ?", (task_id,)).fetchone()
        if row is None:
            raise KeyError(task_id)
        try:
            return _STATE.validate_json(row[0])
        except ValueError as exc:
            raise UnreadableSettledState(f"spilled state of task {task_id} cannot be read: {exc}") from None

    def __setitem__(self, task_id: str, state: TaskState) -> None:
        if state.status not in TERMINAL:
            if task_id not in self._live and self._spilled:
                self.unspill(task_id)  # resubmitted, retried, or a rejected submission repeated
            self._live[task_id] = state
            return
        if self._live.pop(task_id, None) is not None or not (task_id in self._fresh or self._on_disk(task_id)):
            self._spilled += 1
        self._spill(task_id, _STATE.dump_json(state), state.sequence + 1, state.sequence)
        if len(self._fresh) >= FRESH_LIMIT:
            self._fresh.clear()
        self._fresh[task_id] = state

    def __delitem__(self, task_id: str) -> None:
        found = self._live.pop(task_id, None) is not None
        if not (self.unspill(task_id) or found):
            raise KeyError(task_id)

    def __iter__(self) -> Iterator[str]:
        yield from list(self._live)
        for (task_id,) in self._db.execute("SELECT task_id FROM settled"):
            yield task_id

    def __len__(self) -> int:
        return len(self._live) + self._spilled

    def __contains__(self, task_id: object) -> bool:
        return task_id in self._live or task_id in self._fresh or (isinstance(task_id, str) and self._on_disk(task_id))

    # -- beyond the mapping -------------------------------------------------------------------

    def live(self) -> Iterator[TaskState]:
        """The states held in memory: every task not ended (and none that is)."""
        return iter(list(self._live.values()))

    def held(self, task_id: str) -> TaskState | None:
        """A live task's state, from memory only: safe to call from another thread than the one that owns the
        partition (the timers'), and None for an ended task, which waits for no timer."""
        return self._live.get(task_id)

    @property
    def in_memory(self) -> int:
        """How many tasks are held in memory."""
        return len(self._live)

    @property
    def spilled(self) -> int:
        """How many ended tasks the spill holds."""
        return self._spilled

    def spill_record(self, task_id: str, state_json: bytes, overlap_from: int, sequence: int) -> None:
        """An ended task's state as a restore read it from the changelog, still encoded: it is validated only when a
        command for the task needs it. ``overlap_from``..``sequence``: the task's events the record reflects.
        ``loaded`` ends a restore's records."""
        self._spill(task_id, state_json, overlap_from, sequence)

    def loaded(self) -> None:
        """A restore spilled what it read: commit it, and count it."""
        self._db.commit()
        self._spilled = self._db.execute("SELECT count(*) FROM settled").fetchone()[0]

    def reflected(self, task_id: str) -> tuple[int, int] | None:
        """The range of a spilled task's sequences its record on the changelog reflects (``spill_record``); an
        empty one for a state this scheduler spilled itself (it has no record to overlap yet)."""
        row = self._db.execute("SELECT overlap_from, sequence FROM settled WHERE task_id = ?", (task_id,)).fetchone()
        return None if row is None else (row[0], row[1])

    def forget_fresh(self) -> None:
        """The open transaction ended: states it spilled are read from the spill from now on."""
        self._fresh.clear()
        self._db.commit()

    def unspill(self, task_id: str) -> bool:
        """Drop a task from the spill, if there (a restore meeting a later record of it); whether it was."""
        self._fresh.pop(task_id, None)
        deleted = self._db.execute("DELETE FROM settled WHERE task_id = ?", (task_id,)).rowcount
        self._spilled -= deleted
        return deleted > 0

    def close(self) -> None:
        self._live.clear()
        self._fresh.clear()
        self._db.close()

    def _on_disk(self, task_id: str) -> bool:
        return self._db.execute("SELECT 1 FROM settled WHERE task_id = ?", (task_id,)).fetchone() is not None

    def _spill(self, task_id: str, state_json: bytes, overlap_from: int, sequence: int) -> None:
        self._db.execute("INSERT OR REPLACE INTO settled VALUES (?, ?, ?, ?)",
                         (task_id, state_json, overlap_from, sequence))
