"""The writer behind the write routes: produces submissions and operator commands and answers each with
the scheduler's decision.

The scheduler, not this API, decides whether a task is admitted: a submission is produced on ``inbox``
and the API waits (``STEPSTREAM_API_DECISION_TIMEOUT_S``) for the scheduler's first event caused by it,
read from ``events``. So the answer is the system's own: 201 admitted, 429 refused by admission control
(``Retry-After``), 422 refused by the scheduler for a version it does not run or an input it refuses (the
API's workflows file differs from the scheduler's), 409 a contradiction of an existing task. What the API
can tell on its own it answers without producing anything: 401 without a valid token, 422 for an invalid
submission (the field named), 200 for a repeat of a known submission, 409 for the same task id with other
data, 429 when the global in-flight estimate (non-terminal tasks in the state store plus the scheduler's
backlog on ``inbox``) is at its bound. When the scheduler does not answer in time the submission is on the
log anyway: 202, and ``GET /api/tasks/{id}`` follows it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import orjson
from confluent_kafka import KafkaError, KafkaException, Producer
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from eventstore.kafka_config import producer_config
from eventstore.topics import TopicLayout
from projections.store import Store
from scheduler.sealing import require_keyring
from scheduler.workflow import WorkflowRegistry
from schemas.codec import default_codec
from schemas.messages import (
    MESSAGE_TYPES,
    Event,
    Message,
    OperatorAlert,
    OperatorCommand,
    SubmitTask,
    TaskAccepted,
    TaskRejected,
    new_id,
)
from schemas.sealed import Keyring
from schemas.states import TaskStatus
from stepstream.client import (
    InvalidSubmission,
    SubmissionKeys,
    build_submission,
    check_submission,
    same_submission,
)
from stepstream.client.outcomes import Outcome
from stepstream.http.admission import GlobalAdmission
from stepstream.http.bodies import CommandRequest, SubmissionRequest
from stepstream.http.decisions import DecisionWatcher
from stepstream.http.errors import invalid
from stepstream.http.settings import ApiSettings

_EVENT_TYPES: dict[str, type[Event]] = {t.__name__: t for t in MESSAGE_TYPES if issubclass(t, Event)}


def _invalid(field_name: str, message: str, value: Any) -> RequestValidationError:
    return invalid(field_name, message, value, where="body")


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
                 admission: GlobalAdmission, settings: ApiSettings, keyring: Keyring | None = None) -> None:
        self.layout = layout
        # Marked input fields are sealed here, before the submission is produced: an API whose workflows mark
        # any refuses to start without a key, rather than answer each such submission with an error.
        self.sealing = SubmissionKeys(registry, require_keyring(registry, keyring), bootstrap=bootstrap,
                                      layout=layout)
        self.store = store
        self.registry = registry
        self.admission = admission
        self.settings = settings
        self._codec = default_codec()
        # Each request waits for its own message's report: successes must be reported too. A request waits
        # for that one message, so lingering to batch would only add its 5 ms to every answer.
        self._producer = Producer(producer_config(bootstrap, **{"delivery.report.only.error": False,
                                                                "linger.ms": 0}))
        self.watcher = DecisionWatcher(bootstrap, layout.events, layout.watcher_group())
        self.watcher.start()
        self._closed = threading.Event()
        self._poller = threading.Thread(target=self._serve_deliveries, name="delivery-reports", daemon=True)
        self._poller.start()

    def flush(self, timeout_s: float = 10) -> int:
        """Wait until everything produced so far is acknowledged, or ``timeout_s``: how many still wait."""
        return int(self._producer.flush(timeout_s))

    def close(self) -> None:
        self._closed.set()
        self._poller.join(5)
        self.flush()
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
        submitted = command
        command = self.sealing.seal(submitted, self.store.task(command.task_id) is not None)
        known = self._known_task(command, request.version)
        if known is not None:
            return known
        refusal = self.admission.refuse(command.task_id)
        if refusal is not None:
            return self._too_busy(command.task_id, refusal)
        try:
            with self.watcher.expect(command.message_id) as waiter:
                self._deliver(self.sealing.ready([command])[0])
                waiter.done.wait(self.settings.decision_timeout_s)
        except DeliveryFailed:
            self.admission.release(command.task_id)
            raise
        match waiter.event:
            case TaskAccepted():
                return Answer(201, self._task_body(command.task_id, TaskStatus.ACCEPTED, waiter.event.workflow,
                                                   waiter.event.workflow_version), self._location(command.task_id))
            case TaskRejected(reason=reason, cause=cause):
                self.admission.release(command.task_id)
                if cause in ("unknown_version", "invalid_input"):  # this API's registry is not the scheduler's
                    return Answer(422, {"task_id": command.task_id, "detail": reason})
                return self._too_busy(command.task_id, reason)
            case OperatorAlert(reason=reason):
                self.admission.release(command.task_id)
                return Answer(409, {"task_id": command.task_id, "detail": reason})
        # No event: still deciding, or a repeat the scheduler ignored (the store may show the task by now; its
        # marked fields are then compared sealed under the task's own key, as the scheduler compared them).
        return self._known_task(self.sealing.seal(submitted, self.store.task(command.task_id) is not None),
                                request.version) or Answer(
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
        if existing["status"] == TaskStatus.REJECTED:
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
