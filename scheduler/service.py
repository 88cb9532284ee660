"""``stepstream run scheduler``: the I/O around the decider.

For each batch from ``inbox`` it decides, appends the events to ``events`` (on the inbox record's own
partition number, so a task's commands and history always share a partition), sends the agent requests
and status updates those events call for, and commits the inbox offsets, all in one Kafka transaction.
Owning an inbox partition in the consumer group is the lock on its tasks; before handling any command of
a newly assigned partition it restores that partition's tasks by folding ``events``.

An attempt's request carries its start-by and the length of its work deadline; the agent that takes it
acknowledges on ``inbox`` (``AttemptAccepted``) and the decider records ``StepAccepted``, which starts the
work deadline (see ``scheduler.workflow.Step``).

A retry that must wait is a timer in the task's state (``StepRetryScheduled``); the scheduler keeps a queue
of the current timers of the tasks it owns, rebuilt with every restore, and fires each when due by
sending ``RetryDue`` to ``inbox`` (``scheduler.timers``), which the decider turns into the attempt.

Compensation attempts are agent requests like forward ones, to the compensation's agent, with the step's
compensation idempotency key. Sensitive output fields are sealed on their way to ``events`` and opened
when a partition is restored (``scheduler.sealing``); the agents get clear values, as their services need.
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
from eventstore.producer import EventProducer
from eventstore.replay import ReplayReader
from eventstore.runtime import ConsumerRuntime, Record
from eventstore.settings import ConsumerSettings, KafkaSettings
from eventstore.topics import TopicLayout, TopicSpec, ensure_topics
from eventstore.tracing import attempt_span, headers_of, span_for
from scheduler.decider import (
    Limits,
    TaskState,
    compensation_idempotency_key,
    decide,
    evolve,
    idempotency_key,
    pending,
    same_timer,
)
from scheduler.sealing import EventSealer
from scheduler.timers import TimerQueue
from scheduler.traces import record_spans
from scheduler.workflow import WorkflowRegistry
from schemas.messages import (
    AgentRequest,
    AttemptAccepted,
    CompensationStarted,
    Event,
    Message,
    OperatorCommand,
    RecoverStep,
    RetryDue,
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
    TaskFailed,
    TaskRejected,
)
from schemas.sealed import Keyring
from schemas.states import StepStatus, TaskStatus, step_progress

log = structlog.get_logger("stepstream.scheduler")

IN_FLIGHT = Gauge("stepstream_tasks_in_flight", "Non-terminal tasks owned by this scheduler", ["partition"])

_STATUS_OF: dict[type[Event], str] = {
    TaskAccepted: TaskStatus.ACCEPTED,
    TaskRejected: TaskStatus.REJECTED,
    StepSucceeded: step_progress(StepStatus.SUCCEEDED),
    StepFailed: step_progress(StepStatus.FAILED),
    TaskCompleted: TaskStatus.COMPLETED,
    TaskFailed: TaskStatus.ERROR,
    CompensationStarted: TaskStatus.COMPENSATING,
    StepCompensated: step_progress(StepStatus.COMPENSATED),
    TaskCompensated: TaskStatus.COMPENSATED,
    TaskCompensationFailed: TaskStatus.COMPENSATION_FAILED,
}
"""What a submitter's reply topic is told of each event: the task's status it leads to, or the step's outcome."""


class Scheduler:
    """Holds the state of the tasks on the partitions it owns; everything else is the decider's."""

    def __init__(self, *, bootstrap: str, layout: TopicLayout, registry: WorkflowRegistry, limits: Limits,
                 keyring: Keyring | None = None, stop: threading.Event | None = None) -> None:
        self.bootstrap = bootstrap
        self.layout = layout
        self.registry = registry
        self.limits = limits
        # Checked before anything runs: sensitive workflows without a key never start.
        self.sealer = EventSealer(registry, keyring)
        self._tasks: dict[int, dict[str, TaskState]] = {}
        self._admin = AdminClient(connection_config(bootstrap))
        self._known_topics: set[str] = set()
        # Non-terminal tasks per partition, kept up to date as states change: admission control asks for
        # it on every submission, and counting would walk every task the partition ever held.
        self._live: dict[int, int] = {}
        self._firings = EventProducer(bootstrap)
        self.timers = TimerQueue(self._fire, lambda: self._firings.flush(10.0), self._timer_is_current,
                                 stop or threading.Event())

    # -- commands -----------------------------------------------------------------------------

    def handle(self, record: Record, output: EventProducer) -> None:
        command = record.message
        if not isinstance(command, (SubmitTask, StepResult, RecoverStep, OperatorCommand, AttemptAccepted, RetryDue)):
            raise PoisonMessageError(f"{type(command).__name__} is not a command the scheduler takes")
        tasks = self._tasks.setdefault(record.partition, {})
        state = tasks.get(command.task_id)
        was_live = state is not None and not state.is_terminal
        with span_for(command.task_id, f"scheduler {type(command).__name__}", record.headers):
            decision = decide(command, state, registry=self.registry, now=datetime.now(UTC),
                              in_flight=self.in_flight(record.partition), limits=self.limits)
            for event in decision.events:
                before, state = state, evolve(state, event)
                output.send(self.layout.events, self.sealer.seal(event), partition=record.partition)
                self._effects(event, state, command, output)
                record_spans(event, before)
        if state is not None:
            tasks[command.task_id] = state
            self.timers.arm(record.partition, pending(state), state.task_id)
            live = self._live.get(record.partition, 0) + (not state.is_terminal) - was_live
            self._live[record.partition] = live
            IN_FLIGHT.labels(str(record.partition)).set(live)
        if decision.dead_letter is not None:
            # The alert event (if any) is already in this transaction; the command itself is dead-lettered.
            raise PoisonMessageError(decision.dead_letter)

    def in_flight(self, partition: int) -> int:
        return self._live.get(partition, 0)

    # -- timers -------------------------------------------------------------------------------

    def _fire(self, partition: int, due: RetryDue) -> None:
        """A timer came due: ask for its attempt on the task's own inbox partition, like any command."""
        self._firings.send(self.layout.inbox, due, partition=partition)

    def _timer_is_current(self, partition: int, due: RetryDue) -> bool:
        state = self._tasks.get(partition, {}).get(due.task_id)
        current = pending(state) if state is not None else None
        return current is not None and same_timer(current, due)

    def _effects(self, event: Event, state: TaskState, command: Message, output: EventProducer) -> None:
        if isinstance(event, StepStarted | StepCompensationStarted):
            self._request(event, state, output)
            return
        status = _STATUS_OF.get(type(event))
        reply_topic = self._reply_topic(state, command)
        if status is None or reply_topic is None:
            return
        detail = getattr(event, "step", None) or getattr(event, "reason", None)
        output.send(reply_topic, StatusUpdate(task_id=state.task_id, status=status, detail=detail))

    def _request(self, event: StepStarted | StepCompensationStarted, state: TaskState, output: EventProducer) -> None:
        """The agent request an attempt's start calls for: the step's own agent, or its compensation's."""
        step = self.registry.get(state.workflow, state.workflow_version).step(event.step)
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
        self._ensure_topic(TopicSpec(self.layout.agent(agent), self.layout.partitions))
        output.send(self.layout.agent(agent), AgentRequest(
            task_id=state.task_id, step=event.step, attempt=event.attempt, attempt_id=event.attempt_id,
            idempotency_key=key, complete_by=event.complete_by, calls_allowed=event.calls_allowed, input=data,
            undoes_key=undoes_key, undoes_attempt=undoes_attempt, start_by=event.start_by, timeout_s=timeout_s,
            compensation=isinstance(event, StepCompensationStarted),
            not_before=event.not_before if isinstance(event, StepCompensationStarted) else None,
        ), headers=headers_of(attempt_span(state.task_id, event.attempt_id)))

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
            reader = ReplayReader(self.bootstrap, self.layout.events, partitions=[tp.partition])
            for record in reader:
                if isinstance(record.message, Event):
                    event = self.sealer.unseal(record.message)
                    tasks[event.task_id] = evolve(tasks.get(event.task_id), event)
            self._tasks[tp.partition] = tasks
            for state in tasks.values():
                self.timers.arm(tp.partition, pending(state), state.task_id)
            self._live[tp.partition] = sum(1 for state in tasks.values() if not state.is_terminal)
            IN_FLIGHT.labels(str(tp.partition)).set(self.in_flight(tp.partition))
            log.info("partition restored", partition=tp.partition, tasks=len(tasks),
                     in_flight=self.in_flight(tp.partition), events=reader.stats.records)

    def forget(self, partitions: list[TopicPartition]) -> None:
        for tp in partitions:
            self.timers.forget(set(self._tasks.pop(tp.partition, {})))
            self._live.pop(tp.partition, None)

    def restore_all(self) -> None:
        """After an aborted transaction the in-memory state ran ahead of the log: rebuild it."""
        owned = [TopicPartition(self.layout.inbox, p) for p in list(self._tasks)]
        self._tasks.clear()
        self._live.clear()
        self.restore(owned)


def build_scheduler(kafka: KafkaSettings, consumer: ConsumerSettings, registry: WorkflowRegistry,
                    limits: Limits, instance: str | None = None,
                    stop_event: threading.Event | None = None, keyring: Keyring | None = None) -> ConsumerRuntime:
    layout = TopicLayout.from_settings(kafka)
    bootstrap = kafka.resolved_bootstrap()
    stop_event = stop_event or threading.Event()
    scheduler = Scheduler(bootstrap=bootstrap, layout=layout, registry=registry, limits=limits, keyring=keyring,
                          stop=stop_event)
    threading.Thread(target=scheduler.timers.run, name="timers", daemon=True).start()
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
