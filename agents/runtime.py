"""``stepstream run agent NAME``: calls one remote service for the steps the scheduler hands it.

An agent consumes ``agent.NAME`` with many attempts in flight, those of one task (one key) in offset
order (:mod:`eventstore.keyed`), and answers every request on ``inbox`` with the attempt id it was
given. It makes at most the calls the scheduler allowed for the attempt, never starts a call that cannot
finish before the attempt's deadline (the dependency's usual call time, or the policy's
``min_call_time_s``), and passes the step's idempotency key (stable across attempts) and the attempt
number (a fencing token) to the service, which is what makes redelivery after a crash safe.

Within one attempt (:class:`Attempt`: its calls, deadline, last fault and next delay), transient faults
are retried under the dependency's policy (:mod:`agents.policy`): back-off with jitter or the service's
Retry-After (:mod:`agents.retry`), a timeout on every call, the dependency's retry budget
(:mod:`agents.budget`), circuit breaker (:mod:`agents.breaker`) and pace (:mod:`agents.pace`), shared by
every attempt in flight. Whatever stops the retries -- the allowance, the deadline, the retry limit, a
spent budget, an open breaker, a throttle asking for a longer wait than an attempt waits -- the attempt is
answered as a transient failure carrying the calls actually made and the least wait the agent learned,
and the scheduler counts the calls against the step's end-to-end budget (so agent and supervisor retries
together never exceed it) and turns the wait into a durable timer. A throttled answer is not a failure of
the step, and an answer refused without a call (open breaker, spent budget) is a deferral.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import structlog
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client import Counter, Histogram

from agents.breaker import BreakerState
from agents.call import AgentHandler, Call
from agents.dependencies import Dependency, DependencyRegistry, outcome_of, transient_outcome
from agents.faults import (
    CircuitOpenError,
    Fault,
    PermanentError,
    RetryBudgetExhausted,
    TransientError,
    TransientKind,
    classify,
)
from agents.policy import AgentPolicy, DependencyPolicy, PolicyProvider, StaticPolicy
from agents.redaction import Redactor, redacting
from agents.retry import RetryPolicy
from agents.sealed_inputs import FieldNotGranted, SealedInputs
from eventstore.errors import PoisonMessageError
from eventstore.keyed import KeyedConsumerRuntime
from eventstore.keys import DataKeys
from eventstore.masking import masked
from eventstore.producer import EventProducer, Headers
from eventstore.runtime import Record
from eventstore.settings import ConsumerSettings, KafkaSettings
from eventstore.topics import TopicLayout
from eventstore.tracing import headers_of, span_for, tracer
from schemas.avro import utc_millis
from schemas.messages import AgentRequest, AttemptAccepted, ErrorKind, StepResult
from schemas.sealed import EncryptionSettings, Keyring, SealingError

__all__ = [
    "Agent",
    "AgentHandler",
    "AttemptAbandoned",
    "Call",
    "CircuitOpenError",
    "FieldNotGranted",
    "PermanentError",
    "RetryBudgetExhausted",
    "RetryPolicy",
    "TransientError",
    "build_agent",
]

log = structlog.get_logger("stepstream.agent")

_ERROR_KIND: dict[TransientKind, ErrorKind] = {
    "throttled": "throttled", "timeout": "timeout", "connection": "connection", "server_error": "server_error",
    "circuit_open": "breaker_open", "retry_budget": "budget_spent",
}
"""The agent's fault kinds as the scheduler knows them: a refusal to call is what the breaker or budget did."""

_SECONDS = (0.005, 0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30)
CALLS = Counter("stepstream_agent_calls_total",
                "Calls made to remote services, by outcome: ok, throttled, failed, timed_out, rejected",
                ["agent", "dependency", "outcome"])
RETRIES = Counter("stepstream_agent_retries_total", "Retries decided after a transient fault, by cause",
                  ["agent", "dependency", "cause"])
GAVE_UP = Counter("stepstream_agent_attempts_failed_transiently_total",
                  "Attempts answered as a transient failure, by what stopped the retries",
                  ["agent", "dependency", "reason"])
CALL_SECONDS = Histogram("stepstream_agent_call_seconds", "Time of one call to a dependency",
                         ["agent", "dependency"], buckets=_SECONDS)
QUEUE_WAIT_SECONDS = Histogram("stepstream_agent_queue_wait_seconds",
                               "Time a request waited for this agent to take it (attempt start to acceptance)",
                               ["agent"], buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300))
STEP_SECONDS = Histogram("stepstream_agent_step_seconds",
                         "Time to answer one attempt, retries and back-off included, by how the answer ended: "
                         "ok, throttled, failed, timed_out, rejected", ["agent", "dependency", "outcome"],
                         buckets=_SECONDS)


#: Waits ``seconds``; returns True if woken because the agent is stopping (``threading.Event.wait``).
Sleeper = Callable[[float], bool]


#: Why an attempt stops: the reason (a metric label), the words for the error, the refusal (no call made).
Stop = tuple[str, str, TransientError | None]
PACE_POLL_S = 0.01
"""How often an attempt waiting for its dependency's pace looks again (calls end within milliseconds)."""
PACED_OUT_WAIT_S = 1.0
"""The least wait asked of the scheduler for an attempt its dependency's pace kept from calling."""


@dataclass
class Attempt:
    """One attempt in progress: what it has spent, its deadline (monotonic), what it last learned."""

    request: AgentRequest
    started: float
    deadline: float
    calls: int = 0
    retries: int = 0
    last: TransientError | None = None
    answered_at: float = 0.0
    """When ``last`` was answered: a wait the service asked for runs from then."""
    next_delay_s: float = 0.0
    """The wait before the next call, once ``last`` is known (Retry-After, or the back-off)."""


class AttemptAbandoned(Exception):
    """The agent is draining mid-retry: leave the request uncommitted so the next owner redoes it."""

    retryable = True


def _provider(policy: PolicyProvider | AgentPolicy | DependencyPolicy | RetryPolicy | None) -> PolicyProvider:
    if policy is None or isinstance(policy, AgentPolicy | DependencyPolicy | RetryPolicy):
        return StaticPolicy(policy)
    return policy


class Agent:
    """Runs attempts of steps against one dependency (``dependency``, by default the agent's name).

    ``policy`` is where the fault-handling policy comes from -- a provider that may change it at run time
    (:class:`agents.policy.FilePolicy`), or a fixed policy. ``dependencies`` holds the breaker, retry
    budget and pace, shared by every agent given the same registry (agents built from a project share the
    process's, :func:`agents.dependencies.process_registry`; by default an agent has its own). ``sleep``,
    ``monotonic``, ``now`` and ``rng`` are injectable so tests can observe and steer back-off without patching.
    """

    def __init__(self, name: str, handler: AgentHandler,
                 policy: PolicyProvider | AgentPolicy | DependencyPolicy | RetryPolicy | None = None,
                 stopping: threading.Event | None = None, *, dependency: str | None = None,
                 dependencies: DependencyRegistry | None = None, sleep: Sleeper | None = None,
                 monotonic: Callable[[], float] = time.monotonic,
                 now: Callable[[], datetime] = lambda: datetime.now(UTC),
                 rng: random.Random | None = None) -> None:
        self.name = name
        self.handler = handler
        self.policies = _provider(policy)
        self.dependency = dependency or name
        self.dependencies = dependencies or DependencyRegistry(monotonic)
        # Set when the process drains: a back-off sleep ends at once instead of holding the drain up.
        self.stopping = stopping or threading.Event()
        self._sleep: Sleeper = sleep or self.stopping.wait
        self._monotonic = monotonic
        self._now = now
        self._rng = rng or random.Random()

    def _guard(self) -> tuple[DependencyPolicy, Dependency]:
        """The policy in force now and the dependency it has been applied to (asked before every call)."""
        policy = self.policies.current().for_dependency(self.dependency)
        return policy, self.dependencies.get(self.dependency, policy)

    def execute(self, request: AgentRequest, accepted_at: datetime | None = None) -> StepResult:
        """Run one attempt, taken at ``accepted_at`` (default: now), to an answer; every outcome is a result
        for the scheduler, unless draining. Its deadline is the request's work deadline from that moment,
        placed on the agent's monotonic clock once, from one reading of each clock."""
        started, wall = self._monotonic(), self._now()
        deadline = started + (request.work_deadline(accepted_at or wall) - wall).total_seconds()
        attempt = Attempt(request, started, deadline)
        while True:
            policy, dep = self._guard()
            refused = self._refusal(attempt, dep)
            if refused is not None:
                return self._give_up(attempt, *refused)
            began = self._admit(attempt, dep)
            if began is None:
                # Paced out: like a throttle, not a failure of the step; the scheduler tries again later.
                paced = TransientError(f"{self.dependency!r} is at the limit its throttles set "
                                       f"({dep.pace.snapshot().limit:.1f} calls in flight) until the deadline",
                                       kind="throttled", retry_after_s=PACED_OUT_WAIT_S)
                return self._give_up(attempt, "paced", str(paced), paced)
            if not dep.breaker.try_acquire():
                dep.pace.finished(began)
                refusal = CircuitOpenError(self.dependency, dep.breaker.retry_in_s())
                return self._give_up(attempt, "circuit_open", str(refusal), refusal)
            fault, output = self._call(attempt, policy, dep, began)
            if fault is None:
                return self._answer(attempt, True, output=output)
            if isinstance(fault, PermanentError):
                log.error("permanent failure", cause=fault.kind, call=attempt.calls, error=str(fault),
                          exc_info=fault if fault.kind == "unexpected" else False, **self._context(request))
                return self._answer(attempt, False, error=str(fault), permanent=True, kind="permanent")
            stop = self._retry_or_stop(attempt, policy, dep, fault)
            if stop is not None:
                return self._give_up(attempt, *stop)
            if self._sleep(attempt.next_delay_s):
                raise AttemptAbandoned(f"draining during a back-off; last error: {fault}") from fault

    def _refusal(self, attempt: Attempt, dep: Dependency) -> Stop | None:
        """Why no call may start now: the deadline, the allowance; None when one may."""
        request = attempt.request
        remaining = attempt.deadline - self._monotonic()
        if remaining <= 0:
            return "deadline", "deadline passed", None
        needed = dep.time_needed()
        if remaining < needed:
            # A call cut off by the deadline may still land at the service: an unknown outcome the
            # task would have to undo. Not starting it leaves nothing unknown.
            return ("deadline", f"{remaining:.3f}s left before the deadline, a call needs {needed:.3f}s: not started",
                    None)
        if attempt.calls >= request.calls_allowed:
            return "allowance", f"call allowance of {request.calls_allowed} spent", None
        return None

    def _admit(self, attempt: Attempt, dep: Dependency) -> float | None:
        """Wait for the dependency's pace to admit a call: the call's start, or None when the deadline came
        first. Calls end within milliseconds, so a short poll on the attempt's own sleeper serves."""
        while True:
            began = dep.pace.try_start()
            if began is not None:
                return began
            if attempt.deadline - self._monotonic() - PACE_POLL_S < dep.time_needed():
                return None
            if self._sleep(PACE_POLL_S):
                raise AttemptAbandoned("draining while waiting for the dependency's pace")

    def _call(self, attempt: Attempt, policy: DependencyPolicy, dep: Dependency,
              began: float) -> tuple[Fault | None, dict[str, Any]]:
        """Make one call; record its outcome with the dependency (breaker, pace, counts)."""
        attempt.calls += 1
        if attempt.retries == 0 and attempt.calls == 1:
            dep.first_call()
        remaining = attempt.deadline - self._monotonic()
        fault: Fault | None = None
        output: dict[str, Any] = {}
        with tracer.start_as_current_span(f"call {self.dependency}", kind=SpanKind.CLIENT,
                                          attributes={"stepstream.call": attempt.calls}) as span:
            try:
                output = self.handler(Call(attempt.request, min(policy.retry.call_timeout_s, remaining)))
            except Exception as exc:
                fault = classify(exc)
                span.set_status(StatusCode.ERROR, masked(f"{fault.kind}: {fault}"))  # no opened value
            except BaseException:
                dep.breaker.release()
                dep.pace.finished(began)
                raise
        call_s = self._monotonic() - began
        CALL_SECONDS.labels(self.name, self.dependency).observe(call_s)
        if fault is None or isinstance(fault, PermanentError) or fault.status is not None:
            dep.answered_in(call_s)  # the service answered: a timeout or a dropped connection says nothing
        dep.record(began, fault)
        CALLS.labels(self.name, self.dependency, outcome_of(fault)).inc()
        return fault, output

    def _retry_or_stop(self, attempt: Attempt, policy: DependencyPolicy, dep: Dependency,
                       fault: TransientError) -> Stop | None:
        """After a transient fault: the delay before the next call (``attempt.next_delay_s``), or why not.

        A throttle's wait is the service's ``Retry-After`` (stretched upward a little); one longer than the
        policy's ``pace.wait_in_attempt_s`` ends the attempt, and the scheduler's timer waits it out, so the
        agent's slot serves other tasks meanwhile. A throttle spends no retry budget: its retry waits as long
        as the service asks, which is the pacing the budget exists to force on failures.
        """
        attempt.last = fault
        attempt.answered_at = self._monotonic()
        attempt.next_delay_s = policy.retry.delay(attempt.retries + 1, self._rng, fault.retry_after_s)
        throttled = fault.kind == "throttled"
        request = attempt.request
        if attempt.calls >= request.calls_allowed:
            return "allowance", f"call allowance of {request.calls_allowed} spent", None
        if attempt.retries >= policy.retry.max_retries:
            return "retry_limit", f"retry limit of {policy.retry.max_retries} reached", None
        delay = attempt.next_delay_s
        asked = delay if fault.retry_after_s is None else fault.retry_after_s
        if throttled and asked > policy.pace.wait_in_attempt_s:
            return "throttled", f"throttled; the wait asked, {asked:.3f}s, is left to the scheduler", None
        if delay + dep.time_needed() >= attempt.deadline - self._monotonic():
            return "deadline", f"the next call, {delay:.3f}s away, could not finish before the deadline", None
        if dep.breaker.state is BreakerState.OPEN:
            refusal = CircuitOpenError(self.dependency, dep.breaker.retry_in_s())
            return "circuit_open", str(refusal), refusal
        if not throttled and not dep.try_retry():
            spent = RetryBudgetExhausted(self.dependency)
            return "retry_budget", str(spent), spent
        attempt.retries += 1
        RETRIES.labels(self.name, self.dependency, fault.kind).inc()
        log.debug("retrying", cause=fault.kind, retry=attempt.retries, delay_s=round(delay, 3),
                  **self._context(request))
        return None

    def _give_up(self, attempt: Attempt, reason: str, why: str, refused: TransientError | None) -> StepResult:
        """Stop retrying: a transient failure, so the scheduler may try again within the step's budget.

        What the agent learned goes back with it: the kind of fault (a throttle's, when the last call was
        throttled, so the scheduler counts no failure; else the refusal's, else the last call's) and the
        least the next attempt should wait, measured from now: a refusal's (the breaker's remaining open
        time) or the wait the service asked for less the time since.
        """
        GAVE_UP.labels(self.name, self.dependency, reason).inc()
        last = attempt.last
        error = f"{why} after {attempt.calls} call(s)" + (f"; last error: {last}" if last is not None else "")
        throttled = last is not None and last.kind == "throttled"
        # Throttles are counted per dependency (Tally), not logged per attempt: a storm of them is one line.
        (log.debug if throttled else log.warning)("attempt failed transiently", reason=reason, calls=attempt.calls,
                                                  error=error, **self._context(attempt.request))
        wait: float | None = None
        if refused is not None and not throttled:
            wait = refused.retry_after_s
        elif last is not None and last.retry_after_s is not None:
            wait = max(0.0, attempt.next_delay_s - (self._monotonic() - attempt.answered_at))
        # A refusal names the kind, unless a call was made and the refusal would disguise it: a failure
        # then paced out stays a failure, a throttle then refused stays a throttle.
        disguised = last is not None and (throttled or refused is None or refused.kind == "throttled")
        fault = last if disguised else refused
        kind = _ERROR_KIND[fault.kind] if fault is not None else None
        return self._answer(attempt, False, error=error, kind=kind, retry_after_s=wait)

    def _answer(self, attempt: Attempt, ok: bool, *, output: dict[str, Any] | None = None,
                error: str | None = None, permanent: bool = False, kind: ErrorKind | None = None,
                retry_after_s: float | None = None) -> StepResult:
        request = attempt.request
        outcome = "ok" if ok else "rejected" if permanent else transient_outcome(kind)
        STEP_SECONDS.labels(self.name, self.dependency, outcome).observe(self._monotonic() - attempt.started)
        return StepResult(task_id=request.task_id, step=request.step, attempt_id=request.attempt_id, ok=ok,
                          output=output, error=error, permanent=permanent, calls=attempt.calls, error_kind=kind,
                          retry_after_s=retry_after_s)

    def _context(self, request: AgentRequest) -> dict[str, Any]:
        return {"agent": self.name, "dependency": self.dependency, "task_id": request.task_id, "step": request.step,
                "attempt": request.attempt}

    def handle(self, record: Record, output: EventProducer, inbox: str, inputs: SealedInputs | None = None) -> None:
        """Take one request: acknowledge it (its work deadline starts now), then run it and answer.

        The acknowledgement and the answer go to the same inbox partition (same key) from the same
        idempotent producer, so the scheduler sees them in that order. A request taken after its start-by
        is answered at once without a call: the scheduler may already have given up on it, and an attempt
        that never called leaves nothing to undo. A redelivered request (after a crash) is acknowledged
        again; the scheduler ignores the second one.

        ``inputs`` opens the request's sealed fields just before the call (the request stays sealed while it
        waits); a value that does not open (the task's data was erased) is a permanent failure with no call.
        """
        request = record.message
        if not isinstance(request, AgentRequest):
            raise PoisonMessageError(f"{type(request).__name__} is not an agent request")
        with span_for(request.task_id, f"agent {self.name}", record.headers, kind=SpanKind.CONSUMER,
                      **{"stepstream.step": request.step, "stepstream.attempt_id": request.attempt_id}) as span:
            self._handle(request, output, inbox, inputs, headers_of(span.get_span_context()))

    def _handle(self, request: AgentRequest, output: EventProducer, inbox: str, inputs: SealedInputs | None,
                headers: Headers) -> None:
        if request.not_before is not None:
            self._wait_until(request)
        accepted_at = utc_millis(self._now())
        if request.start_by is not None:
            if accepted_at > request.start_by:
                output.send(inbox, self._unstarted(request, accepted_at), headers=headers)
                return
            QUEUE_WAIT_SECONDS.labels(self.name).observe(max(0.0, (accepted_at - request.occurred_at).total_seconds()))
            output.send(inbox, AttemptAccepted(task_id=request.task_id, step=request.step,
                                               attempt_id=request.attempt_id, compensation=request.compensation,
                                               accepted_at=accepted_at), headers=headers)
        if inputs is None:
            output.send(inbox, self.execute(request, accepted_at), headers=headers)
            return
        try:
            request, redactor = inputs.open(request)
        except SealingError as exc:
            log.error("sealed input does not open", error=str(exc), agent=self.name, task_id=request.task_id,
                      step=request.step, attempt=request.attempt)
            output.send(inbox, StepResult(task_id=request.task_id, step=request.step,
                                          attempt_id=request.attempt_id, ok=False, error=str(exc),
                                          permanent=True, calls=0), headers=headers)
            return
        with redacting(redactor):
            result = self._execute_masked(request, accepted_at, redactor)
        output.send(inbox, inputs.answer(request, result, redactor), headers=headers)

    def _execute_masked(self, request: AgentRequest, accepted_at: datetime, redactor: Redactor) -> StepResult:
        """:meth:`execute` for a request holding opened values: an attempt abandoned by a drain leaves with its
        message masked and without its cause (whose text may quote a value), as a span or log records it."""
        try:
            return self.execute(request, accepted_at)
        except AttemptAbandoned as exc:
            if not redactor:
                raise
            raise AttemptAbandoned(redactor.text(str(exc))) from None

    def _wait_until(self, request: AgentRequest) -> None:
        """Hold an undo until its ``not_before``: the forward call it undoes may land until then at a service
        that cannot refuse it. The task's key is held meanwhile (its next step is this undo anyway); a
        drain leaves the request uncommitted, to be taken again after the restart."""
        assert request.not_before is not None
        wait_s = (request.not_before - self._now()).total_seconds()
        if wait_s <= 0:
            return
        log.info("undo waits for the forward call to land", wait_s=round(wait_s, 3), agent=self.name,
                 task_id=request.task_id, step=request.step, attempt=request.attempt)
        if self._sleep(wait_s):
            raise AttemptAbandoned(f"draining while the undo waited {wait_s:.3f}s for its forward call to land")

    def _unstarted(self, request: AgentRequest, accepted_at: datetime) -> StepResult:
        """The answer to a request taken after its start-by: a transient failure that made no call."""
        assert request.start_by is not None
        GAVE_UP.labels(self.name, self.dependency, "start_by").inc()
        error = (f"not started: taken at {accepted_at.isoformat()}, after its start-by "
                 f"{request.start_by.isoformat()}; no call made")
        log.warning("attempt not started", reason="start_by", error=error, agent=self.name, task_id=request.task_id,
                    step=request.step, attempt=request.attempt)
        return StepResult(task_id=request.task_id, step=request.step, attempt_id=request.attempt_id, ok=False,
                          error=error, permanent=False, calls=0)


def build_agent(kafka: KafkaSettings, consumer: ConsumerSettings, agent: Agent, concurrency: int = 1,
                keyring: Keyring | None = None, *, keys: DataKeys | None = None,
                output: EventProducer | None = None) -> KeyedConsumerRuntime:
    """The agent on the keyed runtime: up to ``concurrency`` attempts in flight, one at a time per task.

    The breaker, retry budget and policy are the agent's, so every concurrent attempt shares them.
    ``keyring`` (default: ``STEPSTREAM_ENCRYPTION_KEYS``) opens the sealed fields of its requests. ``keys``
    and ``output`` are what an agent host shares between its agents: the reader of data keys (a task's key
    read once for all its steps) and the producer (``EventProducer.share``); by default the agent's own.
    """
    layout = TopicLayout.from_settings(kafka)
    inputs = SealedInputs(keys or DataKeys(kafka.resolved_bootstrap(), layout.keys),
                          keyring or EncryptionSettings().keyring())
    return KeyedConsumerRuntime(
        concurrency=concurrency,
        bootstrap=kafka.resolved_bootstrap(),
        group_id=layout.agent_group(agent.name),
        topics=[layout.agent(agent.name)],
        handler=lambda record, output: agent.handle(record, output, layout.inbox, inputs),
        dlq_topic=layout.dlq,
        settings=consumer,
        stop_event=agent.stopping,
        output=output,
    )
