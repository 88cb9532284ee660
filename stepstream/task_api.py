"""The write side of the HTTP API: submit tasks and send operator commands, behind a bearer token.

The scheduler, not this API, decides whether a task is admitted: a submission is produced on ``inbox``
and the API waits (``STEPSTREAM_API_DECISION_TIMEOUT_S``) for the scheduler's first event caused by it,
read from ``events``. So the answer is the system's own: 201 admitted, 429 refused by admission control
(``Retry-After``), 409 a contradiction of an existing task. What the API can tell on its own it answers
without producing anything: 401 without a valid token, 422 for an invalid submission (the field named),
200 for a repeat of a known submission, 409 for the same task id with other data, 429 when the global
in-flight estimate (non-terminal tasks in the state store plus the scheduler's backlog on ``inbox``) is at
its bound. When the scheduler does not answer in time the submission is on the log anyway: 202, and
``GET /api/tasks/{id}`` follows it.
"""

from __future__ import annotations

import hmac
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Annotated, Any

import orjson
import structlog
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
from fastapi import APIRouter, Depends, HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import Counter
from pydantic import BaseModel, ConfigDict, Field

from eventstore.errors import InfrastructureError
from eventstore.kafka_config import connection_config, consume_available, producer_config
from eventstore.topics import TopicLayout
from projections.api import invalid
from projections.lag import LagReader
from projections.settings import ApiSettings
from projections.store import Store
from scheduler.decider import TERMINAL
from scheduler.workflow import WorkflowRegistry
from schemas.codec import default_codec
from schemas.errors import DecodeError
from schemas.messages import (
    MESSAGE_TYPES,
    Event,
    Message,
    OperatorAction,
    OperatorAlert,
    OperatorCommand,
    SubmitTask,
    TaskAccepted,
    TaskRejected,
    new_id,
)
from stepstream.client import InvalidSubmission, build_submission, check_submission, same_submission
from stepstream.operator import Outcome

log = structlog.get_logger("stepstream.api")
_EVENT_TYPES: dict[str, type[Event]] = {t.__name__: t for t in MESSAGE_TYPES if issubclass(t, Event)}
ANSWERS = Counter("stepstream_api_writes_total", "Write requests by endpoint and answer", ["endpoint", "answer"])


# ---- requests --------------------------------------------------------------------------------------


class SubmissionRequest(BaseModel):
    """A task to run. ``task_id`` is the idempotency key: send the same one again to retry safely."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"workflow": "orders", "input": {"order_id": "o-1", "sku": "A-1", "qty": 1, "amount": 10},
         "task_id": "order-o-1"}]})

    workflow: str = Field(min_length=1, max_length=200)
    version: int | None = Field(default=None, ge=1, description="workflow version; omitted: the latest")
    input: dict[str, Any]
    task_id: str | None = Field(default=None, min_length=1, max_length=200, description="default: a new id")
    submitter: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_-]{1,100}$",
                                  description="the private reply topic that gets progress updates: the token "
                                              "holder's own (the default); another name is refused (403)")


class CommandRequest(BaseModel):
    """An operator command on one task. ``command_id`` is its idempotency key (default: a new one)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"action": "compensate", "command_id": "undo-order-o-1"}]})

    action: OperatorAction
    step: str | None = Field(default=None, min_length=1, max_length=200,
                             description="resubmit / retry-compensation: the step (default: the failed one)")
    command_id: str | None = Field(default=None, min_length=1, max_length=200)


def _invalid(field_name: str, message: str, value: Any) -> RequestValidationError:
    return invalid(field_name, message, value, where="body")


# ---- authentication --------------------------------------------------------------------------------


_BEARER = HTTPBearer(auto_error=False, description="a token of STEPSTREAM_API_TOKENS")


class BearerTokens:
    """The configured tokens, by who holds them. A request's token is checked before its body is read, so
    without a valid one the answer is 401 whatever the body (FastAPI judges bodies before dependencies).
    No token configured: no writes at all."""

    def __init__(self, settings: ApiSettings) -> None:
        self._tokens = [(name, secret.get_secret_value().encode()) for name, secret in settings.tokens.items()]

    def holder(self, authorization: str | None) -> str:
        """The name of the token presented in an ``Authorization`` header; HTTP 401 if none matches."""
        if not self._tokens:
            raise _unauthorized("writes are disabled: no API token is configured (STEPSTREAM_API_TOKENS)")
        scheme, _, presented = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not presented.strip():
            raise _unauthorized("missing bearer token (Authorization: Bearer <token>)")
        candidate = presented.strip().encode()
        # Every token is compared, in constant time each, so timing tells nothing about which one is near.
        matches = [name for name, secret in self._tokens if hmac.compare_digest(candidate, secret)]
        if not matches:
            raise _unauthorized("invalid bearer token")
        return matches[0]

    def route_class(self, max_body_bytes: int) -> type[APIRoute]:
        """Routes that check the token first, then the declared body size, then hand over to FastAPI."""
        tokens = self

        class AuthenticatedRoute(APIRoute):
            def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
                handler = super().get_route_handler()

                async def authenticated(request: Request) -> Response:
                    request.state.token_holder = tokens.holder(request.headers.get("authorization"))
                    declared = request.headers.get("content-length", "0")
                    if not declared.isdigit() or int(declared) > max_body_bytes:
                        raise HTTPException(413, f"the body may have at most {max_body_bytes} bytes "
                                                 "(STEPSTREAM_API_MAX_BODY_BYTES)")
                    return await handler(request)

                return authenticated

        return AuthenticatedRoute


def token_holder(request: Request,
                 _credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_BEARER)]) -> str:
    """Who acts: the holder of the request's token (checked by the route; the dependency documents the
    bearer scheme in the OpenAPI schema)."""
    holder: str = request.state.token_holder
    return holder


def _unauthorized(detail: str) -> HTTPException:
    return HTTPException(401, detail, headers={"WWW-Authenticate": "Bearer"})


# ---- the scheduler's answers -------------------------------------------------------------------------


@dataclass
class _Waiter:
    accepts: Callable[[Event], bool]
    done: threading.Event = field(default_factory=threading.Event)
    event: Event | None = None


class DecisionWatcher:
    """Tails ``events`` and hands each event to the request waiting for a decision on its cause.

    It starts at the end offsets read when it starts, explicitly (not "latest", which librdkafka resolves
    only at the first fetch): every event of a command produced after ``start()`` returns is seen.
    """

    def __init__(self, bootstrap: str, topic: str, group_prefix: str = "") -> None:
        """``group_prefix``: the deployment's topic prefix, so one prefixed ACL covers the (unused) group."""
        self.topic = topic
        self._consumer = Consumer({**connection_config(bootstrap), "group.id": f"{group_prefix}api-watch-{new_id()}",
                                   "enable.auto.commit": False, "isolation.level": "read_committed"})
        self._waiters: dict[str, list[_Waiter]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="decision-watcher", daemon=True)
        self._codec = default_codec()

    def start(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self._consumer.assign(self._end_offsets(timeout_s))
                break
            except KafkaException as exc:
                # A topic just created has no leader for a moment (NOT_LEADER_FOR_PARTITION, which librdkafka
                # does not flag retriable here); past the deadline the error stands.
                if time.monotonic() > deadline:
                    raise InfrastructureError(f"cannot follow {self.topic} for the scheduler's answers: {exc} "
                                              "(are the topics created? `stepstream topics create`)") from exc
                time.sleep(0.2)
        self._thread.start()

    def _end_offsets(self, timeout_s: float) -> list[TopicPartition]:
        metadata = self._consumer.list_topics(self.topic, timeout=timeout_s).topics[self.topic]
        if metadata.error is not None:
            raise KafkaException(metadata.error)
        partitions = metadata.partitions
        if not partitions:
            raise KafkaException(KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART, f"{self.topic} has no partitions"))
        return [TopicPartition(self.topic, p, self._consumer.get_watermark_offsets(
            TopicPartition(self.topic, p), timeout=timeout_s)[1]) for p in sorted(partitions)]

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)
        self._consumer.close()

    @contextmanager
    def expect(self, causation_id: str, accepts: Callable[[Event], bool] = lambda _e: True) -> Iterator[_Waiter]:
        """Register before producing the command whose decision is awaited; unregistered on exit."""
        waiter = _Waiter(accepts)
        with self._lock:
            self._waiters.setdefault(causation_id, []).append(waiter)
        try:
            yield waiter
        finally:
            with self._lock:
                waiting = self._waiters.get(causation_id, [])
                if waiter in waiting:
                    waiting.remove(waiter)
                if not waiting:
                    self._waiters.pop(causation_id, None)

    def _run(self) -> None:
        while not self._stop.is_set():
            for record in consume_available(self._consumer, 500, 0.2):  # each answer as soon as it is there
                if record.error() is not None:
                    if record.error().code() != KafkaError._PARTITION_EOF:
                        log.warning("events not read", error=str(record.error()))
                    continue
                try:
                    event = self._codec.decode(record.value())
                except DecodeError:
                    continue  # not ours to judge: the projector dead-letters what it cannot read
                if isinstance(event, Event) and event.causation_id is not None:
                    self._deliver(event)

    def _deliver(self, event: Event) -> None:
        with self._lock:
            for waiter in self._waiters.get(event.causation_id or "", []):
                if waiter.event is None and waiter.accepts(event):
                    waiter.event = event
                    waiter.done.set()


# ---- admission --------------------------------------------------------------------------------------


class GlobalAdmission:
    """The API's bound on tasks in flight across every scheduler partition.

    The estimate is the non-terminal tasks the state store holds, plus the records the scheduler has not
    consumed from ``inbox`` yet, plus every submission this API let through that the store does not show
    yet (a task the scheduler decided but the projector has not written is in neither of the first two).
    Store and backlog are read at most every ``refresh_s``; the let-through ones are counted until the
    store shows them, or the scheduler refused them, or ``forget_after_s`` passed. Counting a task twice
    (let through and in the backlog) only errs on the side of refusing. The scheduler's per-partition
    bound still applies behind it.
    """

    def __init__(self, store: Store, lag: LagReader | None, layout: TopicLayout, bound: int,
                 refresh_s: float = 1.0, forget_after_s: float = 300.0) -> None:
        self.store = store
        self.lag = lag
        self.layout = layout
        self.bound = bound
        self.refresh_s = refresh_s
        self.forget_after_s = forget_after_s
        self._lock = threading.Lock()
        self._read_at = float("-inf")
        self._measured = 0
        self._let_through: dict[str, float] = {}

    def refuse(self, task_id: str) -> str | None:
        """Why a submission must wait (None: it is let through, and counted until the store shows it)."""
        with self._lock:
            now = time.monotonic()
            if now - self._read_at >= self.refresh_s:
                self._measured = self._measure(now)
                self._read_at = now
            estimate = self._measured + len(self._let_through)
            if estimate >= self.bound:
                return f"admission control: about {estimate} tasks in flight or waiting, the limit is {self.bound}"
            self._let_through[task_id] = now
            return None

    def release(self, task_id: str) -> None:
        """A let-through submission that will not become a task in flight (refused, or never delivered)."""
        with self._lock:
            self._let_through.pop(task_id, None)

    def _measure(self, now: float) -> int:
        for task_id, since in list(self._let_through.items()):
            if now - since > self.forget_after_s or self.store.task(task_id) is not None:
                del self._let_through[task_id]
        live = sum(n for state, n in self.store.counts_by_status().items() if state not in TERMINAL)
        backlog = 0
        if self.lag is not None:
            try:
                backlog = sum(row.lag for row in self.lag.groups()
                              if row.group == f"{self.layout.prefix}scheduler" and row.topic == self.layout.inbox)
            except Exception as exc:  # the broker is not answering: producing will tell, the store still counts
                log.warning("inbox backlog not measured", error=repr(exc))
        return live + backlog


# ---- the writer -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    status: int
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body, self.status, self.headers)


class DeliveryFailed(Exception):
    """Kafka did not take the message (in time): it may still be delivered later."""

    def __init__(self, task_id: str, reason: str, *, too_large: bool = False) -> None:
        super().__init__(reason)
        self.task_id = task_id
        self.too_large = too_large


class TaskWriter:
    """Produces submissions and operator commands and waits for the scheduler's answer to each."""

    def __init__(self, *, bootstrap: str, layout: TopicLayout, store: Store, registry: WorkflowRegistry,
                 admission: GlobalAdmission, settings: ApiSettings) -> None:
        self.layout = layout
        self.store = store
        self.registry = registry
        self.admission = admission
        self.settings = settings
        self._codec = default_codec()
        # Each request waits for its own message's report: successes must be reported too. A request waits
        # for that one message, so lingering to batch would only add its 5 ms to every answer.
        self._producer = Producer(producer_config(bootstrap, **{"delivery.report.only.error": False,
                                                                "linger.ms": 0}))
        self.watcher = DecisionWatcher(bootstrap, layout.events, layout.prefix)
        self.watcher.start()
        self._closed = threading.Event()
        self._poller = threading.Thread(target=self._serve_deliveries, name="delivery-reports", daemon=True)
        self._poller.start()

    def close(self) -> None:
        self._closed.set()
        self._poller.join(5)
        self._producer.flush(10)
        self.watcher.close()

    # -- submissions --

    def submit(self, request: SubmissionRequest, holder: str) -> Answer:
        """``holder`` is who presented the token: the reply topic a submission may name is the holder's own."""
        if request.submitter is not None and request.submitter != holder:
            return Answer(403, {"detail": f"submitter {request.submitter!r}: a token of {holder!r} may only name "
                                          f"its own reply topic ({holder!r}, the default)"})
        try:
            check_submission(self.registry, request.workflow, request.version, request.input)
        except InvalidSubmission as exc:
            head, _, rest = exc.field.partition(".")
            value = getattr(request, head)
            raise _invalid(exc.field, exc.reason, value.get(rest) if rest and isinstance(value, dict) else value) \
                from None
        try:
            command = build_submission(request.workflow, request.input, version=request.version,
                                       task_id=request.task_id, submitter=holder,
                                       reply_topic=self.layout.status(holder))
        except InvalidSubmission as exc:
            raise _invalid(exc.field, exc.reason, None) from None
        known = self._known_task(command, request.version)
        if known is not None:
            return known
        refusal = self.admission.refuse(command.task_id)
        if refusal is not None:
            return self._too_busy(command.task_id, refusal)
        try:
            with self.watcher.expect(command.message_id) as waiter:
                self._deliver(command)
                waiter.done.wait(self.settings.decision_timeout_s)
        except DeliveryFailed:
            self.admission.release(command.task_id)
            raise
        match waiter.event:
            case TaskAccepted():
                return Answer(201, self._task_body(command.task_id, "accepted", waiter.event.workflow,
                                                   waiter.event.workflow_version), self._location(command.task_id))
            case TaskRejected(reason=reason):
                self.admission.release(command.task_id)
                return self._too_busy(command.task_id, reason)
            case OperatorAlert(reason=reason):
                self.admission.release(command.task_id)
                return Answer(409, {"task_id": command.task_id, "detail": reason})
        # No event: still deciding, or a repeat the scheduler ignored (the store may show the task by now).
        return self._known_task(command, request.version) or Answer(
            202, {"task_id": command.task_id, "status": "submitted", "location": f"/api/tasks/{command.task_id}",
                  "detail": "on the log; the scheduler has not answered yet: follow the task at its location"},
            self._location(command.task_id))

    def _known_task(self, command: SubmitTask, version: int | None) -> Answer | None:
        """The answer the state store gives on its own: 200 for a repeat, 409 for other data (None: not
        known, or rejected before and so asking for admission again)."""
        existing = self.store.task(command.task_id)
        if existing is None:
            return None
        if not same_submission(self.store, existing, command.workflow, version, command.input):
            return Answer(409, {"task_id": command.task_id, "status": existing["status"],
                                "detail": f"task {command.task_id!r} exists with other data "
                                          f"({existing['workflow']} v{existing['workflow_version']}); "
                                          "nothing was submitted"})
        if existing["status"] == "rejected":
            return None
        return Answer(200, self._task_body(command.task_id, existing["status"], existing["workflow"],
                                           existing["workflow_version"]), self._location(command.task_id))

    def _too_busy(self, task_id: str, reason: str) -> Answer:
        retry_after = str(self.settings.retry_after_s)
        return Answer(429, {"task_id": task_id, "detail": reason, "retry_after_s": self.settings.retry_after_s},
                      {"Retry-After": retry_after})

    def _task_body(self, task_id: str, status: str, workflow: str, version: int) -> dict[str, Any]:
        return {"task_id": task_id, "status": status, "workflow": workflow, "workflow_version": version,
                "location": f"/api/tasks/{task_id}"}

    @staticmethod
    def _location(task_id: str) -> dict[str, str]:
        return {"Location": f"/api/tasks/{task_id}"}

    # -- operator commands --

    def command(self, task_id: str, request: CommandRequest, operator: str) -> Answer:
        if self.store.task(task_id) is None:
            return Answer(404, {"detail": f"no task {task_id!r} in the state store"})
        command_id = request.command_id or new_id()
        report = {"task_id": task_id, "command_id": command_id, "action": request.action}
        earlier = self._answer_recorded(task_id, command_id)
        if earlier is not None:  # this command id was answered before: the same answer, nothing sent again
            return self._outcome(report, Outcome.of(earlier))
        command = OperatorCommand(task_id=task_id, command_id=command_id, action=request.action,
                                  step=request.step, operator=operator)
        with self.watcher.expect(command.message_id, lambda e: getattr(e, "command_id", None) == command_id) \
                as waiter:
            self._deliver(command)
            waiter.done.wait(self.settings.decision_timeout_s)
        if waiter.event is None:
            return Answer(202, {**report, "outcome": "pending",
                                "detail": "on the log; the scheduler has not answered yet (send the same "
                                          "command_id again to ask)"})
        return self._outcome(report, Outcome.of(waiter.event))

    def _answer_recorded(self, task_id: str, command_id: str) -> Event | None:
        for row in self.store.history(task_id):
            body = orjson.loads(row["body"])
            if body.get("command_id") == command_id and row["event_type"] in _EVENT_TYPES:
                return _EVENT_TYPES[row["event_type"]].model_validate(body)
        return None

    @staticmethod
    def _outcome(report: dict[str, Any], outcome: Outcome) -> Answer:
        return Answer(200 if outcome.status == "accepted" else 409,
                      {**report, "outcome": outcome.status, "detail": outcome.detail})

    # -- delivery --

    def _deliver(self, message: Message) -> None:
        """Produce and wait for the broker's acknowledgement (acks=all) of this one message."""
        delivered = threading.Event()
        failure: list[KafkaError] = []

        def on_delivery(err: KafkaError | None, _msg: Any) -> None:
            if err is not None:
                failure.append(err)
            delivered.set()

        try:
            self._producer.produce(self.layout.inbox, self._codec.encode(message), message.task_id,
                                   on_delivery=on_delivery)
        except KafkaException as exc:
            too_large = exc.args[0].code() == KafkaError.MSG_SIZE_TOO_LARGE
            raise DeliveryFailed(message.task_id, exc.args[0].str(), too_large=too_large) from None
        except BufferError:
            raise DeliveryFailed(message.task_id, "the producer's queue is full") from None
        if not delivered.wait(self.settings.delivery_timeout_s) or failure:
            reason = failure[0].str() if failure else f"no acknowledgement within {self.settings.delivery_timeout_s}s"
            raise DeliveryFailed(message.task_id, reason,
                                 too_large=bool(failure) and failure[0].code() == KafkaError.MSG_SIZE_TOO_LARGE)

    def _serve_deliveries(self) -> None:
        while not self._closed.is_set():
            self._producer.poll(0.1)


def write_router(writer: TaskWriter | None, settings: ApiSettings) -> APIRouter:
    """The write endpoints. Without a writer (no token configured, so no Kafka client either) every write
    is refused by the token check before it could need one."""
    router = APIRouter(tags=["writes"], route_class=BearerTokens(settings).route_class(settings.max_body_bytes))
    unavailable: dict[int | str, dict[str, Any]] = {
        400: {"description": "the body is not JSON"},
        413: {"description": "the body is larger than STEPSTREAM_API_MAX_BODY_BYTES, or than Kafka takes"},
        503: {"description": "Kafka did not take the message; retry after Retry-After"}}

    @router.post("/api/tasks", status_code=201, responses={
        200: {"description": "a repeat of a known submission: nothing new submitted"},
        202: {"description": "on the log, the scheduler has not answered yet"},
        401: {"description": "no valid bearer token: nothing submitted"},
        403: {"description": "the submitter named is not the token holder's: nothing submitted"},
        409: {"description": "the task id exists with other data: nothing submitted"},
        429: {"description": "admission control refused the task: retry after Retry-After, same task id"},
        **unavailable,
    }, description="Submit a task; the answer is the scheduler's decision (or 202 if it takes longer). "
                   "A 422 names the field at fault (`input.amount`). Workflows and their `input`:\n\n" + "\n".join(
                       f"- {line}" for line in (writer.registry.describe_inputs() if writer else [])))
    def submit_task(request: SubmissionRequest, who: Annotated[str, Depends(token_holder)]) -> JSONResponse:
        """Submit a task; the answer is the scheduler's decision (or 202 if it takes longer)."""
        answer = _guard(lambda: _require(writer).submit(request, who), settings)
        ANSWERS.labels("submit", str(answer.status_code)).inc()
        log.info("submission answered", task_id=request.task_id, workflow=request.workflow, by=who,
                 status=answer.status_code)
        return answer

    @router.post("/api/tasks/{task_id}/commands", responses={
        202: {"description": "on the log, the scheduler has not answered yet"},
        401: {"description": "no valid bearer token: nothing sent"},
        404: {"description": "no such task in the state store"},
        409: {"description": "the scheduler refused the command (the reason says why)"},
        **unavailable,
    })
    def command_task(task_id: str, request: CommandRequest, who: Annotated[str, Depends(token_holder)]) -> JSONResponse:
        """An operator command (resubmit, compensate, cancel, retry-compensation); the operator is the
        token's name."""
        answer = _guard(lambda: _require(writer).command(task_id, request, who), settings)
        ANSWERS.labels("command", str(answer.status_code)).inc()
        log.info("operator command answered", task_id=task_id, action=request.action, by=who,
                 status=answer.status_code)
        return answer

    return router


def _require(writer: TaskWriter | None) -> TaskWriter:
    if writer is None:
        raise HTTPException(503, "writes are not configured in this process")
    return writer


def _guard(call: Callable[[], Answer], settings: ApiSettings) -> JSONResponse:
    try:
        return call().response()
    except DeliveryFailed as exc:
        if exc.too_large:
            return JSONResponse({"task_id": exc.task_id, "detail": f"too large for the event log: {exc}"}, 413)
        log.warning("message not delivered", task_id=exc.task_id, error=str(exc))
        return JSONResponse({"task_id": exc.task_id, "location": f"/api/tasks/{exc.task_id}",
                             "detail": f"the event log did not acknowledge the message ({exc}); it may still "
                                       "arrive: retry with the same task_id (and command_id), never a new one"},
                            503, {"Retry-After": str(settings.retry_after_s)})
