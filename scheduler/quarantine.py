"""Folding one partition of ``events`` so that one task's bad history costs that task only.

A history this scheduler cannot fold -- an event ``evolve`` refuses (a decider changed, a log written by a
bug), one it cannot read (corrupt, or written by a newer version with a schema this one does not know), a
sealed value it cannot open -- used to stop the restore, and with it every task of the partition. Here such
a task is *quarantined*: its state is dropped, the rest of its history is only counted, and every other task
folds on. The scheduler then records the quarantine on the log (an ``OperatorAlert`` and ``TaskQuarantined``,
once: a quarantine already on the log after the fault is not recorded again), dead-letters the task's
commands with the reason, and lets an operator release it once a version that folds the history runs.

A quarantine is a record in the history, not a status of the state machine: a version that folds the
history reaches the state the task had, notes that the task is still quarantined (``TaskQuarantined``
without a ``TaskReleased`` after it), and releases it on the operator's ``release``.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from dataclasses import dataclass

from scheduler.decider import TaskState, evolve
from schemas.codec import Codec
from schemas.errors import DecodeError
from schemas.messages import Event, TaskQuarantined, TaskReleased
from schemas.sealed import SealingError
from schemas.states import FINAL

UNFOLDABLE = (ValueError, KeyError, SealingError)
"""What folding an event may raise when the history, not the machine, is at fault: ``InvalidTransition`` (a
``ValueError``), a step or workflow the registry does not know, a sealed value that does not open."""


@dataclass
class Quarantine:
    """A task set aside. ``foldable``: this version folds its history (it waits for a release); otherwise it
    cannot, and ``next_sequence`` is where records about it continue the task's log."""

    task_id: str
    reason: str
    workflow: str
    workflow_version: int
    next_sequence: int
    causation_id: str
    unfolded_sequence: int | None = None
    foldable: bool = False
    recorded: bool = False


class PartitionFold:
    """The tasks of one partition, folded record by record, and the ones that had to be quarantined.

    It may start from tasks already folded (a restore from the scheduler's changelog, ``scheduler.restore``):
    ``reflected`` then gives, per task, the range of its sequences those already include, and an event in
    that range is skipped rather than folded twice. ``touched``: the tasks an event changed.
    """

    def __init__(self, codec: Codec, unseal: Callable[[Event], Event],
                 tasks: MutableMapping[str, TaskState] | None = None, quarantined: dict[str, Quarantine] | None = None,
                 reflected: Callable[[str], tuple[int, int] | None] | None = None) -> None:
        self.codec = codec
        self.unseal = unseal
        self.tasks: MutableMapping[str, TaskState] = tasks if tasks is not None else {}
        self.quarantined: dict[str, Quarantine] = quarantined if quarantined is not None else {}
        self.reflected = reflected or (lambda _task_id: None)
        self.touched: set[str] = set()
        self.unattributed = 0

    def add(self, key: bytes | None, value: bytes | None, where: str) -> None:
        """Fold one record of ``events`` (``where``: its partition and offset, for the reason)."""
        try:
            message = self.codec.decode(value)
        except DecodeError as exc:
            if key is None:
                self.unattributed += 1  # a record without a task cannot stop one
                return
            self._unreadable(key.decode(errors="replace"), f"event at {where} cannot be read ({exc.kind}): {exc}",
                             where)
            return
        if not isinstance(message, Event):
            return
        reflected = self.reflected(message.task_id)
        if reflected is not None and reflected[0] <= message.sequence <= reflected[1]:
            return
        self.touched.add(message.task_id)
        stuck = self.quarantined.get(message.task_id)
        if stuck is not None and not stuck.foldable:
            stuck.next_sequence = max(stuck.next_sequence, message.sequence + 1)
            if isinstance(message, TaskQuarantined | TaskReleased):
                stuck.recorded = isinstance(message, TaskQuarantined)
            return
        try:
            state = evolve(self.tasks.get(message.task_id), self.unseal(message))
        except UNFOLDABLE as exc:
            self.tasks.pop(message.task_id, None)
            self.quarantined[message.task_id] = Quarantine(
                message.task_id, f"{type(message).__name__} at {where} does not fold: {exc}", message.workflow,
                message.workflow_version, message.sequence + 1, message.message_id, unfolded_sequence=message.sequence)
            return
        # A finished task is kept as much as a late command to it needs (``TaskState.settled``).
        self.tasks[message.task_id] = state.settled() if state.status in FINAL else state
        if isinstance(message, TaskQuarantined):
            self.quarantined[message.task_id] = Quarantine(
                message.task_id, message.reason, message.workflow, message.workflow_version, message.sequence + 1,
                message.message_id, unfolded_sequence=message.unfolded_sequence, foldable=True, recorded=True)
        elif isinstance(message, TaskReleased):
            self.quarantined.pop(message.task_id, None)

    def _unreadable(self, task_id: str, reason: str, where: str) -> None:
        self.touched.add(task_id)
        stuck = self.quarantined.get(task_id)
        if stuck is not None and not stuck.foldable:
            stuck.next_sequence += 1  # an unreadable event still took its place in the task's sequence
            return
        state = self.tasks.pop(task_id, None)
        self.quarantined[task_id] = Quarantine(
            task_id, reason, state.workflow if state else "unknown", state.workflow_version if state else 1,
            (state.sequence if state else 0) + 2, f"unreadable:{where}")
