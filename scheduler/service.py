"""``stepstream run scheduler``: the I/O around the decider.

For each batch from ``inbox`` it decides, appends the events to ``events`` (on the inbox record's own
partition number, so a task's commands and history always share a partition), sends the agent requests
and status updates those events call for, and commits the inbox offsets, all in one Kafka transaction.
Owning an inbox partition in the consumer group is the lock on its tasks; before handling any command of
a newly assigned partition it restores that partition's tasks from its changelog (``scheduler-state``,
written in each batch's transaction, see ``scheduler.changelog``) and the events the changelog does not
reflect yet (``scheduler.restore``), on a thread of its own with the partition paused (the consumer
runtime's ``on_assign_paused``), not in the rebalance callback.

A record on an inbox partition that does not own its task (a producer with another partitioner than
murmur2) is moved as it is to the one that does, in the batch's transaction, and decided only there
(``scheduler.placement``).

An attempt's request carries its start-by and the length of its work deadline; the agent that takes it
acknowledges on ``inbox`` (``AttemptAccepted``) and the decider records ``StepAccepted``, which starts the
work deadline (see ``scheduler.workflow.Step``).

A retry that must wait is a timer in the task's state (``StepRetryScheduled``); the scheduler keeps a queue
of the current timers of the tasks it owns, rebuilt with every restore, and fires each when due by
sending ``RetryDue`` to ``inbox`` (``scheduler.timers``), which the decider turns into the attempt.

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
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import structlog
from confluent_kafka import TopicPartition
from confluent_kafka.admin import AdminClient
from prometheus_client import Gauge

from eventstore.errors import PoisonMessageError
from eventstore.kafka_config import connection_config
from eventstore.keys import ERASED, PROPOSED, Proposals, StrayProposals, proposal_record, read_key_records
from eventstore.producer import EventProducer
from eventstore.runtime import ConsumerRuntime, Record
from eventstore.settings import ConsumerSettings, KafkaSettings
from eventstore.topics import TopicLayout, TopicSpec, ensure_topics, partition_count
from eventstore.tracing import attempt_span, headers_of, span_for
from scheduler import offers
from scheduler.changelog import CHECKPOINT_KEY, SavedTask, encode_checkpoint, encode_task
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
from scheduler.placement import MOVED_FROM, MisplacedRecords, owner_elsewhere
from scheduler.quarantine import UNFOLDABLE, Quarantine
from scheduler.restore import restore_partition, return_freed_memory
from scheduler.sealing import EventSealer, granted, open_input, seal_input
from scheduler.settled import PartitionTasks, UnreadableSettledState
from scheduler.timers import TimerQueue
from scheduler.traces import record_spans
from scheduler.workflow import Step, WorkflowNotFoundError, WorkflowRegistry
from schemas.messages import (
    AgentRequest,
    AttemptAccepted,
    CompensationStarted,
    Event,
    Message,
    OperatorAlert,
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
    TaskDataErased,
    TaskFailed,
    TaskQuarantined,
    TaskRejected,
    TaskReleased,
)
from schemas.sealed import Keyring, SealingError, TaskKey
from schemas.states import FINAL, StepStatus, TaskStatus, step_progress

log = structlog.get_logger("stepstream.scheduler")

REWRAP_PER_COMMAND = 20
"""Data keys rewrapped under the current master key with each command a partition handles: enough to
rewrap a busy partition's keys in minutes, little enough not to be felt in a batch."""

IN_FLIGHT = Gauge("stepstream_tasks_in_flight", "Non-terminal tasks owned by this scheduler", ["partition"])
HELD = Gauge("stepstream_scheduler_tasks_held",
             "Tasks whose state this scheduler holds in memory: the ones not ended", ["partition"])
SPILLED = Gauge("stepstream_scheduler_tasks_spilled",
                "Ended tasks whose state this scheduler keeps on local disk (scheduler.settled)", ["partition"])
RESTORE_RECORDS = Gauge("stepstream_scheduler_restore_records",
                        "Records the last restore of a partition read, from the changelog and from events",
                        ["partition", "source"])
QUARANTINED = Gauge("stepstream_tasks_quarantined", "Tasks set aside because their history does not fold",
                    ["partition"])

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
        # Per owned partition, its tasks: the live ones in memory, the finished ones spilled (``scheduler.settled``).
        self._tasks: dict[int, PartitionTasks] = {}
        self._keys: dict[int, dict[str, TaskKey]] = {}  # the data keys of the owned tasks that have one
        self._stale: dict[int, list[str]] = {}  # per partition, tasks whose key an older master key wraps
        self._proposals: dict[int, Proposals] = {}  # per partition, the data keys submitters proposed
        self._taken: list[tuple[int, str]] = []  # proposals the open transaction took (and tombstoned)
        self._strays: StrayProposals | None = None  # proposals on any keys partition, followed once one is missed
        # Inbox records on a partition that does not own their task are moved to the one that does: by the
        # partition count of the topic itself (read again with each assignment), not the configured one.
        self._inbox_partitions = layout.partitions
        self._misplaced = MisplacedRecords()
        self._admin = AdminClient(connection_config(bootstrap))
        self._known_topics: set[str] = set()
        # Non-terminal tasks per partition, kept up to date as states change: admission control asks for
        # it on every submission, and counting would walk every task the partition ever held.
        self._live: dict[int, int] = {}
        self._firings = EventProducer(bootstrap)
        self.timers = TimerQueue(self._fire, lambda: self._firings.flush(10.0), self._timer_is_current,
                                 stop or threading.Event())
        self._quarantined: dict[int, dict[str, Quarantine]] = {}
        # What each task touched by the open transaction was before it (state, quarantine, data key): an aborted batch
        # puts back these tasks only, instead of folding every owned partition again.
        self._batch: dict[tuple[int, str], tuple[TaskState | None, Quarantine | None, TaskKey | None]] = {}
        # Per partition, the tasks whose state the changelog does not hold yet (a restore folded them from
        # ``events``), where ``events`` ended when it was restored, and the partitions the open transaction
        # writes to the changelog (their unsaved tasks are saved once it commits).
        self._unsaved: dict[int, set[str]] = {}
        self._events_end: dict[int, int] = {}
        self._saving: set[int] = set()
        # Records read by the last restore of each partition: what a restore costs (logged, and benchmarked).
        self.restored_records: dict[int, int] = {}
        # Restores run on the runtime's preparing thread and install their fold only while the runtime says the
        # partition is still theirs; a revocation (``forget``, on the loop's thread) takes the same lock, so it
        # comes wholly before an install or wholly after it, and clears what it installed.
        self._ownership = threading.Lock()
        # Quarantines found while restoring are recorded at once, outside the consumer's transactions: a
        # restore runs before any batch, and a quarantine already on the log is never recorded twice.
        self._recorder = EventProducer(bootstrap)

    # -- commands -----------------------------------------------------------------------------

    def handle(self, record: Record, output: EventProducer) -> None:
        command = record.message
        if not isinstance(command, (SubmitTask, StepResult, RecoverStep, OperatorCommand, AttemptAccepted, RetryDue)):
            raise PoisonMessageError(f"{type(command).__name__} is not a command the scheduler takes")
        if (owner := owner_elsewhere(command.task_id, record.partition, self._inbox_partitions)) is not None:
            self._move(record, command.task_id, owner, output)
            return
        tasks = self._partition_tasks(record.partition)
        keys = self._keys.setdefault(record.partition, {})
        try:
            state = tasks.get(command.task_id)
        except UnreadableSettledState as exc:
            raise PoisonMessageError(str(exc)) from None
        quarantine = self._quarantined.get(record.partition, {}).get(command.task_id)
        self._batch.setdefault((record.partition, command.task_id), (state, quarantine, keys.get(command.task_id)))
        if quarantine is not None:
            self._release_or_refuse(quarantine, command, state, record.partition, output)
            return
        if (reply_topic := self._reply_topic(state, command)) is not None:
            # Made before anything of this command is produced: made lazily with the status update, a creation
            # that failed (a timeout under load) raised between the command's events and that update, and the
            # runtime's retry of the command sent its events a second time in the same transaction.
            self._ensure_topic(TopicSpec(reply_topic, self.layout.partitions))
        was_live = state is not None and not state.is_terminal
        before = state
        new_key: TaskKey | None = None
        proposal: tuple[int, str] | None = None
        with span_for(command.task_id, f"scheduler {type(command).__name__}", record.headers):
            if isinstance(command, SubmitTask):
                command, new_key, proposal = self._under_task_key(command, state, keys.get(command.task_id),
                                                                  record.partition)
            try:
                decision = decide(command, state, registry=self.registry, now=datetime.now(UTC),
                                  in_flight=self.in_flight(record.partition), limits=self.limits)
                decided = [(event, state := evolve(state, event)) for event in decision.events]
            except UNFOLDABLE as exc:
                if before is None:
                    raise
                # This version's decider refuses what it decided itself: set the task aside, not the partition.
                self._quarantine(record.partition, Quarantine(
                    command.task_id, f"{type(command).__name__} does not fold: {exc}", before.workflow,
                    before.workflow_version, before.sequence + 1, command.message_id), output)
                raise PoisonMessageError(f"task quarantined: {exc}") from exc
            previous = before
            for event, after in decided:
                self._keep_key(event, new_key, keys, output, record.partition)
                output.send(self.layout.events, self.sealer.seal(event, keys.get(event.task_id)),
                            partition=record.partition)
                self._effects(event, after, command, output, keys.get(event.task_id))
                record_spans(event, previous)
                previous = after
            self._rewrap(record.partition, output)
        if state is not None:
            # A finished task leaves memory but for what a late command to it can still need.
            tasks[command.task_id] = state.settled() if state.status in FINAL else state
            self.timers.arm(record.partition, pending(state), state.task_id)
            self._count_live(record.partition, (not state.is_terminal) - was_live)
            self._count_held(record.partition, tasks)
        if decision.dead_letter is not None:
            # The alert event (if any) is already in this transaction; the command itself is dead-lettered, its
            # proposed key (if any) kept on ``keys``, so a replay of the dead letter can open its input.
            raise PoisonMessageError(decision.dead_letter)
        if proposal is not None:
            self._take(*proposal, output)

    def _move(self, record: Record, task_id: str, owner: int, output: EventProducer) -> None:
        """Produce ``record`` as it is (key, bytes, headers) to the inbox partition that owns its task, in the
        open transaction with this record's offset: it is moved exactly once and decided only there."""
        assert record.value is not None, "the consumer runtime hands the handler each record's bytes"
        origin = f"{record.topic}[{record.partition}]@{record.offset}".encode()
        output.send_raw(self.layout.inbox, task_id, record.value, [*record.headers, (MOVED_FROM, origin)],
                        partition=owner)
        self._misplaced.add("inbox", record.partition, owner)

    def in_flight(self, partition: int) -> int:
        return self._live.get(partition, 0)

    def _partition_tasks(self, partition: int) -> PartitionTasks:
        tasks = self._tasks.get(partition)
        if tasks is None:
            tasks = self._tasks[partition] = PartitionTasks()
        return tasks

    # -- timers -------------------------------------------------------------------------------

    def _fire(self, partition: int, due: RetryDue) -> None:
        """A timer came due: ask for its attempt on the task's own inbox partition, like any command."""
        self._firings.send(self.layout.inbox, due, partition=partition)

    def _timer_is_current(self, partition: int, due: RetryDue) -> bool:
        # On the timers' thread: only what is in memory is read (a finished task has no timer).
        tasks = self._tasks.get(partition)
        state = tasks.held(due.task_id) if tasks is not None else None
        current = pending(state) if state is not None else None
        return current is not None and same_timer(current, due)
    def _count_live(self, partition: int, change: int) -> None:
        live = self._live[partition] = self._live.get(partition, 0) + change
        IN_FLIGHT.labels(str(partition)).set(live)

    @staticmethod
    def _count_held(partition: int, tasks: PartitionTasks) -> None:
        HELD.labels(str(partition)).set(tasks.in_memory)
        SPILLED.labels(str(partition)).set(tasks.spilled)

    # -- quarantine -----------------------------------------------------------------------------

    def _release_or_refuse(self, quarantine: Quarantine, command: Message, state: TaskState | None, partition: int,
                           output: EventProducer) -> None:
        """A quarantined task's command: an operator's release of a task this version folds lets it go on;
        anything else is dead-lettered with the reason it was set aside."""
        if not (isinstance(command, OperatorCommand) and command.action == "release"):
            raise PoisonMessageError(f"task quarantined: {quarantine.reason}")
        if not quarantine.foldable or state is None:
            raise PoisonMessageError(f"task quarantined: this version cannot fold its history either: "
                                     f"{quarantine.reason}")
        released = TaskReleased(task_id=state.task_id, sequence=state.sequence + 1, workflow=state.workflow,
                                workflow_version=state.workflow_version, causation_id=command.message_id,
                                status=state.status, command_id=command.command_id, operator=command.operator)
        self._tasks[partition][state.task_id] = evolve(state, released)
        output.send(self.layout.events, released, partition=partition)
        del self._quarantined[partition][state.task_id]
        QUARANTINED.labels(str(partition)).set(len(self._quarantined[partition]))
        log.warning("task released from quarantine", task_id=state.task_id, partition=partition,
                    operator=command.operator, status=state.status)

    def _quarantine(self, partition: int, quarantine: Quarantine, output: EventProducer) -> None:
        """Set a task aside, and say why on the log (an alert, then the quarantine) unless it already does.
        The state of a task this version cannot fold leaves memory; one it folds stays, for its release."""
        if not quarantine.foldable and partition in self._tasks:
            self._tasks[partition].pop(quarantine.task_id, None)
        owned = self._quarantined.setdefault(partition, {})
        owned[quarantine.task_id] = quarantine
        QUARANTINED.labels(str(partition)).set(len(owned))
        log.error("task quarantined", task_id=quarantine.task_id, partition=partition, reason=quarantine.reason,
                  recorded=quarantine.recorded)
        if quarantine.recorded:
            return
        common: dict[str, Any] = {"task_id": quarantine.task_id, "workflow": quarantine.workflow,
                  "workflow_version": quarantine.workflow_version, "causation_id": quarantine.causation_id}
        sequence = quarantine.next_sequence
        output.send(self.layout.events, OperatorAlert(**common, sequence=sequence,
                                                      reason=f"task quarantined: {quarantine.reason}"),
                    partition=partition)
        output.send(self.layout.events, TaskQuarantined(**common, sequence=sequence + 1, reason=quarantine.reason,
                                                        unfolded_sequence=quarantine.unfolded_sequence),
                    partition=partition)
        quarantine.next_sequence, quarantine.recorded = sequence + 2, True

    # -- data keys ------------------------------------------------------------------------------

    def _under_task_key(self, command: SubmitTask, state: TaskState | None, known: TaskKey | None, partition: int
                        ) -> tuple[SubmitTask, TaskKey | None, tuple[int, str] | None]:
        """A submission with its marked input sealed under the task's data key, the key a new task gets, and
        where the key it proposed is (``keys`` partition and record), to be taken once it is handled.

        The key is the known task's (a repeat then seals to the very bytes it was accepted with, so the
        decider tells a repeat from a contradiction by digest as for any task), else the submission's own,
        else a new one: a submitter that sent a marked field in clear (an older client) does not get it
        written in clear to ``events``. Nothing here opens what it does not reseal. The submission's own key
        is the one it proposed on ``keys`` (``eventstore.keys``), whose tombstone goes in this transaction
        unless the submission is dead-lettered, or, from an older submitter, the one it carries.
        """
        wrapped, proposal = command.data_key, None
        if command.key_ref is not None:
            proposal, wrapped = self._proposed_key(command, partition)
        try:
            workflow = self.registry.get(command.workflow, command.workflow_version if state is None
                                         else state.workflow_version)
        except WorkflowNotFoundError:
            return command, None, proposal  # the decider dead-letters it
        if not workflow.has_sensitive_data:
            return command, None, proposal
        if wrapped is not None and self.sealer.keyring is not None:
            try:
                own: TaskKey | None = self.sealer.keyring.unwrap(wrapped, command.task_id)
            except SealingError as exc:
                raise PoisonMessageError(f"submission of task {command.task_id}: {exc}") from None
        else:
            own = None
        key = known or own or TaskKey.generate()
        data = command.input
        if own is not None and own != key:
            data = open_input(workflow, command.task_id, data, own)
        sealed = command.model_copy(update={"input": seal_input(workflow, command.task_id, data, key),
                                            "data_key": None, "key_ref": None})
        return sealed, None if known is not None else key, proposal

    def _proposed_key(self, command: SubmitTask, partition: int) -> tuple[tuple[int, str], str]:
        """Where the key a submission proposed is (``keys`` partition and record), and the key, wrapped: on the
        task's own partition, or else on any (a producer that placed it otherwise). Found nowhere, the
        submission is dead-lettered: its sealed fields could never be opened."""
        assert command.key_ref is not None
        record = proposal_record(command.task_id, command.key_ref)
        wrapped = self._proposals[partition].wrapped(record)
        if wrapped is not None:
            return (partition, record), wrapped
        found = self._stray_proposals().find(record)
        if found is None:
            raise PoisonMessageError(f"submission of task {command.task_id}: key_ref {command.key_ref!r} names no "
                                     f"data key on {self.layout.keys} (not proposed yet, or taken already): its "
                                     "sealed input could not be opened")
        self._misplaced.add("keys", found[0], partition)
        return (found[0], record), found[1]

    def _stray_proposals(self) -> StrayProposals:
        """The follower of proposals on any ``keys`` partition, made at the first need (a miss on the task's own
        partition, or an erasure, whose task may have a dead-lettered submission's proposal anywhere)."""
        if self._strays is None:
            self._strays = StrayProposals(self.bootstrap, self.layout.keys)
        return self._strays

    def _take(self, partition: int, record: str, output: EventProducer, *, erasure: bool = False) -> None:
        """Tombstone a proposed key in the open transaction: a handled submission's (the task's own record holds
        the key now, or the task needed none), or, marked ``ERASED``, a kept one of an erased task. It leaves
        memory once the transaction commits."""
        output.send_raw(self.layout.keys, record, None, [PROPOSED, ERASED] if erasure else [PROPOSED],
                        partition=partition)
        self._taken.append((partition, record))

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
            # A dead-lettered submission's proposed key, kept for a replay, goes with the task's own.
            kept = {(partition, record) for record in self._proposals[partition].of_task(event.task_id)}
            kept.update(self._stray_proposals().of_task(event.task_id))
            for where, record in sorted(kept):
                self._take(where, record, output, erasure=True)

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
        output.send(reply_topic, StatusUpdate(task_id=state.task_id, status=status, detail=detail))

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
        # Only what the step is granted; outputs of earlier steps are clear in memory: sealed again for the agent.
        data, withheld = granted(workflow, step, data, isinstance(event, StepCompensationStarted))
        data = {**data, "steps": self.sealer.seal_outputs(workflow, state.task_id, data["steps"], data_key)}
        self._ensure_topic(TopicSpec(self.layout.agent(agent), self.layout.partitions))
        output.send(self.layout.agent(agent), AgentRequest(
            task_id=state.task_id, step=event.step, attempt=event.attempt, attempt_id=event.attempt_id,
            idempotency_key=key, complete_by=event.complete_by, calls_allowed=event.calls_allowed, input=data,
            undoes_key=undoes_key, undoes_attempt=undoes_attempt, start_by=event.start_by, timeout_s=timeout_s,
            compensation=isinstance(event, StepCompensationStarted),
            not_before=event.not_before if isinstance(event, StepCompensationStarted) else None,
            sealed_output=_marked_answer(step, isinstance(event, StepCompensationStarted)) if data_key else [],
            withheld=withheld,
        ), headers=headers_of(attempt_span(state.task_id, event.attempt_id)))

    def _reply_topic(self, state: TaskState | None, command: Message) -> str | None:
        """A submitter's private topic. Only names under this deployment's status prefix are served."""
        topic = state.reply_topic if state is not None else None
        submitter = state.submitter if state is not None else None
        if isinstance(command, SubmitTask) and topic is None and submitter is None:
            topic, submitter = command.reply_topic, command.submitter
        if topic is None and submitter is not None:
            topic = self.layout.status(submitter)
        if topic is None:
            return None
        if not topic.startswith(self.layout.status("")):
            log.warning("reply topic outside the status prefix ignored", task_id=command.task_id, topic=topic)
            return None
        return topic

    def create_agent_topics(self) -> None:
        """Every agent topic the registry's workflows name, before the first command is taken.

        Created lazily by a batch's first request instead, a topic is new to the transactional producer in
        the middle of that batch; the demo lost two requests of a committed batch that way (their events
        were on ``events``, the requests never reached ``agent.shipping``, and the tasks waited for the
        supervisor). A topic made at start is known before anything is produced to it.
        """
        for agent in sorted(self.registry.agents):
            self._ensure_topic(TopicSpec(self.layout.agent(agent), self.layout.partitions))

    def publish_offer(self, name: str) -> None:
        """Say on ``workflows`` which versions this scheduler runs, before it takes a command
        (``scheduler.offers``): submitters refuse a version none runs before producing it."""
        self._ensure_topic(self.layout.workflows_spec())
        offers.publish(self.bootstrap, self.layout.workflows, offers.offer_of(self.registry, name, datetime.now(UTC)))

    def _ensure_topic(self, spec: TopicSpec) -> None:
        """Agent topics are made at start, a status topic before a command that may answer on it produces
        anything: a missing topic would fail the batch."""
        if spec.name not in self._known_topics:
            ensure_topics(self._admin, [spec], self.layout.replication_factor)
            self._known_topics.add(spec.name)

    # -- partition ownership ------------------------------------------------------------------

    def restore(self, partitions: list[TopicPartition],
                still_assigned: Callable[[TopicPartition], bool] = lambda _tp: True) -> None:
        """Restore each newly owned partition from the changelog and the events it does not reflect yet
        (``scheduler.restore``) before any of its commands is handled.

        Runs on the runtime's preparing thread while the partitions are paused (``on_assign_paused``); the
        loop goes on polling meanwhile. A partition no longer ``still_assigned`` when its fold is ready is not
        installed: it was revoked meanwhile, and a later assignment restores it afresh. (An epoch read as each
        partition's turn came was not enough: a restore of four partitions, revoked while on its first, read the
        epoch of the next assignment for the others, installed an empty fold over the one that assignment's own
        restore had installed and its commands had grown, and the tasks' next commands were dead-lettered as
        "unknown task".)
        """
        self._ensure_topic(self.layout.scheduler_state_spec())
        self._inbox_partitions = partition_count(self._admin, self.layout.inbox)
        for tp in partitions:
            keys, stale, proposals = self._restore_keys(tp.partition)
            restored = restore_partition(self.bootstrap, self.layout, tp.partition, self.sealer, keys)
            with self._ownership:
                if not still_assigned(tp):
                    log.info("partition revoked while restoring", partition=tp.partition)
                    continue
                self.restored_records[tp.partition] = restored.changelog_records + restored.event_records
                RESTORE_RECORDS.labels(str(tp.partition), "changelog").set(restored.changelog_records)
                RESTORE_RECORDS.labels(str(tp.partition), "events").set(restored.event_records)
                tasks = self._tasks[tp.partition] = restored.tasks
                self._keys[tp.partition], self._stale[tp.partition] = keys, stale
                self._proposals[tp.partition] = proposals
                self._unsaved[tp.partition] = restored.unsaved
                self._events_end[tp.partition] = restored.events_end
                for state in tasks.live():
                    self.timers.arm(tp.partition, pending(state), state.task_id)
                self._quarantined[tp.partition] = {}
                for quarantine in restored.quarantined.values():
                    self._quarantine(tp.partition, quarantine, self._recorder)
                QUARANTINED.labels(str(tp.partition)).set(len(restored.quarantined))
                self._live[tp.partition] = sum(1 for state in tasks.live() if not state.is_terminal)
                IN_FLIGHT.labels(str(tp.partition)).set(self.in_flight(tp.partition))
                self._count_held(tp.partition, tasks)
            self._recorder.flush()
            log.info("partition restored", partition=tp.partition, tasks=len(tasks), spilled=tasks.spilled,
                     in_flight=self.in_flight(tp.partition), changelog_records=restored.changelog_records,
                     events=restored.event_records, unsaved=len(restored.unsaved),
                     refolded=len(restored.refolded), quarantined=len(restored.quarantined),
                     unattributed=restored.unattributed)
        return_freed_memory()

    def save_state(self, output: EventProducer) -> None:
        """Write the state of every task the open transaction changed to the changelog, in that transaction
        (the runtime's ``on_batch_end``), with the tasks a restore folded from ``events`` and each touched
        partition's checkpoint: where ``events`` stood when this transaction began, every event below it now
        reflected by the changelog (``scheduler.changelog``)."""
        delivered = output.delivered_ends(self.layout.events)
        with self._ownership:
            touched: dict[int, dict[str, int | None]] = {}
            for (partition, task_id), (before, _quarantine, _key) in self._batch.items():
                touched.setdefault(partition, {})[task_id] = before.sequence + 1 if before is not None else 1
            for partition, unsaved in self._unsaved.items():
                for task_id in unsaved:
                    touched.setdefault(partition, {}).setdefault(task_id, None)
            for partition, changed in touched.items():
                if partition not in self._tasks:
                    continue  # not (or no longer) owned: its next owner restores it
                self._save_partition(partition, changed, delivered.get(partition, 0), output)
                self._saving.add(partition)

    def _save_partition(self, partition: int, changed: dict[str, int | None], delivered: int,
                        output: EventProducer) -> None:
        tasks, quarantined, keys = self._tasks[partition], self._quarantined.get(partition, {}), self._keys[partition]
        end = max(self._events_end.get(partition, 0), delivered)
        for task_id, overlap_from in changed.items():
            state, quarantine = tasks.get(task_id), quarantined.get(task_id)
            if state is None and quarantine is None:
                continue
            sealed = None if state is None else self.sealer.seal_state(state, keys.get(task_id))
            last = state.sequence if state is not None else (quarantine.next_sequence - 1 if quarantine else 0)
            output.send_raw(self.layout.scheduler_state, task_id,
                            encode_task(SavedTask(sealed, quarantine, overlap_from or last + 1)), partition=partition)
        output.send_raw(self.layout.scheduler_state, CHECKPOINT_KEY, encode_checkpoint(end), partition=partition)

    def _restore_keys(self, partition: int) -> tuple[dict[str, TaskKey], list[str], Proposals]:
        """The data keys of a partition's tasks, unwrapped (an erased task has none: its values stay sealed),
        the tasks whose key an older master key wraps, and the keys proposed for submissions not yet taken."""
        self._ensure_topic(self.layout.keys_spec())
        starts: dict[int, int] = {}
        records = read_key_records(self.bootstrap, self.layout.keys, starts, [partition])
        proposals = Proposals(self.bootstrap, self.layout.keys, partition, starts, records.proposals)
        wrapped = {task: value for task, value in records.tasks.items() if value is not None}
        if wrapped and self.sealer.keyring is None:
            raise SealingError(f"{self.layout.keys} holds data keys but no encryption key is configured "
                               "(STEPSTREAM_ENCRYPTION_KEYS)")
        keyring = self.sealer.keyring
        if keyring is None:
            return {}, [], proposals
        stale = sorted(task for task, value in wrapped.items() if keyring.wrapped_with(value) != keyring.current)
        return {task: keyring.unwrap(value, task) for task, value in wrapped.items()}, stale, proposals

    def forget(self, partitions: list[TopicPartition]) -> None:
        with self._ownership:
            for tp in partitions:
                tasks = self._tasks.pop(tp.partition, None)
                if tasks is not None:
                    self.timers.forget({state.task_id for state in tasks.live()})
                    tasks.close()
                self._keys.pop(tp.partition, None)
                self._stale.pop(tp.partition, None)
                proposals = self._proposals.pop(tp.partition, None)
                if proposals is not None:
                    proposals.close()
                self._live.pop(tp.partition, None)
                self._quarantined.pop(tp.partition, None)
                self._unsaved.pop(tp.partition, None)
                self._events_end.pop(tp.partition, None)
                for key in [key for key in self._batch if key[0] == tp.partition]:
                    del self._batch[key]  # a restore of the partition, not the batch, is its truth from now on
            if not self._proposals and self._strays is not None:
                # No partition owned (a stop, or all revoked): the follower of the whole topic closes with the
                # last one; the next need makes a new one, reading from the beginning again (it heeds only
                # erasures' tombstones, so one an aborted taking wrote does not hide a proposal from it).
                self._strays.close()
                self._strays = None

    def committed(self) -> None:
        """The open transaction committed: the states of its tasks are the log's and the changelog's now, its
        proposals taken."""
        self._batch.clear()
        for tasks in self._tasks.values():
            tasks.forget_fresh()
        for partition, record in self._taken:
            if partition in self._proposals:
                self._proposals[partition].taken(record)
            if self._strays is not None:
                self._strays.taken(record)
        self._taken.clear()
        self._misplaced.committed()
        with self._ownership:
            for partition in self._saving:
                self._unsaved.get(partition, set()).clear()
        self._saving.clear()

    def recover_batch(self) -> None:
        """After an aborted transaction the tasks it touched ran ahead of the log: put them back as they were
        when it began. Every other task is as the log says, so nothing is read again."""
        for (partition, task_id), (state, quarantine, key) in self._batch.items():
            tasks = self._tasks.get(partition)
            if tasks is None:
                continue  # revoked meanwhile: its next owner restores it from the log
            keys = self._keys.setdefault(partition, {})
            keys.pop(task_id, None)  # a key the batch wrote (or erased) is as the log says: none, or the old one
            if key is not None:
                keys[task_id] = key
            ahead = tasks.pop(task_id, None)
            if state is not None:
                tasks[task_id] = state
            self.timers.arm(partition, pending(state) if state is not None else None, task_id)
            self._count_live(partition, (state is not None and not state.is_terminal)
                             - (ahead is not None and not ahead.is_terminal))
            self._count_held(partition, tasks)
            quarantined = self._quarantined.setdefault(partition, {})
            quarantined.pop(task_id, None)
            if quarantine is not None:
                quarantined[task_id] = quarantine
            QUARANTINED.labels(str(partition)).set(len(quarantined))
        log.info("aborted batch recovered", tasks=len(self._batch))
        self._batch.clear()
        for tasks in self._tasks.values():
            tasks.forget_fresh()
        self._taken.clear()  # still pending: the batch's submissions come again
        self._misplaced.aborted()
        self._saving.clear()  # what the aborted transaction wrote to the changelog is not there: still unsaved


def _marked_answer(step: Step, compensation: bool) -> list[str]:
    """The fields of an attempt's answer its agent seals (``*``: all): the step's marking, or for its
    compensation every field of a marked step, as ``scheduler.sealing`` seals them on ``events``."""
    if compensation or step.sensitive_output is True:
        return ["*"] if step.is_sensitive else []
    return sorted(step.sensitive_output) if step.sensitive_output else []


def scheduler_transactional_id(layout: TopicLayout, instance: str) -> str:
    """The transactional id of the scheduler named ``instance``: a stable name lets a restarted scheduler fence
    its own zombie at once. Tools that look for its transaction coordinator (the broker-kill runs) derive it
    here too."""
    return f"{layout.prefix}scheduler-{instance}"


def build_scheduler(kafka: KafkaSettings, consumer: ConsumerSettings, registry: WorkflowRegistry,
                    limits: Limits, instance: str | None = None,
                    stop_event: threading.Event | None = None, keyring: Keyring | None = None) -> ConsumerRuntime:
    layout = TopicLayout.from_settings(kafka)
    bootstrap = kafka.resolved_bootstrap()
    stop_event = stop_event or threading.Event()
    scheduler = Scheduler(bootstrap=bootstrap, layout=layout, registry=registry, limits=limits, keyring=keyring,
                          stop=stop_event)
    scheduler.create_agent_topics()
    threading.Thread(target=scheduler.timers.run, name="timers", daemon=True).start()
    instance = instance or uuid.uuid4().hex
    transactional_id = scheduler_transactional_id(layout, instance)
    scheduler.publish_offer(instance)

    runtime = ConsumerRuntime(
        bootstrap=bootstrap,
        group_id=layout.scheduler_group,
        topics=[layout.inbox],
        handler=scheduler.handle,
        dlq_topic=layout.dlq,
        settings=consumer,
        transactional_id=transactional_id,
        on_assign_paused=scheduler.restore,
        on_revoke=scheduler.forget,
        on_abort=scheduler.recover_batch,
        on_commit=scheduler.committed,
        on_batch_end=lambda: scheduler.save_state(runtime.output),
        stop_event=stop_event,
    )
    return runtime
