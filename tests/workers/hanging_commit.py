"""``stepstream ARGS`` whose first transaction hangs in ``send_offsets_to_transaction`` for good, as librdkafka's
did after a broker SIGKILL (confluentinc/librdkafka#5456), for tests/test_stall_recovery.py.

Run as ``python -m tests.workers.hanging_commit run scheduler`` with ``STEPSTREAM_TEST_HANG_MARKER`` naming a
file that does not exist yet: the first process to reach a commit creates it and hangs there, its batch's output
produced and its transaction open, until the stall guard ends it; a process started after that (the restart)
finds the file and commits as usual. Only the hang is made up: the guard, the exit, the restart, the fencing
of the open transaction and the re-read of the batch are the real ones.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

from eventstore.producer import EventProducer
from stepstream.cli import main

_marker = Path(os.environ["STEPSTREAM_TEST_HANG_MARKER"])
_send_offsets = EventProducer.send_offsets


def _hang_once(producer: EventProducer, offsets: list[Any], group_metadata: Any, timeout_s: float = 30.0) -> None:
    try:
        _marker.touch(exist_ok=False)  # exclusive create: one process only, whichever commits first
    except FileExistsError:
        _send_offsets(producer, offsets, group_metadata, timeout_s)
        return
    threading.Event().wait()  # never set: the call does not return, whatever its timeout


EventProducer.send_offsets = _hang_once  # type: ignore[method-assign]

raise SystemExit(main())
