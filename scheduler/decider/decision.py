"""What a decision is (its events, and why its command is dead-lettered) and how one is built.

The builder stamps the fields every event shares and evolves each event as it is made, so every handler
emits through it and gets a gapless sequence and a state that already shows its earlier events.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeAlias

from scheduler.decider.ids import event_id
from scheduler.decider.state import TaskState
from scheduler.decider.transitions import evolve
from schemas.messages import AttemptAccepted, Event, OperatorCommand, RecoverStep, RetryDue, StepResult, SubmitTask

Command: TypeAlias = SubmitTask | StepResult | RecoverStep | OperatorCommand | AttemptAccepted | RetryDue


@dataclass(frozen=True)
class Decision:
    """The events a command causes, and, when the command itself must go to the DLQ, why.

    A dead-lettered command may still cause events: a contradictory duplicate submission raises an
    operator alert on the task it contradicts.
    """

    events: tuple[Event, ...]
    dead_letter: str | None = None


class Builder:
    """Accumulates one decision's events, stamping the fields every event shares and evolving as it goes.

    Evolving each event as it is made numbers the sequence without gaps and lets later events of the same
    decision see the effect of earlier ones (a retry sees the failure count its StepFailed set).
    """

    def __init__(self, command: Command, state: TaskState | None, now: datetime, workflow: str,
                 version: int) -> None:
        self._command = command
        self._state = state
        self._workflow = workflow
        self._version = version
        self.now = now
        self._events: list[Event] = []

    @classmethod
    def on(cls, command: Command, state: TaskState, now: datetime) -> Builder:
        """A builder for a decision on an existing task, whose events keep its pinned workflow version."""
        return cls(command, state, now, state.workflow, state.workflow_version)

    @property
    def state(self) -> TaskState:
        if self._state is None:
            raise ValueError("no event has created the task yet")
        return self._state

    def emit(self, event_type: type[Event], **fields: Any) -> None:
        sequence = (self._state.sequence if self._state is not None else 0) + 1
        event = event_type(
            message_id=event_id(self._command.task_id, sequence),
            task_id=self._command.task_id,
            occurred_at=self.now,
            sequence=sequence,
            workflow=self._workflow,
            workflow_version=self._version,
            causation_id=self._command.message_id,
            **fields,
        )
        self._state = evolve(self._state, event)
        self._events.append(event)

    def decision(self, dead_letter: str | None = None) -> Decision:
        return Decision(tuple(self._events), dead_letter)
