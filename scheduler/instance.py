"""A stable name for a scheduler that was not given one: the lowest slot free on its host.

The scheduler's transactional id carries its instance name. A restarted scheduler with the same name fences
its dead predecessor at once: ``init_transactions`` aborts the transaction the dead one left open. With a new
random name that transaction stays open until the broker times it out (``transaction.timeout.ms``, 60 s), and
every read_committed reader of the partitions it wrote to (the agents, the projector) waits that long.

So a scheduler without ``STEPSTREAM_SCHEDULER_INSTANCE`` claims the lowest free slot ``N`` under its home
folder: an exclusive ``flock`` on ``<home>/instances/scheduler-N.lock``, held for as long as it runs. The
kernel releases the lock when the process ends, however it ends (a SIGKILL included), so its restart claims
the same slot and name, while schedulers running side by side claim different ones. The name is
``<host>-<N>``: schedulers on different hosts (or containers, each with its own host name and folder) never
share one.
"""

from __future__ import annotations

import fcntl
import os
import re
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

SLOTS = 1024  # more schedulers than any inbox has partitions
_UNSAFE = re.compile(r"[^\w.-]")  # what a transactional id (and the setting's pattern) does not take


class NoFreeSlot(RuntimeError):
    """Every slot of the folder is held: more schedulers run on this host than there are slots."""


@contextmanager
def scheduler_instance(given: str | None, home: Path, host: str | None = None, slots: int = SLOTS) -> Iterator[str]:
    """``given`` if set; otherwise the name of the lowest free slot of ``home``, held until the block exits."""
    if given:
        yield given
        return
    folder = home / "instances"
    folder.mkdir(parents=True, exist_ok=True)
    prefix = _UNSAFE.sub("_", host or socket.gethostname()) or "host"
    for slot in range(1, slots + 1):
        fd = os.open(folder / f"scheduler-{slot}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            yield f"{prefix}-{slot}"
        finally:
            os.close(fd)  # releases the lock
        return
    raise NoFreeSlot(f"all {slots} scheduler slots of {folder} are held")
