"""Everything a Python handler agent needs, from one module (``handler = "module:function"``).

A handler is a function of one :class:`Call` returning the step's output (a JSON object)::

    from agents.handler import Call, PermanentError, TransientError

    def sign(call: Call) -> dict[str, Any]:
        loan = call.task_input["loan_id"]         # the task's input (sealed fields opened if granted)
        ...                                       # do the work under call.idempotency_key, once
        return {"contract_id": ...}

It signals what went wrong by raising :class:`TransientError` (worth another call; ``retry_after_s`` is the
least to wait) or :class:`PermanentError` (retrying cannot help; ``kind="validation"`` for bad data).
Anything else it raises is classified by type (timeouts and connection errors transient, ``ValueError``
and pydantic validation errors permanent, the rest permanent as a probable bug). A compensating handler
gets the forward step's key in :attr:`Call.undoes_key`.

:class:`HandlerEnvironment` runs a handler with a made-up call, without Kafka or a running system: one
call as the runtime makes it (:meth:`HandlerEnvironment.run`), or a whole attempt with its retries
(:meth:`HandlerEnvironment.run_attempt`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from agents.call import AgentHandler, Call
from agents.faults import PermanentError, PermanentKind, TransientError, TransientKind, classify
from agents.policy import AgentPolicy, DependencyPolicy, PolicyProvider
from agents.runtime import Agent
from agents.sealed_inputs import FieldNotGranted, granted_fields
from schemas.messages import AgentRequest, StepResult

__all__ = [
    "Call",
    "FieldNotGranted",
    "Handler",
    "HandlerEnvironment",
    "PermanentError",
    "PermanentKind",
    "StepResult",
    "TransientError",
    "TransientKind",
]

#: The type of a handler: one call in, the step's output out.
Handler = AgentHandler


@dataclass(frozen=True)
class HandlerEnvironment:
    """Made-up calls for testing one handler, as the runtime would make them for task ``task_id``'s step
    ``step``, attempt ``attempt``, each call allowed ``timeout_s`` (like temporalio's ActivityEnvironment).

    The idempotency key is ``TASK_ID:STEP``, as the scheduler makes it: the same for every attempt.
    """

    task_id: str = "task-1"
    step: str = "step"
    attempt: int = 1
    timeout_s: float = 5.0
    calls_allowed: int = 3
    now: Callable[[], datetime] = field(default=lambda: datetime.now(UTC), repr=False)

    def call(self, task: Mapping[str, Any] | None = None, *, steps: Mapping[str, Mapping[str, Any]] | None = None,
             undoes: bool = False, withheld: Sequence[str] = ()) -> Call:
        """The call a handler gets for a task whose input is ``task``, after steps with outputs ``steps``;
        ``undoes``: the call of the step's compensation (it names the forward key and attempt it undoes);
        ``withheld``: the sensitive values the step is not granted (``name``, or ``step.name`` for an earlier
        output), left out as the scheduler leaves them out: asking for one raises FieldNotGranted."""
        request = AgentRequest(
            task_id=self.task_id, step=self.step, attempt=self.attempt,
            attempt_id=f"{self.task_id}:{self.step}:{'undo:' if undoes else ''}{self.attempt}",
            idempotency_key=f"{self.task_id}:{self.step}{':undo' if undoes else ''}",
            complete_by=self.now() + timedelta(seconds=self.timeout_s), calls_allowed=self.calls_allowed,
            input={"task": {name: value for name, value in (task or {}).items() if name not in withheld},
                   "steps": {step: {name: value for name, value in output.items() if f"{step}.{name}" not in withheld}
                             for step, output in (steps or {}).items()}},
            compensation=undoes, undoes_key=f"{self.task_id}:{self.step}" if undoes else None,
            undoes_attempt=self.attempt if undoes else None, withheld=list(withheld))
        if withheld:
            request = request.model_copy(update={"input": granted_fields(request, request.input)})
        return Call(request, self.timeout_s)

    def run(self, handler: Handler, task: Mapping[str, Any] | None = None, *,
            steps: Mapping[str, Mapping[str, Any]] | None = None, undoes: bool = False,
            withheld: Sequence[str] = ()) -> dict[str, Any]:
        """One call of ``handler``: its output, or the fault the runtime sees in what it raised (a
        :class:`TransientError` or :class:`PermanentError`, whatever the handler raised, its cause kept)."""
        try:
            return handler(self.call(task, steps=steps, undoes=undoes, withheld=withheld))
        except Exception as exc:
            fault = classify(exc)
            if fault is exc:
                raise
            raise fault from exc

    def run_attempt(self, handler: Handler, task: Mapping[str, Any] | None = None, *,
                    steps: Mapping[str, Mapping[str, Any]] | None = None, undoes: bool = False,
                    withheld: Sequence[str] = (),
                    policy: PolicyProvider | AgentPolicy | DependencyPolicy | None = None) -> StepResult:
        """A whole attempt as the agent runs it: transient faults retried under ``policy`` (default: the agents'
        default) within ``calls_allowed`` calls, back-off not waited; the answer the scheduler would get."""
        agent = Agent(self.step, handler, policy, sleep=lambda _: False, now=self.now)
        return agent.execute(self.call(task, steps=steps, undoes=undoes, withheld=withheld).request)
