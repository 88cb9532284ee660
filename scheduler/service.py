"""``stepstream run scheduler``: the I/O around the decider.

For each batch from ``inbox`` it decides, appends the events to ``events`` (on the inbox record's own
partition number, so a task's commands and history always share a partition), sends the agent requests
and status updates those events call for, and commits the inbox offsets, all in one Kafka transaction.
Owning an inbox partition in the consumer group is the lock on its tasks; before handling any command of
a newly assigned partition it restores that partition's tasks by folding ``events``.

An attempt's request carries its start-by and the length of its work deadline; the agent that takes it
acknowledges on ``inbox`` (``AttemptAccepted``) and the decider records ``StepAccepted``, which starts the
work deadline (see ``scheduler.workflow.Step``).

Compensation attempts are agent requests like forward ones, to the compensation's agent, with the step's
compensation idempotency key.

Sensitive data (``scheduler.sealing``): every task of a workflow that marks fields gets a data key, taken
from its submission (which sealed the marked input fields with it) or made here, and written wrapped to the
compacted ``keys`` topic in the transaction that accepts the task. Inputs stay sealed through the decider
and into agent requests; output fields are sealed on their way to ``events`` and to later steps' agents,
and opened when a partition is restored. Erasing a task writes the tombstone of its key: from then on
nothing opens its values, and a restore leaves them sealed. After a master key rotation (a new key first
in ``STEPSTREAM_ENCRYPTION_KEYS``) each partition's data keys still wrapped by an older key are rewrapped by
the current one, a few with every batch the partition handles, in its transaction: the scheduler owning a
partition is the only writer of its keys, so a rewrap can never revive a key erased meanwhile.
"""

from __future__ import annotations

import threading
import uuid
from datetime import UTC, datetime

import structlog
from confluent_kafka import TopicPartition
from confluent_kafka.admin import AdminClient
from prometheus_client import Gauge

from eventstore.errors import PoisonMessageError
from eventstore.kafka_config import connection_config
from eventstore.keys import read_keys
from eventstore.producer import EventProducer
from eventstore.replay import ReplayReader
from eventstore.runtime import ConsumerRuntime, Record
from eventstore.settings import ConsumerSettings, KafkaSettings
from eventstore.topics import TopicLayout, TopicSpec, ensure_topics
from scheduler.decider import (
    Limits,
    TaskState,
    compensation_idempotency_key,
    decide,
    evolve,
    idempotency_key,
)
from scheduler.sealing import EventSealer, open_input, seal_input
from scheduler.workflow import Step, WorkflowNotFoundError, WorkflowRegistry
from schemas.messages import (
    AgentRequest,
    AttemptAccepted,
    CompensationStarted,
    Event,
    Message,
    OperatorCommand,
    RecoverStep,
    StatusUpdate,
    StepCompensated,
    StepCompensationStarted,
    StepFailed,
    StepResult,
    StepStarted,
    StepSucceeded,
    SubmitTask,
    TaskAccepted,
    TaskCompensated,
    TaskCompensationFailed,
    TaskCompleted,
    TaskDataErased,
    TaskFailed,
    TaskRejected,
)
from schemas.sealed import Keyring, SealingError, TaskKey

log = structlog.get_logger("stepstream.scheduler")

REWRAP_PER_COMMAND = 20
"""Data keys rewrapped under the current master key with each command a partition handles: enough to
rewrap a busy partition's keys in minutes, little enough not to be felt in a batch."""

IN_FLIGHT = Gauge("stepstream_tasks_in_flight", "Non-terminal tasks owned by this scheduler", ["partition"])

_STATUS_OF: dict[type[Event], str] = {
    TaskAccepted: "received",
    TaskRejected: "rejected",
    StepSucceeded: "step_succeeded",
    StepFailed: "step_failed",
    TaskCompleted: "completed",
    TaskFailed: "failed",
    CompensationStarted: "compensating",
    StepCompensated: "step_compensated",
    TaskCompensated: "compensated",
    TaskCompensationFailed: "compensation_failed",
}


class Scheduler:
    """Holds the state of the tasks on the partitions it owns; everything else is the decider's."""

    def __init__(self, *, bootstrap: str, layout: TopicLayout, registry: WorkflowRegistry, limits: Limits,
                 keyring: Keyring | None = None) -> None:
        self.bootstrap = bootstrap
        self.layout = layout
        self.registry = registry
        self.limits = limits
        # Checked before anything runs: sensitive workflows without a key never start.
        self.sealer = EventSealer(registry, keyring)
        self._tasks: dict[int, dict[str, TaskState]] = {}
        self._keys: dict[int, dict[str, TaskKey]] = {}  # the data keys of the owned tasks that have one
        self._stale: dict[int, list[str]] = {}  # per partition, tasks whose key an older master key wraps
        self._admin = AdminClient(connection_config(bootstrap))
        self._known_topics: set[str] = set()
        # Non-terminal tasks per partition, kept up to date as states change: admission control asks for
        # it on every submission, and counting would walk every task the partition ever held.
        self._live: dict[int, int] = {}

    # -- commands -----------------------------------------------------------------------------

    def handle(self, record: Record, output: EventProducer) -> None:
        command = record.message
        if not isinstance(command, (SubmitTask, StepResult, RecoverStep, OperatorCommand, AttemptAccepted)):
            raise PoisonMessageError(f"{type(command).__name__} is not a command the scheduler takes")
        tasks = self._tasks.setdefault(record.partition, {})
        keys = self._keys.setdefault(record.partition, {})
        state = tasks.get(command.task_id)
        was_live = state is not None and not state.is_terminal
        new_key: TaskKey | None = None
        if isinstance(command, SubmitTask):
            command, new_key = self._under_task_key(command, state, keys.get(command.task_id))
        decision = decide(command, state, registry=self.registry, now=datetime.now(UTC),
                          in_flight=self.in_flight(record.partition), limits=self.limits)
        for event in decision.events:
            state = evolve(state, event)
            self._keep_key(event, new_key, keys, output, record.partition)
            output.send(self.layout.events, self.sealer.seal(event, keys.get(event.task_id)),
                        partition=record.partition)
            self._effects(event, state, command, output, keys.get(event.task_id))
        self._rewrap(record.partition, output)
        if state is not None:
            tasks[command.task_id] = state
            live = self._live.get(record.partition, 0) + (not state.is_terminal) - was_live
            self._live[record.partition] = live
            IN_FLIGHT.labels(str(record.partition)).set(live)
        if decision.dead_letter is not None:
            # The alert event (if any) is already in this transaction; the command itself is dead-lettered.
            raise PoisonMessageError(decision.dead_letter)

    def in_flight(self, partition: int) -> int:
        return self._live.get(partition, 0)

    def _under_task_key(self, command: SubmitTask, state: TaskState | None, known: TaskKey | None
                        ) -> tuple[SubmitTask, TaskKey | None]:
        """A submission with its marked input sealed under the task's data key, and the key a new task gets.

        The key is the known task's (a repeat then seals to the very bytes it was accepted with, so the
        decider tells a repeat from a contradiction by digest as for any task), else the submission's own,
        else a new one: a submitter that sent a marked field in clear (an older client) does not get it
        written in clear to ``events``. Nothing here opens what it does not reseal.
        """
        try:
            workflow = self.registry.get(command.workflow, command.workflow_version if state is None
                                         else state.workflow_version)
        except WorkflowNotFoundError:
            return command, None  # the decider dead-letters it
        if not workflow.has_sensitive_data:
            return command, None
        if command.data_key is not None and self.sealer.keyring is not None:
            try:
                own: TaskKey | None = self.sealer.keyring.unwrap(command.data_key, command.task_id)
            except SealingError as exc:
                raise PoisonMessageError(f"submission of task {command.task_id}: {exc}") from None
        else:
            own = None
        key = known or own or TaskKey.generate()
        data = command.input
        if own is not None and own != key:
            data = open_input(workflow, command.task_id, data, own)
        sealed = command.model_copy(update={"input": seal_input(workflow, command.task_id, data, key),
                                            "data_key": None})
        return sealed, None if known is not None else key

    def _rewrap(self, partition: int, output: EventProducer) -> None:
        """Rewrap a few of the partition's data keys that an older master key wraps (none once rotated)."""
        stale = self._stale.get(partition)
        keyring = self.sealer.keyring
        if not stale or keyring is None:
            return
        keys = self._keys.get(partition, {})
        for task_id in stale[-REWRAP_PER_COMMAND:]:
            key = keys.get(task_id)
            if key is not None:  # erased meanwhile: nothing to rewrap
                output.send_raw(self.layout.keys, task_id, keyring.wrap(key, task_id).encode(), partition=partition)
        del stale[-REWRAP_PER_COMMAND:]
        if not stale:
            log.info("data keys rewrapped under the current master key", partition=partition, key_id=keyring.current)

    def _keep_key(self, event: Event, new_key: TaskKey | None, keys: dict[str, TaskKey], output: EventProducer,
                  partition: int) -> None:
        """Write a newly accepted task's data key to ``keys`` (wrapped), or an erased one's tombstone."""
        if isinstance(event, TaskAccepted) and new_key is not None and self.sealer.keyring is not None:
            keys[event.task_id] = new_key
            wrapped = self.sealer.keyring.wrap(new_key, event.task_id)
            output.send_raw(self.layout.keys, event.task_id, wrapped.encode(), partition=partition)
        elif isinstance(event, TaskDataErased):
            keys.pop(event.task_id, None)
            output.send_raw(self.layout.keys, event.task_id, None, partition=partition)

    def _effects(self, event: Event, state: TaskState, command: Message, output: EventProducer,
                 key: TaskKey | None) -> None:
        if isinstance(event, StepStarted | StepCompensationStarted):
            self._request(event, state, output, key)
            return
        status = _STATUS_OF.get(type(event))
        reply_topic = self._reply_topic(state, command)
        if status is None or reply_topic is None:
            return
        detail = getattr(event, "step", None) or getattr(event, "reason", None)
        output.send(reply_topic, StatusUpdate(task_id=state.task_id, status=status,  # type: ignore[arg-type]
                                              detail=detail))

    def _request(self, event: StepStarted | StepCompensationStarted, state: TaskState, output: EventProducer,
                 data_key: TaskKey | None) -> None:
        """The agent request an attempt's start calls for: the step's own agent, or its compensation's."""
        workflow = self.registry.get(state.workflow, state.workflow_version)
        step = workflow.step(event.step)
        forward_key = idempotency_key(state.task_id, step.name)
        undoes_key: str | None = None
        undoes_attempt: int | None = None
        if isinstance(event, StepStarted):
            agent, key, data, timeout_s = step.agent, forward_key, state.step_input(), step.timeout_s
        else:
            if step.compensation is None:
                raise ValueError(f"step {step.name!r} has no compensation to request")
            agent, timeout_s = step.compensation.agent, step.compensation.timeout_s
            key = compensation_idempotency_key(state.task_id, step.name)
            data = state.compensation_input(event.step_index)
            # The undo names the forward key so the service tombstones it: no forward attempt still in
            # flight (or redelivered) can apply anything once the step is undone. A service that cannot
            # fence gets no such claim: its undo waits out the forward attempts instead (``not_before``).
            if step.compensation.fenced:
                undoes_key, undoes_attempt = forward_key, state.steps[event.step_index].attempt
        # Outputs of earlier steps are clear in memory: sealed again for the agent, which opens what it needs.
        data = {**data, "steps": self.sealer.seal_outputs(workflow, state.task_id, data["steps"], data_key)}
        self._ensure_topic(TopicSpec(self.layout.agent(agent), self.layout.partitions))
        output.send(self.layout.agent(agent), AgentRequest(
            task_id=state.task_id, step=event.step, attempt=event.attempt, attempt_id=event.attempt_id,
            idempotency_key=key, complete_by=event.complete_by, calls_allowed=event.calls_allowed, input=data,
            undoes_key=undoes_key, undoes_attempt=undoes_attempt, start_by=event.start_by, timeout_s=timeout_s,
            compensation=isinstance(event, StepCompensationStarted),
            not_before=event.not_before if isinstance(event, StepCompensationStarted) else None,
            sealed_output=_marked_answer(step, isinstance(event, StepCompensationStarted)) if data_key else [],
        ))

    def _reply_topic(self, state: TaskState, command: Message) -> str | None:
        """A submitter's private topic. Only names under this deployment's status prefix are served."""
        topic = state.reply_topic
        submitter = state.submitter
        if isinstance(command, SubmitTask) and topic is None and submitter is None:
            topic, submitter = command.reply_topic, command.submitter
        if topic is None and submitter is not None:
            topic = self.layout.status(submitter)
        if topic is None:
            return None
        if not topic.startswith(self.layout.status("")):
            log.warning("reply topic outside the status prefix ignored", task_id=state.task_id, topic=topic)
            return None
        self._ensure_topic(TopicSpec(topic, self.layout.partitions))
        return topic

    def _ensure_topic(self, spec: TopicSpec) -> None:
        """Agent and status topics appear with their first message; a missing topic would fail the batch."""
        if spec.name not in self._known_topics:
            ensure_topics(self._admin, [spec], self.layout.replication_factor)
            self._known_topics.add(spec.name)

    # -- partition ownership ------------------------------------------------------------------

    def restore(self, partitions: list[TopicPartition]) -> None:
        """Fold ``events`` of each newly owned partition before any of its commands is handled."""
        for tp in partitions:
            tasks: dict[str, TaskState] = {}
            keys, self._stale[tp.partition] = self._restore_keys(tp.partition)
            reader = ReplayReader(self.bootstrap, self.layout.events, partitions=[tp.partition])
            for record in reader:
                if isinstance(record.message, Event):
                    event = self.sealer.unseal(record.message, keys.get(record.message.task_id))
                    tasks[event.task_id] = evolve(tasks.get(event.task_id), event)
            self._tasks[tp.partition] = tasks
            self._keys[tp.partition] = keys
            self._live[tp.partition] = sum(1 for state in tasks.values() if not state.is_terminal)
            IN_FLIGHT.labels(str(tp.partition)).set(self.in_flight(tp.partition))
            log.info("partition restored", partition=tp.partition, tasks=len(tasks),
                     in_flight=self.in_flight(tp.partition), events=reader.stats.records)

    def _restore_keys(self, partition: int) -> tuple[dict[str, TaskKey], list[str]]:
        """The data keys of a partition's tasks, unwrapped (an erased task has none: its values stay sealed),
        and the tasks whose key an older master key wraps."""
        self._ensure_topic(self.layout.keys_spec())
        wrapped = {task: value for task, value in read_keys(self.bootstrap, self.layout.keys, {}, [partition]).items()
                   if value is not None}
        if wrapped and self.sealer.keyring is None:
            raise SealingError(f"{self.layout.keys} holds data keys but no encryption key is configured "
                               "(STEPSTREAM_ENCRYPTION_KEYS)")
        keyring = self.sealer.keyring
        if keyring is None:
            return {}, []
        stale = sorted(task for task, value in wrapped.items() if keyring.wrapped_with(value) != keyring.current)
        return {task: keyring.unwrap(value, task) for task, value in wrapped.items()}, stale

    def forget(self, partitions: list[TopicPartition]) -> None:
        for tp in partitions:
            self._tasks.pop(tp.partition, None)
            self._keys.pop(tp.partition, None)
            self._stale.pop(tp.partition, None)
            self._live.pop(tp.partition, None)

    def restore_all(self) -> None:
        """After an aborted transaction the in-memory state ran ahead of the log: rebuild it."""
        owned = [TopicPartition(self.layout.inbox, p) for p in list(self._tasks)]
        self._tasks.clear()
        self._keys.clear()
        self._live.clear()
        self.restore(owned)


def _marked_answer(step: Step, compensation: bool) -> list[str]:
    """The fields of an attempt's answer its agent seals (``*``: all): the step's marking, or for its
    compensation every field of a marked step, as ``scheduler.sealing`` seals them on ``events``."""
    if compensation or step.sensitive_output is True:
        return ["*"] if step.is_sensitive else []
    return sorted(step.sensitive_output) if step.sensitive_output else []


def build_scheduler(kafka: KafkaSettings, consumer: ConsumerSettings, registry: WorkflowRegistry,
                    limits: Limits, instance: str | None = None,
                    stop_event: threading.Event | None = None, keyring: Keyring | None = None) -> ConsumerRuntime:
    layout = TopicLayout.from_settings(kafka)
    bootstrap = kafka.resolved_bootstrap()
    scheduler = Scheduler(bootstrap=bootstrap, layout=layout, registry=registry, limits=limits, keyring=keyring)
    # A stable instance name lets a restarted scheduler fence its own zombie at once.
    transactional_id = f"{layout.prefix}scheduler-{instance or uuid.uuid4().hex}"

    def on_assign(partitions: list[TopicPartition]) -> None:
        scheduler.restore(partitions)

    return ConsumerRuntime(
        bootstrap=bootstrap,
        group_id=layout.scheduler_group,
        topics=[layout.inbox],
        handler=scheduler.handle,
        dlq_topic=layout.dlq,
        settings=consumer,
        transactional_id=transactional_id,
        on_assign=on_assign,
        on_revoke=scheduler.forget,
        on_abort=scheduler.restore_all,
        stop_event=stop_event,
    )
