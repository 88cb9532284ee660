"""The Python client: submit tasks, read their status, wait for them, follow a reply topic.

A submission is validated before anything is produced, so a bad input raises an error naming the field
and writes nothing: that includes a workflow or version the scheduler does not run (checked against the
registry the project file or ``STEPSTREAM_SCHEDULER_WORKFLOWS`` names, as the scheduler and the HTTP API do), which the
scheduler would otherwise dead-letter while the submitter waited for an answer that never comes, and an
input its workflow's input model refuses. The versions the running schedulers accept are read from what
they publish (``scheduler.offers``): a version none of them runs is refused before producing too, or waited
for (``await_version_s``), and ``pinned_versions`` says which version a submission naming none will get.

Task ids are the idempotency key of the whole system: submitting the same task again (a retry after a
timeout, a crash between a database write and the submit) runs it once.

Beside it in this package: ``outcomes`` (the scheduler's answer to an operator command, read from ``events``)
and ``outbox`` (submitting in the same transaction as an application's own PostgreSQL write).
The input fields a workflow marks sensitive are sealed here, before anything is produced
(``SubmissionKeys``): the client knows which fields they are from the same registry it validates against,
and holds the master keys (``STEPSTREAM_ENCRYPTION_KEYS``) to wrap the task's data key. Without a key it
refuses to start rather than write them in clear.
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import orjson
from confluent_kafka import Consumer, KafkaError
from confluent_kafka.admin import AdminClient
from pydantic import ValidationError

from eventstore.errors import StepstreamError
from eventstore.kafka_config import connection_config, consume_available
from eventstore.keys import DataKeys, KeyProposer
from eventstore.producer import EventProducer
from eventstore.settings import KafkaSettings
from eventstore.topics import TopicLayout, TopicSpec, ensure_topics
from projections.settings import StoreSettings
from projections.store import SqliteStore, Store
from scheduler.decider import input_digest
from scheduler.offers import Offers
from scheduler.sealing import SubmissionSealer
from scheduler.settings import SchedulerSettings
from scheduler.workflow import WorkflowNotFoundError, WorkflowRegistry
from schemas.codec import default_codec
from schemas.errors import DecodeError
from schemas.messages import OperatorAction, OperatorCommand, StatusUpdate, SubmitTask, new_id
from schemas.sealed import Keyring, configured_keys
from schemas.states import TERMINAL, TaskStatus
from stepstream.client.results import StepSummary as StepSummary  # re-exported: what wait returns
from stepstream.client.results import TaskResult as TaskResult
from stepstream.project.files import configure


class InvalidSubmission(StepstreamError, ValueError):
    """The submission is not valid; ``field`` names what is wrong. Nothing was produced."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.reason = message


class SubmissionRejected(StepstreamError):
    """The scheduler refused the task, saying why: admission control (the system is at its in-flight bound:
    retry later), a workflow or version it does not run (submit again once one that runs it has started), or
    an input its version's model refuses."""


class SubmissionContradicts(StepstreamError):
    """The task id exists with other data (workflow, version or input): the submission is refused and the
    existing task is untouched. Submit other data under a new task id."""


class AccessDenied(StepstreamError, PermissionError):
    """The broker's ACLs do not let this principal read the reply topic (or use its consumer group)."""


_DENIED = frozenset({KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError.GROUP_AUTHORIZATION_FAILED})


OFFERS_MAX_AGE_S = 5.0
"""How long a read of what the schedulers publish stands: a rollout is seen within seconds, and a burst of
submissions reads the topic once."""


class TaskWaitTimeout(StepstreamError, TimeoutError):
    """The task did not reach a terminal state in time; it may still finish."""


class SubmissionKeys:
    """Seals the marked input fields of a submission before it is produced: a new task under a new data key,
    a task the store already knows under its own (read from ``keys``), so that a repeat seals to the bytes
    the task was accepted with and is told from a contradiction as any repeat is. A new key is proposed on
    ``keys`` (``ready``), never sent on ``inbox``."""

    def __init__(self, registry: WorkflowRegistry, keyring: Keyring | None, *, bootstrap: str,
                 layout: TopicLayout) -> None:
        self.sealer = SubmissionSealer(registry, keyring)
        self._keys = DataKeys(bootstrap, layout.keys)
        self._proposer = KeyProposer(bootstrap, layout.keys, layout.inbox)

    def seal(self, command: SubmitTask, known: bool) -> SubmitTask:
        """``command`` sealed; ``known``: the state store has a task with this id."""
        if not self.sealer.needs_key(command):
            return command
        wrapped = self._keys.wrapped(command.task_id) if known else None
        keyring = self.sealer.keyring
        key = keyring.unwrap(wrapped, command.task_id) if wrapped is not None and keyring is not None else None
        return self.sealer.seal(command, key)

    def ready(self, commands: Sequence[SubmitTask]) -> list[SubmitTask]:
        """Sealed ``commands`` as they may go to ``inbox``: the new data keys they carry proposed on ``keys``
        first (acknowledged) and taken off."""
        return self._proposer.publish(commands)

    def close(self) -> None:
        self._keys.close()
        self._proposer.close()


class Client:
    """One producer and, if a submitter name is given, that submitter's private reply topic.

    ``keyring`` (default: ``STEPSTREAM_ENCRYPTION_KEYS``, else the local home's key that ``stepstream up``
    made) seals the input fields the workflows mark.

    Its settings are found as the command line finds them: the project file (``stepstream.toml`` in the
    working folder or a parent, or where ``STEPSTREAM_PROJECT`` points) under the ``STEPSTREAM_*`` variables,
    which still win."""

    def __init__(self, *, kafka: KafkaSettings | None = None, submitter: str | None = None,
                 store_path: Path | None = None, registry: WorkflowRegistry | None = None,
                 keyring: Keyring | None = None) -> None:
        configure()
        self.kafka = kafka or KafkaSettings()
        self.registry = registry or SchedulerSettings().load_registry()
        self.layout = TopicLayout.from_settings(self.kafka)
        self.bootstrap = self.kafka.reachable_bootstrap()
        self._keyring = keyring
        self.submitter = submitter
        self.store_path = store_path
        self._producer = EventProducer(self.bootstrap)
        self._store: Store | None = None
        # Per task submitted here, the store's sequence of it at that moment: a rejection recorded before a
        # retry is not the answer to the retry (a rejected task submitted again asks for admission again).
        self._seen_at_submit: dict[str, int] = {}
        self._message_ids: dict[str, str] = {}  # per task submitted here, the id of the last submission
        self._offers: tuple[float, Offers] | None = None  # when read (monotonic), what the schedulers publish
        if submitter is not None:
            if not submitter.replace("-", "").replace("_", "").isalnum():
                raise InvalidSubmission("submitter", "letters, digits, '-' and '_' only")
            ensure_topics(AdminClient(connection_config(self.bootstrap)),
                          [TopicSpec(self.reply_topic, self.layout.partitions)], self.kafka.replication_factor)

    @functools.cached_property
    def sealing(self) -> SubmissionKeys:
        """Made at the first submission: a client that only reads, sends operator commands or submits to
        unmarked workflows needs no key; a submission to a marked one without a key raises SealingError
        before anything is produced."""
        spec = configured_keys(self.kafka.home)
        return SubmissionKeys(self.registry, self._keyring or (Keyring.parse(spec) if spec else None),
                              bootstrap=self.bootstrap, layout=self.layout)

    @property
    def reply_topic(self) -> str:
        if self.submitter is None:
            raise InvalidSubmission("submitter", "a reply topic needs a submitter name")
        return self.layout.status(self.submitter)

    def submit(self, workflow: str, input: Any, *, version: int | None = None, task_id: str | None = None,
               await_version_s: float = 0.0) -> str:
        """Produce a submission and wait until Kafka has it (acks=all). Returns the task id.

        A workflow or version no running scheduler accepts raises InvalidSubmission, after waiting up to
        ``await_version_s`` for a scheduler that runs it to start (a rollout under way)."""
        check_submission(self.registry, workflow, version, input)
        self._check_offered(workflow, version, await_version_s)
        command = build_submission(workflow, input, version=version, task_id=task_id, submitter=self.submitter,
                                   reply_topic=self.reply_topic if self.submitter else None)
        known = self.status(command.task_id) if task_id is not None else None
        command = self.sealing.seal(command, known is not None)
        if known is not None and self._store is not None and \
                not same_submission(self._store, known, workflow, version, command.input):
            raise SubmissionContradicts(f"task {command.task_id!r} exists with other data ({known['workflow']} "
                                        f"v{known['workflow_version']}, {known['status']}); nothing was submitted")
        self._seen_at_submit[command.task_id] = known["sequence"] if known else 0
        self._message_ids[command.task_id] = command.message_id
        self._producer.send(self.layout.inbox, self.sealing.ready([command])[0])
        self._producer.flush()
        return command.task_id

    def offers(self, max_age_s: float = OFFERS_MAX_AGE_S) -> Offers:
        """What the running schedulers publish they accept, as read at most ``max_age_s`` ago."""
        if self._offers is None or time.monotonic() - self._offers[0] > max_age_s:
            self._offers = (time.monotonic(), Offers.read(self.bootstrap, self.layout.workflows))
        return self._offers[1]

    def pinned_versions(self, workflow: str, version: int | None) -> list[int]:
        """The version a submission will run under: the one it names, else the latest of the scheduler that
        takes it (two during a rollout); the local registry's latest when no scheduler published."""
        if version is not None:
            return [version]
        offers = self.offers()
        return offers.latest(workflow) if offers.known else [self.registry.get(workflow).version]

    def _check_offered(self, workflow: str, version: int | None, await_s: float) -> None:
        deadline = time.monotonic() + await_s
        refusal = self.offers().refusal(workflow, version)
        while refusal is not None and time.monotonic() < deadline:
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
            refusal = self.offers(max_age_s=0).refusal(workflow, version)
        if refusal is not None:
            raise InvalidSubmission("version" if self.offers().versions(workflow) else "workflow", refusal)

    def send_command(self, task_id: str, action: OperatorAction, *, step: str | None = None,
                     command_id: str | None = None, operator: str | None = None) -> OperatorCommand:
        """An operator command on ``inbox`` (acks=all). Resend the returned command's ``command_id`` to retry
        safely: the scheduler answers a command id once. Its answer is recorded on ``events``."""
        try:
            command = OperatorCommand(task_id=task_id, command_id=command_id or new_id(), action=action,
                                      step=step, operator=operator)
        except ValidationError as exc:
            raise _invalid(exc) from None
        self._producer.send(self.layout.inbox, command)
        self._producer.flush()
        return command

    def status(self, task_id: str) -> dict[str, Any] | None:
        """The task as the projection shows it (None until the projector has seen it)."""
        if self._store is None:
            if self.store_path is None:
                self._store = StoreSettings().open(self.kafka.home)
            elif self.store_path.exists():
                self._store = SqliteStore(self.store_path)
            else:
                return None
        return self._store.task(task_id)

    def wait(self, task_id: str, timeout_s: float = 60.0, poll_s: float = 0.2) -> TaskResult:
        """Until the task is terminal: how it ended, its steps and its error (:class:`TaskResult`). Raises
        SubmissionRejected for a rejected task, SubmissionContradicts when the scheduler refused this client's
        submission as a contradiction, TaskWaitTimeout on time."""
        deadline = time.monotonic() + timeout_s
        while True:
            task = self.status(task_id)
            # The task's events are read at most once a poll, and only when a check asks for them.
            history = functools.cache(functools.partial(self._history, task_id))
            if task is not None:
                self._raise_if_contradicted(task_id, history)
            if task is not None and task["status"] == TaskStatus.REJECTED and \
                    task["sequence"] <= self._seen_at_submit.get(task_id, -1) and not self._refused_for_good(history):
                task = None  # the rejection of an earlier submission: this one is not decided yet
            if task is not None and task["status"] in TERMINAL:
                if task["status"] == TaskStatus.REJECTED:
                    raise SubmissionRejected(f"task {task_id} was rejected: {task.get('error')}")
                return TaskResult.of(task)
            if time.monotonic() >= deadline:
                state = task["status"] if task else "not seen yet"
                raise TaskWaitTimeout(f"task {task_id} not finished after {timeout_s}s ({state})")
            time.sleep(poll_s)

    def _history(self, task_id: str) -> list[tuple[str, dict[str, Any]]]:
        """The task's events in the store, as (event type, body); none without a store."""
        if self._store is None:
            return []
        return [(e["event_type"], orjson.loads(e["body"])) for e in self._store.history(task_id)]

    @staticmethod
    def _refused_for_good(history: Callable[[], list[tuple[str, dict[str, Any]]]]) -> bool:
        """Whether the task's rejection is for an input its version refuses: the scheduler answers a repeat of
        it with nothing new (it can never pass), so the earlier rejection is this submission's answer too."""
        causes = [body.get("cause") for event_type, body in history() if event_type == "TaskRejected"]
        return bool(causes) and causes[-1] == "invalid_input"

    def _raise_if_contradicted(self, task_id: str, history: Callable[[], list[tuple[str, dict[str, Any]]]]) -> None:
        """The scheduler's alert caused by this client's submission: the store did not know the task when it
        was submitted (so ``submit`` could not refuse it), and its id turned out to hold other data."""
        message_id = self._message_ids.get(task_id)
        if message_id is None:
            return
        for event_type, body in history():
            if event_type == "OperatorAlert" and body.get("causation_id") == message_id:
                raise SubmissionContradicts(f"task {task_id!r} was refused by the scheduler: {body.get('reason')}; "
                                            "the existing task is untouched")

    def updates(self, timeout_s: float = 30.0, idle_s: float | None = None) -> Iterator[StatusUpdate]:
        """Follow this submitter's reply topic from the start; stops at the timeout or after ``idle_s`` quiet."""
        topic = self.reply_topic  # refuses a client without a submitter before a consumer is made
        assert self.submitter is not None
        consumer = Consumer({
            **connection_config(self.bootstrap),
            "group.id": self.layout.submitter_group(self.submitter),
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
        })
        consumer.subscribe([topic])
        codec = default_codec()
        deadline = time.monotonic() + timeout_s
        last = time.monotonic()
        try:
            while time.monotonic() < deadline and (idle_s is None or time.monotonic() - last < idle_s):
                for msg in consume_available(consumer, 100, 0.2):
                    if msg.error() is not None:
                        if msg.error().code() in _DENIED:
                            raise AccessDenied(f"reply topic {self.reply_topic}: {msg.error().str()} "
                                               "(see docs/acls.md)")
                        continue
                    try:
                        update = codec.decode(msg.value())
                    except DecodeError:
                        continue
                    if isinstance(update, StatusUpdate):
                        last = time.monotonic()
                        yield update
        finally:
            consumer.close()

    def close(self) -> None:
        self._producer.flush()
        if "sealing" in self.__dict__:  # made (cached_property) only by a submission
            self.sealing.close()
        if self._store is not None:
            self._store.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


def check_submission(registry: WorkflowRegistry, workflow: str, version: int | None, input: Any) -> None:
    """Raise InvalidSubmission naming ``workflow`` or ``version`` when ``registry`` does not run it, or the
    first field of ``input`` its input model refuses (``input.amount``)."""
    try:
        found = registry.get(workflow, version)
    except WorkflowNotFoundError as exc:
        versions = sorted(w.version for w in registry.workflows() if w.name == workflow)
        if versions:
            raise InvalidSubmission("version", f"{exc} (it has {', '.join(map(str, versions))})") from None
        names = sorted({w.name for w in registry.workflows()})
        raise InvalidSubmission("workflow", f"{exc} (this deployment runs {', '.join(names) or 'none'})") from None
    errors = found.input_errors(input) if isinstance(input, dict) else []
    if errors:
        where, message = errors[0]
        raise InvalidSubmission(f"input.{where}" if where else "input", message)


def same_submission(store: Store, existing: dict[str, Any], workflow: str, version: int | None,
                    data: dict[str, Any]) -> bool:
    """Whether a submission repeats the ``existing`` task (the store's row): what the scheduler's decider
    compares, workflow, pinned version and input (by digest)."""
    pinned = existing["workflow_version"] if version is None else version
    if workflow != existing["workflow"] or pinned != existing["workflow_version"]:
        return False
    submitted = [orjson.loads(e["body"]).get("input_digest") for e in store.history(existing["task_id"])
                 if e["event_type"] in ("TaskAccepted", "TaskRejected")]
    return bool(submitted) and submitted[-1] == input_digest(workflow, pinned, data)


def build_submission(workflow: str, input: Any, *, version: int | None = None, task_id: str | None = None,
                     submitter: str | None = None, reply_topic: str | None = None) -> SubmitTask:
    """Validate a submission into the command, or raise InvalidSubmission naming the first bad field."""
    if not isinstance(input, dict):
        raise InvalidSubmission("input", f"must be a JSON object, not {type(input).__name__}")
    if version is not None and version < 1:
        raise InvalidSubmission("version", "must be at least 1 (or omitted for the latest)")
    try:
        orjson.dumps(input)
    except orjson.JSONEncodeError as exc:  # integers past 64 bits, keys that are not strings
        raise InvalidSubmission("input", f"not representable as JSON: {exc}") from None
    try:
        return SubmitTask(task_id=uuid.uuid4().hex if task_id is None else task_id, workflow=workflow,
                          workflow_version=version, input=input, submitter=submitter, reply_topic=reply_topic)
    except ValidationError as exc:
        raise _invalid(exc) from None


def _invalid(exc: ValidationError) -> InvalidSubmission:
    first = exc.errors()[0]
    return InvalidSubmission(".".join(str(part) for part in first["loc"]) or "submission", first["msg"])
