"""Which fields are sensitive, and sealing them: task inputs at submission, step outputs on their way to ``events``.

Every task of a workflow that marks anything has its own data key (``schemas.sealed.TaskKey``), wrapped by
the master keys and kept on the compacted ``keys`` topic; deleting it there erases the task's data.

Inputs (``Workflow.sensitive_input``) are sealed by whoever submits (``SubmissionSealer``: the client, the
CLI, the HTTP API, the outbox), so ``inbox`` never holds them in clear; the scheduler and the decider pass
them on sealed (into ``TaskAccepted`` and every agent request) and never open them; the agent opens them
with the task's key just before it calls its service.

Step outputs: the agent seals the marked fields of its answer (the request names them), so they arrive
sealed; whatever is still clear (an answer of an older agent, or outputs opened when a partition was
restored) is sealed on its way to the log and to later steps' agents. So ``inbox``, ``events``, kept
forever, and every projection built from it hold ciphertext only.

Sealed, per the step's ``sensitive_output`` marking: the marked fields of ``StepSucceeded.output`` and of
that step's entry in ``TaskCompleted.output``; and every field of ``StepCompensated.output`` of a step
that marks anything, because a compensation inherits its step's marking (its answer may echo the very
identifiers it was given to undo). The compensation's input is never written to the log: it is rebuilt
from the sealed step output.

Unsealing follows the same markings and leaves a marked value written in clear (before it was marked) as
it is, and a value whose task key is gone (erased) sealed. Events written before tasks had data keys were
sealed with a master key directly; those still open with it. A workflow version must not change its
markings once it ran; a new marking belongs in a new version.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any, TypeVar

from eventstore.keys import new_reference
from scheduler.decider import StepState, TaskState
from scheduler.workflow import Step, Workflow, WorkflowNotFoundError, WorkflowRegistry
from schemas.messages import Event, StepCompensated, StepSucceeded, SubmitTask, TaskCompleted
from schemas.sealed import Keyring, SealingError, TaskKey, input_place, is_sealed, sealed_with_task_key

_Transform = Callable[[Any, tuple[str, ...]], Any]
E = TypeVar("E", bound=Event)


def require_keyring(registry: WorkflowRegistry, keyring: Keyring | None) -> Keyring | None:
    """``keyring``, or SealingError naming the workflows that mark data when there is none: a process that
    would have to write their data in clear refuses to start instead."""
    if keyring is None and registry.has_sensitive_data:
        marked = sorted({f"{w.name} v{w.version}" for w in registry.workflows() if w.has_sensitive_data})
        raise SealingError(f"workflows {', '.join(marked)} mark sensitive data but no encryption key is "
                           "configured (STEPSTREAM_ENCRYPTION_KEYS): refusing to write it in clear")
    return keyring


def seal_input(workflow: Workflow, task_id: str, data: dict[str, Any], key: TaskKey) -> dict[str, Any]:
    """``data`` with the workflow's sensitive input fields sealed with ``key`` (ones already sealed kept)."""
    return {name: key.seal(value, input_place(task_id, name))
            if name in workflow.sensitive_input and not is_sealed(value) else value
            for name, value in data.items()}


def open_input(workflow: Workflow, task_id: str, data: dict[str, Any], key: TaskKey) -> dict[str, Any]:
    """``data`` with its fields sealed with ``key`` open again (to seal them under another task key)."""
    return {name: key.unseal(value, input_place(task_id, name)) if sealed_with_task_key(value) else value
            for name, value in data.items()}


def granted(workflow: Workflow, step: Step, data: dict[str, Any], compensation: bool
            ) -> tuple[dict[str, Any], list[str]]:
    """An attempt's input (``{"task": ..., "steps": ...}``) with the sensitive values ``step`` is not granted
    (``Step.opens``) left out, and their names: input fields by name, step outputs as ``step.field``. A
    compensation is given its step's own output whole besides."""
    if not workflow.has_sensitive_data:
        return data, []
    withheld = [name for name in data["task"] if name in workflow.sensitive_input and name not in step.opens]
    steps: dict[str, Any] = {}
    for name, output in data["steps"].items():
        if not isinstance(output, dict) or (compensation and name == step.name):
            steps[name] = output
            continue
        hidden = [f for f in workflow.step(name).sensitive_fields(output) if f"{name}.{f}" not in step.opens]
        withheld += [f"{name}.{f}" for f in hidden]
        steps[name] = {f: value for f, value in output.items() if f not in hidden}
    task = {name: value for name, value in data["task"].items() if name not in withheld}
    return {**data, "task": task, "steps": steps}, withheld


class SubmissionSealer:
    """Seals the marked input fields of submissions before they are produced, with the task's data key.

    Without a keyring, a submission to a workflow that marks inputs is refused (SealingError) and one to
    any other workflow passes: a submitter of unmarked workflows needs no key."""

    def __init__(self, registry: WorkflowRegistry, keyring: Keyring | None) -> None:
        self.registry = registry
        self.keyring = keyring

    def needs_key(self, command: SubmitTask) -> bool:
        """Whether ``command`` has fields to seal (and so needs its task's data key)."""
        return bool(self._workflow(command).sensitive_input) and command.data_key is None \
            and command.key_ref is None

    def seal(self, command: SubmitTask, key: TaskKey | None = None) -> SubmitTask:
        """``command`` with its marked fields sealed with ``key``, a known task's (so a repeat seals to the
        same bytes), or else with a new one, which goes beside them wrapped, with a fresh reference:
        ``eventstore.keys.KeyProposer`` proposes it on ``keys`` under that reference and takes it off before
        the submission goes to ``inbox``. A submission already carrying a data key is sealed already: it is
        returned as it is."""
        if not self.needs_key(command):
            return command
        workflow = self._workflow(command)
        if self.keyring is None:
            raise SealingError(f"workflow {workflow.name} v{workflow.version} marks input fields sensitive but no "
                               "encryption key is configured (STEPSTREAM_ENCRYPTION_KEYS): refusing to send "
                               "them in clear")
        if key is not None:  # the scheduler has this task's key: nothing to propose
            return command.model_copy(update={"input": seal_input(workflow, command.task_id, command.input, key)})
        key = TaskKey.generate()
        return command.model_copy(update={"input": seal_input(workflow, command.task_id, command.input, key),
                                          "data_key": self.keyring.wrap(key, command.task_id),
                                          "key_ref": new_reference()})

    def _workflow(self, command: SubmitTask) -> Workflow:
        return self.registry.get(command.workflow, command.workflow_version)


class EventSealer:
    """Seals and opens the sensitive fields of one registry's events: with the task's data key, or, for
    events written before tasks had one, with the master keyring."""

    def __init__(self, registry: WorkflowRegistry, keyring: Keyring | None) -> None:
        self.registry = registry
        self.keyring = require_keyring(registry, keyring)

    def seal(self, event: E, key: TaskKey | None) -> E:
        """``event`` as it may be written to the log."""
        sealer = key or self.keyring
        if sealer is None:
            return event
        return self._transform(event, lambda value, where: value if is_sealed(value) else sealer.seal(value, where))

    def unseal(self, event: E, key: TaskKey | None) -> E:
        """``event`` as read from the log, with its sealed fields open again; values of an erased task (no
        ``key``) stay sealed."""
        return self._transform(event, lambda value, where: self._open(value, where, key))

    def opener(self, keys: Mapping[str, TaskKey]) -> Callable[[Event], Event]:
        """``unseal`` with each event's task key looked up in ``keys`` (a partition's, while it restores)."""
        return lambda event: self.unseal(event, keys.get(event.task_id))

    def seal_state(self, state: TaskState, key: TaskKey | None) -> TaskState:
        """``state`` as the scheduler's changelog may hold it: step outputs (clear in memory once a partition
        was restored) sealed exactly as on ``events``; the input is sealed already."""
        sealer = key or self.keyring
        if sealer is None:
            return state
        return self._transform_state(state, lambda value, where: value if is_sealed(value) else
                                     sealer.seal(value, where))

    def open_state(self, state: TaskState, key: TaskKey | None) -> TaskState:
        """``state`` read from the changelog with its step outputs open again, as a fold of ``events`` has them
        (an erased task's stay sealed)."""
        return self._transform_state(state, lambda value, where: self._open(value, where, key))

    def _transform_state(self, state: TaskState, apply: _Transform) -> TaskState:
        try:
            workflow = self.registry.get(state.workflow, state.workflow_version)
        except WorkflowNotFoundError:
            return state
        if not workflow.has_sensitive_data:
            return state
        return replace(state, steps=tuple(_step_state(workflow.step(step.name), state.task_id, step, apply)
                                          for step in state.steps))

    def seal_outputs(self, workflow: Workflow, task_id: str, outputs: dict[str, Any], key: TaskKey | None
                     ) -> dict[str, Any]:
        """Step outputs by step name (as an agent request carries them), each step's marked fields sealed."""
        if key is None:
            return outputs
        task_key = key
        return {name: _step_output(workflow.step(name), task_id, output,
                                   lambda value, where: value if is_sealed(value) else task_key.seal(value, where))
                if isinstance(output, dict) else output
                for name, output in outputs.items()}

    def _open(self, value: Any, where: tuple[str, ...], key: TaskKey | None) -> Any:
        if not is_sealed(value):
            return value
        if sealed_with_task_key(value):
            return value if key is None else key.unseal(value, where)
        if self.keyring is None:
            raise SealingError(f"a value sealed with a master key at {'/'.join(where)} and no key configured")
        return self.keyring.unseal(value, where)

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
                output = _step_output(step, task, original, apply)
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
        outputs[step.name] = _step_output(step, event.task_id, value, apply)
    return outputs


def _step_state(step: Step, task_id: str, state: StepState, apply: _Transform) -> StepState:
    """A step's outputs in a task's state, marked as its ``StepSucceeded`` and ``StepCompensated`` are."""
    output, undone = state.output, state.compensation.output
    if isinstance(output, dict):
        output = _step_output(step, task_id, output, apply)
    if isinstance(undone, dict) and step.is_sensitive:
        undone = _fields(undone, sorted(undone), (task_id, step.name, "compensation"), apply)
    if output is state.output and undone is state.compensation.output:
        return state
    return replace(state, output=output, compensation=replace(state.compensation, output=undone))


def _step_output(step: Step, task_id: str, output: dict[str, Any], apply: _Transform) -> dict[str, Any]:
    return _fields(output, step.sensitive_fields(output), (task_id, step.name, "output"), apply)


def _fields(output: dict[str, Any], names: list[str], where: tuple[str, ...], apply: _Transform) -> dict[str, Any]:
    """``output`` with ``apply`` run on each named field; the same object when there is none."""
    if not names:
        return output
    return {key: apply(value, (*where, key)) if key in names else value for key, value in output.items()}
