"""The answer to an operator command, as the scheduler records it on ``events``: the transition the command
caused (naming its command id) or ``OperatorCommandRefused`` with the reason.

Shared by ``stepstream task ... --wait`` (``stepstream.cli.operator``) and the API's command route, which both
wait for that answer after sending the command.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

from eventstore.replay import ReplayReader
from schemas.messages import (
    CompensationRetried,
    CompensationStarted,
    Event,
    OperatorCommandRefused,
    RetryBroughtForward,
    StepResubmitted,
    TaskDataErased,
    TaskReleased,
)


@dataclass(frozen=True)
class Outcome:
    """The scheduler's answer to one operator command, as recorded on ``events``."""

    status: Literal["accepted", "refused"]
    detail: str

    @classmethod
    def of(cls, event: Event) -> Outcome:
        match event:
            case OperatorCommandRefused():
                return cls("refused", event.reason)
            case StepResubmitted():
                return cls("accepted", f"step {event.step!r} resubmitted")
            case CompensationRetried():
                return cls("accepted", f"compensation of step {event.step!r} retried")
            case RetryBroughtForward():
                return cls("accepted", f"step {event.step!r} tries now")
            case TaskReleased():
                return cls("accepted", f"released from quarantine ({event.status})")
            case TaskDataErased():
                return cls("accepted", "task data erased: its data key is deleted")
            case CompensationStarted():
                plan = ", ".join(event.steps) if event.steps else "nothing to undo"
                return cls("accepted", f"compensating ({event.trigger}): {plan}")
        return cls("accepted", type(event).__name__)  # a transition added later: still an acceptance


class TaskEvents:
    """The events of one task, read from ``events`` a little more each time.

    The first read starts at the beginning of every partition; later reads resume after the last record
    seen (only in the task's partition once it is known). Resuming after what was read, not at the end
    offsets the read started with, matters: records of a transaction still open lie below those end
    offsets and would be skipped for good once it commits.
    """

    def __init__(self, bootstrap: str, topic: str, task_id: str) -> None:
        self.bootstrap = bootstrap
        self.topic = topic
        self.task_id = task_id
        self._next: dict[int, int] = {}
        self._partitions: list[int] | None = None

    def read(self) -> list[Event]:
        found: list[Event] = []
        reader = ReplayReader(self.bootstrap, self.topic, partitions=self._partitions, start_offsets=self._next)
        for record in reader:
            self._next[record.partition] = record.offset + 1
            if isinstance(record.message, Event) and record.message.task_id == self.task_id:
                found.append(record.message)
                self._partitions = [record.partition]
        return found

    def wait(self, command_id: str, timeout_s: float, seen: list[Event] | None = None,
             interval_s: float = 0.25) -> Outcome | None:
        """The outcome of ``command_id`` (among ``seen`` or events still to come), or None past the timeout."""
        deadline = time.monotonic() + timeout_s
        outcome = _answer(command_id, seen or [])
        while outcome is None and time.monotonic() < deadline:
            time.sleep(interval_s)
            outcome = _answer(command_id, self.read())
        return outcome


def _answer(command_id: str, events: list[Event]) -> Outcome | None:
    """The outcome recorded for ``command_id`` among ``events``: the one event naming it."""
    for event in events:
        if getattr(event, "command_id", None) == command_id:
            return Outcome.of(event)
    return None
