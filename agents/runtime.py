"""``stepstream run agent NAME``: calls one remote service for the steps the scheduler hands it.

An agent consumes ``agent.NAME`` in partition order and answers every request on ``inbox`` with the
attempt id it was given. It makes at most the calls the scheduler allowed for the attempt, never starts
a call after the attempt's deadline, and passes the step's idempotency key (stable across attempts) and
the attempt number (a fencing token) to the service, which is what makes redelivery after a crash safe.
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
from prometheus_client import Counter, Histogram

from eventstore.errors import PoisonMessageError
from eventstore.producer import EventProducer
from eventstore.runtime import ConsumerRuntime, Record
from eventstore.settings import ConsumerSettings, KafkaSettings
from eventstore.topics import TopicLayout
from schemas.messages import AgentRequest, StepResult

log = structlog.get_logger("stepstream.agent")

CALLS = Counter("stepstream_agent_calls_total", "Calls made to remote services", ["agent", "outcome"])
STEP_SECONDS = Histogram("stepstream_agent_step_seconds", "Time to answer one attempt, retries included",
                         ["agent"], buckets=(0.005, 0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30))


class PermanentError(Exception):
    """The service said no for good (validation, 4xx): retrying cannot help."""

    retryable = False


class TransientError(Exception):
    """Worth another call later (timeout, connection, 429, 5xx); ``retry_after_s`` is the service's hint."""

    retryable = True

    def __init__(self, message: str, *, retry_after_s: float | None = None, kind: str = "server_error") -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.kind = kind


@dataclass(frozen=True)
class Call:
    """What a handler needs for one call: the data, the idempotency key, the fencing token, the time left."""

    request: AgentRequest
    timeout_s: float

    @property
    def idempotency_key(self) -> str:
        return self.request.idempotency_key

    @property
    def attempt(self) -> int:
        return self.request.attempt


AgentHandler = Callable[[Call], dict[str, Any]]


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded retry within one attempt: exponential back-off with jitter, Retry-After honoured."""

    initial_backoff_s: float = 0.1
    max_backoff_s: float = 5.0
    call_timeout_s: float = 10.0

    def delay(self, retry: int, retry_after_s: float | None, rng: random.Random) -> float:
        if retry_after_s is not None:
            return retry_after_s
        ceiling = min(self.max_backoff_s, self.initial_backoff_s * 2 ** (retry - 1))
        return rng.uniform(ceiling / 2, ceiling)


class AttemptAbandoned(Exception):
    """The agent is draining mid-retry: leave the request uncommitted so the next owner redoes it."""

    retryable = True


class Agent:
    def __init__(self, name: str, handler: AgentHandler, policy: RetryPolicy | None = None,
                 stopping: threading.Event | None = None) -> None:
        self.name = name
        self.handler = handler
        self.policy = policy or RetryPolicy()
        self._rng = random.Random()
        # Set when the process drains: a back-off sleep ends at once instead of holding the drain up.
        self.stopping = stopping or threading.Event()

    def execute(self, request: AgentRequest) -> StepResult:
        """Run one attempt to an answer; every outcome is a result for the scheduler, unless draining."""
        started = time.monotonic()
        calls = 0
        last_error = "no call made"

        def answer(ok: bool, *, output: dict[str, Any] | None = None, error: str | None = None,
                   permanent: bool = False) -> StepResult:
            STEP_SECONDS.labels(self.name).observe(time.monotonic() - started)
            return StepResult(task_id=request.task_id, step=request.step, attempt_id=request.attempt_id, ok=ok,
                              output=output, error=error, permanent=permanent, calls=calls)

        while True:
            remaining = (request.complete_by - datetime.now(UTC)).total_seconds()
            if remaining <= 0:
                return answer(False, error=f"deadline passed after {calls} calls; last error: {last_error}")
            if calls >= request.calls_allowed:
                return answer(False, error=f"call allowance of {request.calls_allowed} spent; last error: {last_error}")
            calls += 1
            try:
                output = self.handler(Call(request, min(self.policy.call_timeout_s, remaining)))
            except PermanentError as exc:
                CALLS.labels(self.name, "permanent").inc()
                log.error("permanent failure", agent=self.name, task_id=request.task_id, step=request.step,
                          attempt=request.attempt, error=str(exc))
                return answer(False, error=str(exc), permanent=True)
            except TransientError as exc:
                CALLS.labels(self.name, "transient").inc()
                last_error = str(exc)
                delay = self.policy.delay(calls, exc.retry_after_s, self._rng)
                log.warning("transient failure", agent=self.name, task_id=request.task_id, step=request.step,
                            attempt=request.attempt, call=calls, kind=exc.kind, error=last_error,
                            delay_s=round(delay, 3))
                left = (request.complete_by - datetime.now(UTC)).total_seconds()
                if calls >= request.calls_allowed or delay >= left:
                    return answer(False, error=last_error)
                if self.stopping.wait(delay):
                    raise AttemptAbandoned(f"draining during a back-off; last error: {last_error}") from exc
                continue
            CALLS.labels(self.name, "ok").inc()
            return answer(True, output=output)

    def handle(self, record: Record, output: EventProducer, inbox: str) -> None:
        request = record.message
        if not isinstance(request, AgentRequest):
            raise PoisonMessageError(f"{type(request).__name__} is not an agent request")
        output.send(inbox, self.execute(request))


def build_agent(kafka: KafkaSettings, consumer: ConsumerSettings, agent: Agent) -> ConsumerRuntime:
    layout = TopicLayout.from_settings(kafka)
    runtime = ConsumerRuntime(
        bootstrap=kafka.resolved_bootstrap(),
        group_id=f"{layout.prefix}agent.{agent.name}",
        topics=[layout.agent(agent.name)],
        handler=lambda record, output: agent.handle(record, output, layout.inbox),
        dlq_topic=layout.dlq,
        settings=consumer,
        stop_event=agent.stopping,
    )
    return runtime
