"""The sealed values of an agent request: opened just before the call, for the step granted them.

The scheduler sends a request with its sensitive values sealed under the task's data key; the agent opens
them with that key (read from the ``keys`` topic, unwrapped with the master keys) only when it calls, and
seals the output fields the workflow marks before answering. A value the step is not granted is not in the
request at all: asking for it fails naming it (:class:`FieldNotGranted`).
"""

from __future__ import annotations

from typing import Any

from agents.faults import PermanentError
from agents.redaction import Redactor
from eventstore.keys import DataKeys
from schemas.messages import AgentRequest, StepResult
from schemas.sealed import Keyring, SealingError, TaskKey, open_step_input, seal_fields

__all__ = ["FieldNotGranted", "GrantedFields", "SealedInputs", "granted_fields"]


class FieldNotGranted(PermanentError):
    """The agent's code asked for a sensitive value its step is not granted (``Step.opens``): the request
    does not hold it, sealed or otherwise. A permanent failure: no attempt will be given it."""


class GrantedFields(dict[str, Any]):
    """One part of an opened request input (the task's input, or one earlier step's output) that knows what
    was withheld from it: asking for a withheld value raises FieldNotGranted naming it, rather than a bare
    KeyError or a silent None."""

    def __init__(self, values: dict[str, Any], withheld: dict[str, str], step: str) -> None:
        super().__init__(values)
        self._withheld = withheld  # field name -> the name the workflow grants it by
        self._step = step

    def __missing__(self, name: str) -> Any:
        self._refuse(name)
        raise KeyError(name)

    def get(self, name: str, default: Any = None) -> Any:
        if name not in self:
            self._refuse(name)
        return super().get(name, default)

    def _refuse(self, name: str) -> None:
        if name in self._withheld:
            raise FieldNotGranted(f"step {self._step} is not granted {self._withheld[name]}: it is sensitive and "
                                  f"the step's opens does not name it", kind="validation")


def granted_fields(request: AgentRequest, data: dict[str, Any]) -> dict[str, Any]:
    """``data`` (a request's input) with its task input and each step output refusing their withheld values."""
    inputs = {name: name for name in request.withheld if "." not in name}
    outputs: dict[str, dict[str, str]] = {}
    for name in request.withheld:
        if "." in name:
            step, _, field = name.partition(".")
            outputs.setdefault(step, {})[field] = name
    steps = data.get("steps")
    return {**data,
            "task": GrantedFields(data.get("task") or {}, inputs, request.step),
            "steps": {step: GrantedFields(output, outputs.get(step, {}), request.step) if isinstance(output, dict)
                      else output for step, output in steps.items()} if isinstance(steps, dict) else steps}


class SealedInputs:
    """Opens the sealed values of a request's input with its task's data key, read from the ``keys`` topic
    and unwrapped with the master keys: the agent's service gets the clear values it works with, and
    nothing the agent answers or logs is made of them."""

    def __init__(self, keys: DataKeys, keyring: Keyring | None) -> None:
        self.keys = keys
        self.keyring = keyring

    def open(self, request: AgentRequest) -> tuple[AgentRequest, Redactor]:
        """``request`` with its input open, and the redactor of the values opened; SealingError if a sealed
        value does not open."""
        opened, values = open_step_input(request.input, request.task_id, lambda: self._key(request.task_id))
        data = granted_fields(request, opened) if request.withheld else opened
        return request.model_copy(update={"input": data}), Redactor(values)

    def answer(self, request: AgentRequest, result: StepResult, redactor: Redactor) -> StepResult:
        """The answer as it leaves the agent: the marked output fields sealed, then every value the step
        opened masked in the rest (an error body or an unmarked field that says it back)."""
        return redactor.result(self.seal_answer(request, result))

    def seal_answer(self, request: AgentRequest, result: StepResult) -> StepResult:
        """``result`` with the output fields the request names sealed, so ``inbox`` never holds them in clear.
        The scheduler names fields only for a task that has a data key, and a running task is never erased:
        a missing key here is a broken invariant (SealingError), not something to answer in clear."""
        if not request.sealed_output or not result.output:
            return result
        key = self._key(request.task_id)
        if key is None:
            raise SealingError(f"task {request.task_id}: its answer has marked fields and it has no data key")
        where = (request.task_id, request.step, "compensation" if request.compensation else "output")
        return result.model_copy(update={"output": seal_fields(result.output, request.sealed_output, where, key)})

    def _key(self, task_id: str) -> TaskKey | None:
        wrapped = self.keys.wrapped(task_id)
        if wrapped is None:
            return None
        if self.keyring is None:
            raise SealingError(f"task {task_id}: its input is sealed and this agent has no encryption key "
                               "(STEPSTREAM_ENCRYPTION_KEYS)")
        return self.keyring.unwrap(wrapped, task_id)
