"""One call a handler makes for one attempt of a step: what it is given, and what it returns.

The runtime builds a :class:`Call` per call (an attempt may make several, under the retry policy) from the
scheduler's request, with its sealed values already opened for the step granted them. Handler authors read
it through :mod:`agents.handler`, which is the public face of this module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from schemas.messages import AgentRequest

__all__ = ["AgentHandler", "Call"]


@dataclass(frozen=True)
class Call:
    """What a handler needs for one call: the data, the idempotency key, the fencing token, the time left.

    ``request`` is the scheduler's whole request, for what the accessors do not name.
    """

    request: AgentRequest
    timeout_s: float
    """How long this call may take: the policy's call timeout, cut to what the attempt has left."""

    @property
    def task_id(self) -> str:
        return self.request.task_id

    @property
    def step(self) -> str:
        """The step this call works for (a compensation: the step it undoes)."""
        return self.request.step

    @property
    def task_input(self) -> dict[str, Any]:
        """The task's input as submitted, its sensitive fields opened if the step is granted them; asking for
        one it is not granted raises ``FieldNotGranted`` naming it."""
        task = self.request.input.get("task")
        return task if isinstance(task, dict) else {}

    @property
    def step_outputs(self) -> dict[str, dict[str, Any]]:
        """The outputs of the steps done before this one, by step name (a compensation sees its own step's)."""
        steps = self.request.input.get("steps")
        return {name: output for name, output in steps.items() if isinstance(output, dict)} \
            if isinstance(steps, dict) else {}

    def output_of(self, step: str) -> dict[str, Any]:
        """The output of the earlier step ``step``; KeyError naming the steps whose outputs there are."""
        outputs = self.step_outputs
        if step not in outputs:
            raise KeyError(f"no output of step {step!r} in this call (outputs of: {', '.join(outputs) or 'none'})")
        return outputs[step]

    @property
    def idempotency_key(self) -> str:
        """The same for every attempt of the step: the service applies a key once."""
        return self.request.idempotency_key

    @property
    def attempt(self) -> int:
        """The attempt number, a fencing token: a service may refuse an attempt older than one it saw."""
        return self.request.attempt

    @property
    def deadline(self) -> datetime:
        """No work of the attempt after this (UTC); the runtime never starts a call it cannot finish by then."""
        return self.request.complete_by

    @property
    def is_compensation(self) -> bool:
        """This call undoes its step (its handler is the step's compensating agent)."""
        return self.request.compensation

    @property
    def undoes_key(self) -> str | None:
        """A compensation's: the idempotency key of the forward step it undoes (what the service applied)."""
        return self.request.undoes_key

    @property
    def undoes_attempt(self) -> int | None:
        """A compensation's: the highest forward attempt started; a later forward call must apply nothing."""
        return self.request.undoes_attempt


#: Makes one call. Returns the step's output, or raises: :class:`agents.faults.TransientError` /
#: :class:`agents.faults.PermanentError` explicitly (a ``retry_after_s`` on a TransientError is the
#: handler's suggested delay), or anything else, which :func:`agents.faults.classify` maps by type.
AgentHandler = Callable[[Call], dict[str, Any]]
