"""Which event fields are sensitive, sealed on their way to ``events`` and opened when the scheduler restores.

The decider and the scheduler's memory work with clear values (the next step and the compensations need
them); only what is written to the log is sealed. So ``events``, kept forever, and every projection built
from it hold ciphertext only, and the scheduler is the one reader holding the keys.

Sealed, per the step's ``sensitive_output`` marking: the marked fields of ``StepSucceeded.output`` and of
that step's entry in ``TaskCompleted.output``; and every field of ``StepCompensated.output`` of a step
that marks anything, because a compensation inherits its step's marking (its answer may echo the very
identifiers it was given to undo). The compensation's input is never written to the log: it is rebuilt
from the sealed step output.

Unsealing follows the same markings and leaves a marked value written in clear (before it was marked) as
it is. A workflow version must not change its markings once it ran; a new marking belongs in a new version.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from scheduler.workflow import Workflow, WorkflowNotFoundError, WorkflowRegistry
from schemas.messages import Event, StepCompensated, StepSucceeded, TaskCompleted
from schemas.sealed import Keyring, SealingError, is_sealed

_Transform = Callable[[Any, tuple[str, ...]], Any]
E = TypeVar("E", bound=Event)


class EventSealer:
    """Seals and opens the sensitive fields of one registry's events with one keyring."""

    def __init__(self, registry: WorkflowRegistry, keyring: Keyring | None) -> None:
        if keyring is None and registry.has_sensitive_data:
            marked = sorted({f"{w.name} v{w.version}" for w in registry.workflows() if w.has_sensitive_data})
            raise SealingError(f"workflows {', '.join(marked)} mark sensitive output but no encryption key is "
                               "configured (STEPSTREAM_ENCRYPTION_KEYS): refusing to write it in clear")
        self.registry = registry
        self.keyring = keyring

    def seal(self, event: E) -> E:
        """``event`` as it may be written to the log."""
        if self.keyring is None:
            return event
        keyring = self.keyring
        return self._transform(event, lambda value, where: value if is_sealed(value) else keyring.seal(value, where))

    def unseal(self, event: E) -> E:
        """``event`` as read from the log, with its sealed fields open again."""
        if self.keyring is None:
            return event
        keyring = self.keyring
        return self._transform(event, lambda value, where: keyring.unseal(value, where) if is_sealed(value) else value)

    def _transform(self, event: E, apply: _Transform) -> E:
        if not isinstance(event, StepSucceeded | StepCompensated | TaskCompleted):
            return event
        try:
            workflow = self.registry.get(event.workflow, event.workflow_version)
        except WorkflowNotFoundError:
            return event  # nothing says what is marked; the scheduler cannot run such a task anyway
        task, original = event.task_id, event.output
        match event:
            case StepSucceeded():
                step = workflow.step(event.step)
                output = _fields(original, step.sensitive_fields(original), (task, step.name, "output"), apply)
            case StepCompensated():
                step = workflow.step(event.step)
                marked = sorted(original) if step.is_sensitive else []
                output = _fields(original, marked, (task, step.name, "compensation"), apply)
            case TaskCompleted():
                output = _completed_output(workflow, event, apply)
        return event if output is original else event.model_copy(update={"output": output})


def _completed_output(workflow: Workflow, event: TaskCompleted, apply: _Transform) -> dict[str, Any]:
    """Each marked step's entry of a completed task's output, marked as in its StepSucceeded."""
    outputs = event.output
    marked = [s for s in workflow.steps if s.is_sensitive and isinstance(outputs.get(s.name), dict)]
    if not marked:
        return outputs
    outputs = dict(outputs)
    for step in marked:
        value = outputs[step.name]
        outputs[step.name] = _fields(value, step.sensitive_fields(value), (event.task_id, step.name, "output"), apply)
    return outputs


def _fields(output: dict[str, Any], names: list[str], where: tuple[str, ...], apply: _Transform) -> dict[str, Any]:
    """``output`` with ``apply`` run on each named field; the same object when there is none."""
    if not names:
        return output
    return {key: apply(value, (*where, key)) if key in names else value for key, value in output.items()}
