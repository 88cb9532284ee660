"""Declaring workflows: a name, a version, ordered steps, and what to do when a step keeps failing.

A task is pinned at submission to the workflow version it started with, so a new version can be
registered while tasks of the old one are still in flight; both run side by side.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

Escalation = Literal["error", "compensate", "backoff"]

DEFAULT_QUEUE_TIMEOUT_S = 300.0
"""How long an attempt's request may wait for an agent to take it (schedule-to-start). Generous: a wait
is not a failure, and a request nobody takes for five minutes means the agents are down or far behind
(admission control keeps a burst's wait well below it; see docs/operations.md, "Admission bounds"), which
the supervisor then surfaces as a timed-out attempt."""


class WorkflowNotFoundError(LookupError):
    """No workflow registered under that name (and version)."""


@dataclass(frozen=True)
class Backoff:
    """How long a step (or a compensation) waits between a failed attempt and the next one.

    Exponential: ``initial_s`` after the first failure, times ``multiplier`` after each further one, capped
    at ``max_s``, then spread by up to ``jitter`` of itself either way so that tasks failing together do
    not all come back at once. A delay the agent reports (``Retry-After``, an open breaker's remaining
    time) is a floor on top of it. ``initial_s`` 0 (the default, as before timers existed) retries at once
    unless the agent asked for a wait.

    The jitter is drawn from a hash of the attempt's identity, not a random source: the decider must decide
    the same way on every replay.
    """

    initial_s: float = 0.0
    multiplier: float = 2.0
    max_s: float = 60.0
    jitter: float = 0.2

    def __post_init__(self) -> None:
        if self.initial_s < 0 or self.max_s < self.initial_s or self.multiplier < 1 or not 0 <= self.jitter < 1:
            raise ValueError("back-off needs 0 <= initial_s <= max_s, multiplier >= 1 and 0 <= jitter < 1")

    def delay_s(self, failures: int, seed: str) -> float:
        """Seconds to wait after the ``failures``-th failed attempt (1, 2, ...), jittered by ``seed``."""
        if self.initial_s == 0 or failures < 1:
            return 0.0
        base = min(self.max_s, self.initial_s * self.multiplier ** min(failures - 1, 64))
        unit = int.from_bytes(hashlib.sha256(seed.encode()).digest()[:8], "big") / 2**64
        return base * (1 + self.jitter * (2 * unit - 1))


@dataclass(frozen=True)
class Compensation:
    """The action that undoes a completed step: an agent call like any other.

    Its attempts get their own deadlines, call budget and per-attempt allowance, and the workflow's
    ``failure_threshold`` bounds its failed attempts as it bounds the forward step's.

    An undo that gives up leaves its task ``compensation_failed``, holding what it could not undo until an
    operator acts; waiting is usually cheaper. ``backoff_rounds`` (0: none, as before) lets it wait instead:
    past the threshold it waits ``long_backoff_s`` and gets a fresh round of attempts (its failure count
    starts again, its call budget does not), up to that many rounds, and only then fails.

    ``forward_may_land_s`` is for a service that cannot refuse a forward call after its undo (it keeps no
    tombstones, see the contract in docs/user-guide.md): a forward call may still land up to this long after its
    attempt's latest end (say, the agent's call timeout), so the undo waits until then -- the last forward
    attempt can then no longer apply anything behind it. None (the default): the service fences the forward
    key on the undo, which then runs at once.
    """

    agent: str
    timeout_s: float = 10.0
    attempt_budget: int = 5
    calls_per_attempt: int = 3
    queue_timeout_s: float = DEFAULT_QUEUE_TIMEOUT_S
    forward_may_land_s: float | None = None
    backoff: Backoff = Backoff()
    long_backoff_s: float = 300.0
    backoff_rounds: int = 0

    def __post_init__(self) -> None:
        if not self.agent:
            raise ValueError("a compensation needs an agent")
        if self.long_backoff_s <= 0 or self.backoff_rounds < 0:
            raise ValueError(f"compensation by {self.agent}: long_backoff_s must be positive and backoff_rounds "
                             "not negative")
        if self.timeout_s <= 0 or self.queue_timeout_s <= 0:
            raise ValueError(f"compensation by {self.agent}: timeout_s and queue_timeout_s must be positive")
        if self.attempt_budget < 1 or self.calls_per_attempt < 1:
            raise ValueError(f"compensation by {self.agent}: attempt_budget and calls_per_attempt must be at least 1")
        if self.forward_may_land_s is not None and self.forward_may_land_s < 0:
            raise ValueError(f"compensation by {self.agent}: forward_may_land_s cannot be negative")

    @property
    def fenced(self) -> bool:
        """The service refuses a forward call once its key is undone: the undo need not wait."""
        return self.forward_may_land_s is None


@dataclass(frozen=True)
class Step:
    """One step: which agent runs it, how long an attempt may take, how many calls it may cost in all.

    ``attempt_budget`` bounds the calls to the remote service across every attempt of the step (agent
    retries and supervisor recoveries together); ``calls_per_attempt`` bounds one attempt's share.

    An attempt has two deadlines, as Temporal's activities do (schedule-to-start, start-to-close): an
    agent must take its request within ``queue_timeout_s`` of the attempt's start (the request waits in
    the agent's topic meanwhile, *queued*), and once taken its work must end within ``timeout_s``. So a
    burst larger than the agents' capacity waits instead of failing, while a hung call or a dead agent is
    still caught ``timeout_s`` after the work began.

    ``sensitive_output`` classifies the step's output: ``True`` marks every top-level field, a set of
    names marks those fields. Marked fields are encrypted wherever the event log keeps them, and the
    compensation inherits the marking: what it is given and what it answers derive from the marked data.

    ``backoff`` spaces its attempts (see :class:`Backoff`); the compensation declares its own.

    ``opens``: the sensitive values this step's agent is given, each a field of the workflow's
    ``sensitive_input`` (``card_token``) or a marked output field of an earlier step (``charge.charge_id``).
    Every other sensitive value is withheld from its requests (``scheduler.sealing.granted``), so an agent
    that does not need the card token never receives it, not even sealed. Its compensation is given the
    same, and the step's own output whole: it undoes what that output names.
    """

    name: str
    agent: str
    timeout_s: float = 10.0
    attempt_budget: int = 5
    calls_per_attempt: int = 3
    compensation: Compensation | None = None
    sensitive_output: bool | frozenset[str] = False
    queue_timeout_s: float = DEFAULT_QUEUE_TIMEOUT_S
    backoff: Backoff = Backoff()
    opens: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if not self.name or not self.agent:
            raise ValueError("a step needs a name and an agent")
        if self.timeout_s <= 0 or self.queue_timeout_s <= 0:
            raise ValueError(f"step {self.name}: timeout_s and queue_timeout_s must be positive")
        if self.attempt_budget < 1 or self.calls_per_attempt < 1:
            raise ValueError(f"step {self.name}: attempt_budget and calls_per_attempt must be at least 1")
        if isinstance(self.sensitive_output, frozenset) and (
            not self.sensitive_output or not all(isinstance(n, str) and n for n in self.sensitive_output)
        ):
            raise ValueError(f"step {self.name}: sensitive_output names at least one field, each a non-empty string")

    @property
    def is_sensitive(self) -> bool:
        return bool(self.sensitive_output)

    def sensitive_fields(self, output: Mapping[str, Any]) -> list[str]:
        """The fields of ``output`` its marking covers, in a stable order."""
        if self.sensitive_output is True:
            return sorted(output)
        if isinstance(self.sensitive_output, frozenset):
            return sorted(self.sensitive_output.intersection(output))
        return []


@dataclass(frozen=True)
class Workflow:
    """``failure_threshold``: failed attempts of one step (timeouts included) before escalation.
    ``escalation``: what a step that gives up does to its task: ``error`` (stop, alert an operator),
    ``compensate`` (undo what completed), or ``backoff``: past the threshold the step waits
    ``long_backoff_s``, then gets a fresh round of attempts (its failure count starts again; its call budget
    does not, so the budget stays exact), up to ``backoff_rounds`` extra rounds, then escalates as
    ``after_backoff`` says. A permanent failure or a spent budget escalates at once: waiting cannot help.
    ``step_total_s`` bounds a step's retries by time as ``backoff_rounds`` and the threshold bound them by
    count: no retry of a step (after a back-off, a deferral, a long back-off, or at once) is set to start
    later than this after the step's first attempt started, so time spent waiting on an open breaker counts
    against it although a deferral is no failed attempt; the step escalates instead, as it does past its
    last round. None (the default): only the counts bound it, and a deferral may follow a deferral for
    as long as the agents refuse to call.
    ``input_model``: the pydantic model a task's input must satisfy, checked on every way in (client, CLI,
    HTTP, outbox) before anything is produced, so a missing or mistyped field is refused naming it instead
    of running the task with it; None accepts any JSON object.
    ``sensitive_input``: the top-level input fields that are sealed from submission on (a card token, a
    national id): the client, CLI, HTTP API and outbox seal them before anything reaches Kafka, and only the
    agents open them (``scheduler.sealing``). Like ``sensitive_output``, fixed once a version ran.
    ``sensitive_retention_s``: how long the sensitive data of a task that completed or was compensated is
    kept; then the supervisor erases it (its data key is deleted). None keeps it until an operator erases it.
    A task in ``error`` or ``compensation_failed`` waits for an operator, who needs its data: not counted."""

    name: str
    version: int
    steps: tuple[Step, ...]
    failure_threshold: int = 3
    escalation: Escalation = "error"
    input_model: type[BaseModel] | None = None
    long_backoff_s: float = 300.0
    backoff_rounds: int = 3
    after_backoff: Literal["error", "compensate"] = "error"
    step_total_s: float | None = None
    sensitive_input: frozenset[str] = frozenset()
    sensitive_retention_s: float | None = None

    def __post_init__(self) -> None:
        if self.version < 1:
            raise ValueError(f"workflow {self.name}: version must be at least 1")
        if not self.steps:
            raise ValueError(f"workflow {self.name}: needs at least one step")
        names = [s.name for s in self.steps]
        if len(set(names)) != len(names):
            raise ValueError(f"workflow {self.name}: step names must be unique")
        if self.failure_threshold < 1:
            raise ValueError(f"workflow {self.name}: failure_threshold must be at least 1")
        if self.long_backoff_s <= 0 or self.backoff_rounds < 0:
            raise ValueError(f"workflow {self.name}: long_backoff_s must be positive and backoff_rounds not negative")
        if self.step_total_s is not None and self.step_total_s <= 0:
            raise ValueError(f"workflow {self.name}: step_total_s must be positive (or None: no total time)")
        if not all(isinstance(n, str) and n for n in self.sensitive_input):
            raise ValueError(f"workflow {self.name}: sensitive_input names fields, each a non-empty string")
        if self.sensitive_retention_s is not None and (self.sensitive_retention_s <= 0 or not self.has_sensitive_data):
            raise ValueError(f"workflow {self.name}: sensitive_retention_s must be positive, on a workflow that "
                             "marks sensitive data")
        for index, step in enumerate(self.steps):
            grantable = set(self.sensitive_input) | {f"{before.name}.{field}" for before in self.steps[:index]
                                                     for field in _marked_names(before)}
            unknown = sorted(name for name in step.opens if name not in grantable and
                             not any(name.startswith(f"{b.name}.") and b.sensitive_output is True
                                     for b in self.steps[:index]))
            if unknown:
                raise ValueError(f"workflow {self.name}: step {step.name} opens {', '.join(unknown)}: each must be a "
                                 "field of sensitive_input or a marked output field of an earlier step (step.field)")

    def input_errors(self, data: Mapping[str, Any], *, sealed: bool = False) -> list[tuple[str, str]]:
        """(field path, message) of each way ``data`` fails the input model; empty when it satisfies it.

        ``sealed``: the ``sensitive_input`` fields of ``data`` are ciphertext (the scheduler's view of a
        submission), so of them only presence is checked; their types were checked at the edge that sealed
        them, and nobody but an agent opens them."""
        if self.input_model is None:
            return []
        try:
            self.input_model.model_validate(data)
        except ValidationError as exc:
            errors = [(error["loc"], error["msg"]) for error in exc.errors()]
            return [(".".join(str(part) for part in loc), message) for loc, message in errors
                    if not (sealed and loc and loc[0] in self.sensitive_input and loc[0] in data)]
        return []

    def describe_input(self) -> str:
        """The input fields for people (``--help``, OpenAPI): name, JSON type, whether required, and whether
        sealed (encrypted from submission on, opened only by the steps that need it)."""
        sealed = f" (sealed: {', '.join(sorted(self.sensitive_input))})" if self.sensitive_input else ""
        if self.input_model is None:
            return "any JSON object" + sealed
        schema = self.input_model.model_json_schema()
        required = set(schema.get("required", []))
        return ", ".join(f"{name} ({spec.get('type', 'any')}{', required' if name in required else ''}"
                         f"{', sealed' if name in self.sensitive_input else ''})"
                         for name, spec in schema.get("properties", {}).items())

    def step(self, name: str) -> Step:
        for step in self.steps:
            if step.name == name:
                return step
        raise KeyError(name)

    @property
    def has_sensitive_data(self) -> bool:
        return bool(self.sensitive_input) or any(step.is_sensitive for step in self.steps)

    @property
    def agents(self) -> frozenset[str]:
        names = {s.agent for s in self.steps}
        names.update(s.compensation.agent for s in self.steps if s.compensation is not None)
        return frozenset(names)


@dataclass
class WorkflowRegistry:
    """Workflows by name and version. ``get(name)`` without a version is the latest."""

    _by_name: dict[str, dict[int, Workflow]] = field(default_factory=dict)

    @classmethod
    def of(cls, workflows: Iterable[Workflow]) -> WorkflowRegistry:
        registry = cls()
        for workflow in workflows:
            registry.register(workflow)
        return registry

    def register(self, workflow: Workflow) -> None:
        versions = self._by_name.setdefault(workflow.name, {})
        if workflow.version in versions and versions[workflow.version] != workflow:
            raise ValueError(f"workflow {workflow.name} v{workflow.version} is already registered differently")
        versions[workflow.version] = workflow

    def get(self, name: str, version: int | None = None) -> Workflow:
        versions = self._by_name.get(name)
        if not versions:
            raise WorkflowNotFoundError(f"no workflow named {name!r}")
        if version is None:
            return versions[max(versions)]
        try:
            return versions[version]
        except KeyError:
            raise WorkflowNotFoundError(f"workflow {name!r} has no version {version}") from None

    def describe_inputs(self) -> list[str]:
        """One line per workflow version: what its input must hold."""
        return [f"{w.name} v{w.version}: {w.describe_input()}"
                for w in sorted(self.workflows(), key=lambda w: (w.name, w.version))]

    def workflows(self) -> Iterator[Workflow]:
        for versions in self._by_name.values():
            yield from versions.values()

    @property
    def has_sensitive_data(self) -> bool:
        return any(workflow.has_sensitive_data for workflow in self.workflows())

    @property
    def agents(self) -> frozenset[str]:
        names: set[str] = set()
        for versions in self._by_name.values():
            for workflow in versions.values():
                names.update(workflow.agents)
        return frozenset(names)


def _marked_names(step: Step) -> frozenset[str]:
    """The output fields a step marks by name (one marking every field, ``True``, allows any name)."""
    return step.sensitive_output if isinstance(step.sensitive_output, frozenset) else frozenset()
