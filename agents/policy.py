"""One central fault-handling policy for every dependency, changeable while agents run.

Retry, retry-budget and breaker settings live in one document rather than in each agent's code, so an
operator can slow retries to a struggling service, or open its breaker sooner, in one place and without a
restart. The document (TOML or JSON, chosen by the file's extension)::

    [defaults.retry]                 # every dependency without its own setting
    strategy = "exponential"         # or "incremental", "regular"
    max_retries = 3
    initial_backoff_s = 0.1
    max_backoff_s = 5.0
    jitter = 0.5
    call_timeout_s = 10.0

    [defaults.breaker]
    failure_threshold = 5
    window_s = 10.0
    open_for_s = 5.0

    [defaults]                       # which faults the breaker counts (throttles are left out)
    breaker_records = ["timeout", "connection", "server_error"]

    [defaults.pace]                  # how throttles slow a dependency down (agents.pace)
    decrease = 0.7
    wait_in_attempt_s = 1.0

    [dependencies.orders.retry]      # only what differs for "orders"; the rest comes from defaults
    max_retries = 5

    [dependencies.orders.budget]
    retries_per_window = 30
    window_s = 60.0

Layers, lowest first: the built-in defaults, the agent's settings (``STEPSTREAM_AGENT_*``: the base
given to the provider), the file's ``defaults``, the file's ``dependencies.<name>``. Merging is field by
field, so a dependency overrides one number without repeating the rest.

Everything is validated with pydantic (unknown keys included, so a typo cannot silently leave a
default in force). :class:`FilePolicy` reads the file at start -- a bad or missing file then stops the
agent, loudly, at deploy time -- and afterwards re-reads it at most every ``poll_interval_s``, when the
agent asks for the policy before a call (so the next call sees a change; there is no thread to manage),
applying it when its content changed. A bad file at run time is refused with a message naming the field, and the
previous policy stays in force.
"""

from __future__ import annotations

import json
import threading
import time
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, Protocol

import structlog
from prometheus_client import Counter
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agents.breaker import BreakerPolicy
from agents.budget import BudgetPolicy
from agents.faults import Fault, PermanentError, TransientKind
from agents.pace import PacePolicy
from agents.retry import RetryPolicy

log = structlog.get_logger("stepstream.agent.policy")

POLICY_RELOADS = Counter("stepstream_agent_policy_reloads_total",
                         "Policy file reloads at run time, applied or refused", ["outcome"])


class PolicyError(ValueError):
    """A policy document that cannot be used; the message names the file and the offending fields."""


#: What the breaker makes of a call's outcome: a success, a failure, or nothing at all (ignored).
Verdict = Literal["success", "failure", "ignored"]


class DependencyPolicy(BaseModel):
    """Everything that governs calls to one dependency.

    ``breaker_records`` is which transient faults the breaker counts as failures (resilience4j's recorded
    exceptions): by default a service that is down -- refused connections, timeouts, 5xx without
    ``Retry-After``. A throttle is the service pacing us (:mod:`agents.pace`), so it is ignored unless named
    here; a permanent refusal is an answer, so it counts as a success (the service is up).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    retry: RetryPolicy = Field(default_factory=RetryPolicy)
    budget: BudgetPolicy = Field(default_factory=BudgetPolicy)
    breaker: BreakerPolicy = Field(default_factory=BreakerPolicy)
    pace: PacePolicy = Field(default_factory=PacePolicy)
    breaker_records: frozenset[TransientKind] = frozenset({"timeout", "connection", "server_error"})

    def verdict(self, fault: Fault | None) -> Verdict:
        """What the breaker records for a call that ended with ``fault`` (None: it succeeded)."""
        if fault is None or isinstance(fault, PermanentError):
            return "success"
        return "failure" if fault.kind in self.breaker_records else "ignored"


class AgentPolicy(BaseModel):
    """The whole document: defaults, and complete (already merged) policies of named dependencies."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    defaults: DependencyPolicy = Field(default_factory=DependencyPolicy)
    dependencies: dict[str, DependencyPolicy] = Field(default_factory=dict)

    def for_dependency(self, name: str) -> DependencyPolicy:
        return self.dependencies.get(name, self.defaults)


class PolicyProvider(Protocol):
    """Where an agent gets its policy; asked before every call, so it must be cheap."""

    def current(self) -> AgentPolicy: ...


class StaticPolicy:
    """A policy that never changes (tests, or an agent configured only by environment)."""

    def __init__(self, policy: AgentPolicy | DependencyPolicy | RetryPolicy | None = None) -> None:
        if policy is None:
            policy = AgentPolicy()
        elif isinstance(policy, RetryPolicy):
            policy = AgentPolicy(defaults=DependencyPolicy(retry=policy))
        elif isinstance(policy, DependencyPolicy):
            policy = AgentPolicy(defaults=policy)
        self._policy = policy

    def current(self) -> AgentPolicy:
        return self._policy


def _merge(base: Any, override: Any) -> Any:
    """Deep merge of two mappings, override winning; anything else is the override as is (pydantic judges)."""
    if isinstance(base, Mapping) and isinstance(override, Mapping):
        merged = dict(base)
        for key, value in override.items():
            merged[key] = _merge(base.get(key), value) if key in base else value
        return merged
    return override


def _describe(exc: ValidationError, prefix: tuple[str | int, ...] = ()) -> str:
    parts = []
    for error in exc.errors():
        where = ".".join(str(p) for p in (*prefix, *error["loc"])) or "(document)"
        parts.append(f"{where}: {error['msg']}")
    return "; ".join(parts)


def parse_policy(data: Any, base: DependencyPolicy | None = None) -> AgentPolicy:
    """Validate a policy document (already decoded) over ``base``; raise :class:`PolicyError` naming fields."""
    if not isinstance(data, Mapping):
        raise PolicyError(f"the policy must be a table/object with 'defaults' and 'dependencies', "
                          f"not {type(data).__name__}")
    unknown = sorted(set(data) - {"defaults", "dependencies"})
    if unknown:
        raise PolicyError(f"{', '.join(unknown)}: unknown key (expected 'defaults' and 'dependencies')")
    raw_defaults = _merge((base or DependencyPolicy()).model_dump(), data.get("defaults", {}))
    try:
        defaults = DependencyPolicy.model_validate(raw_defaults)
    except ValidationError as exc:
        raise PolicyError(_describe(exc, ("defaults",))) from exc
    raw_dependencies = data.get("dependencies", {})
    if not isinstance(raw_dependencies, Mapping):
        raise PolicyError("dependencies: must be a table/object of dependency names")
    merged = {name: _merge(defaults.model_dump(), override) for name, override in raw_dependencies.items()}
    try:
        return AgentPolicy.model_validate({"defaults": defaults, "dependencies": merged})
    except ValidationError as exc:
        raise PolicyError(_describe(exc)) from exc


def read_policy_file(path: Path, base: DependencyPolicy | None = None) -> AgentPolicy:
    """Read and validate a TOML (``.toml``) or JSON (anything else) policy file."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise PolicyError(f"policy file {path}: cannot read: {exc}") from exc
    return parse_policy_bytes(path, raw, base)


def parse_policy_bytes(path: Path, raw: bytes, base: DependencyPolicy | None = None) -> AgentPolicy:
    """Decode (TOML for ``.toml``, else JSON) and validate the content of the policy file ``path``."""
    is_toml = path.suffix.lower() == ".toml"
    try:
        data = tomllib.loads(raw.decode()) if is_toml else json.loads(raw)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PolicyError(f"policy file {path}: not valid {'TOML' if is_toml else 'JSON'}: {exc}") from exc
    try:
        return parse_policy(data, base)
    except PolicyError as exc:
        raise PolicyError(f"policy file {path}: {exc}") from exc


class FilePolicy:
    """The policy from a file, re-read when the file changes (see the module docstring)."""

    def __init__(self, path: Path | str, *, base: DependencyPolicy | None = None, poll_interval_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.path = Path(path)
        self.base = base or DependencyPolicy()
        self.poll_interval_s = poll_interval_s
        self._clock = clock
        self._lock = threading.Lock()
        try:
            self._seen: bytes | None = self.path.read_bytes()
        except OSError as exc:
            raise PolicyError(f"policy file {self.path}: cannot read: {exc}") from exc
        self._policy = parse_policy_bytes(self.path, self._seen, self.base)  # a bad file at start stops the agent
        self._next_check = clock() + poll_interval_s
        log.info("policy loaded", path=str(self.path), dependencies=sorted(self._policy.dependencies))

    def current(self) -> AgentPolicy:
        """The policy in force, after re-reading the file if the poll interval has passed."""
        if self._clock() >= self._next_check:
            self.check()
        return self._policy

    def check(self) -> bool:
        """Re-read the file now; True if it changed and the new policy was applied.

        Content, not mtime, decides whether it changed: mtimes are as coarse as a few milliseconds on
        Linux, so two quick edits of the same size could otherwise go unnoticed; the file is tiny.
        """
        with self._lock:
            self._next_check = self._clock() + self.poll_interval_s
            content = self._read()
            if content == self._seen:
                return False
            self._seen = content  # judged once per change: a bad file is not re-logged every poll
            if content is None:
                log.warning("policy file gone; the previous policy stays in force", path=str(self.path))
                return False
            try:
                policy = parse_policy_bytes(self.path, content, self.base)
            except PolicyError as exc:
                POLICY_RELOADS.labels("refused").inc()
                log.error("policy refused; the previous policy stays in force", path=str(self.path), error=str(exc))
                return False
            self._policy = policy
            POLICY_RELOADS.labels("applied").inc()
            log.info("policy reloaded", path=str(self.path), dependencies=sorted(policy.dependencies))
            return True

    def _read(self) -> bytes | None:
        try:
            return self.path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("policy file unreadable; the previous policy stays in force", path=str(self.path),
                        error=str(exc))
            return self._seen  # treated as unchanged
