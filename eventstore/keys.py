"""The ``keys`` topic: each task's wrapped data key, the keys submitters propose, and erasure by tombstone.

A task's own record is keyed by the task id; its value is the data key wrapped by a master key
(``kid:base64``, UTF-8), and a tombstone (no value) is an erased key. The scheduler owning the task's
partition writes both, in the transaction of the events that call for them, so an agent that reads a
request (read_committed) finds its task's key here: a task it has not seen yet makes it read on.

A submitter that sealed a new task's input under a new data key never puts that key on ``inbox`` (kept
seven days, it would outlive an erasure). It *proposes* the key here first, under a record key of its own
(``proposal_record``: the task id and a random reference, with the ``PROPOSED`` header), on the partition
the task's inbox records land on, and produces the submission, naming only the reference, once the broker
acknowledged the proposal. The scheduler finds the proposal when it handles the submission (``Proposals``;
on any other partition when it is not on the task's: ``StrayProposals``, for a producer that placed it
otherwise), adopts the key (writing the task's own record) or reseals under the task's key, and writes the
proposal's tombstone in that same transaction. So the task's own record is the only one left, and an
erasure's tombstone of it leaves no copy of the key on any topic once ``keys`` is compacted. A submission
that is dead-lettered keeps its proposal, so the dead letter can be replayed; erasing its task tombstones it,
marked ``ERASED``: the one tombstone of a proposal a follower heeds before its transaction is known to commit.

A proposal never takes the task's own record key: a submitter racing an acceptance (it did not find the
task yet) would otherwise replace the accepted key, and compaction could drop the key the task's events
are sealed with before the scheduler wrote it back.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import structlog
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka import Message as KafkaMessage

from eventstore.errors import LogReadError
from eventstore.kafka_config import connection_config, consume_available
from eventstore.partitioning import partition_of
from eventstore.producer import EventProducer
from eventstore.replay import LogRange, watermarks
from eventstore.topics import partition_count, reader_group
from schemas.messages import SubmitTask
from schemas.sealed import Keyring

log = structlog.get_logger("stepstream.keys")

ENDS_TRY_S = 5.0
"""How long one question of where ``keys`` partitions end may take before a fresh consumer asks it again (a
healthy broker answers in milliseconds; one behind a dead leader never does)."""

PROPOSED = ("stepstream-key", b"proposed")
"""The header of a proposed key's record (and of its tombstone): what tells it from a task's own record."""

ERASED = ("stepstream-key-erased", b"erased")
"""Beside ``PROPOSED``, the header of a proposal's tombstone written by an erasure of its task (not by a submission
taking it). Followers read ``keys`` uncommitted, so they also see tombstones of transactions that are aborted
later. One of a taking is never heeded: a committed taking leaves no submission to need the proposal again, an
aborted one leaves a submission that will. One of an erasure is always heeded, aborted or not: the task's key
must not open anything once erased, and an aborted erasure is decided again when its command is handled again
(the same ended task, the same decision), when the followers still name the proposal (``of_task``) so its
tombstone is written again."""

ROLL = ("stepstream-key", b"roll")
ROLL_RECORD = "stepstream-keys-roll-" * 10
"""A marker appended to every partition now and then (``roll``), so an idle partition's active segment
rolls and the cleaner can remove an erased key (Kafka rolls a segment only when a record is appended).
Its record key is longer than any task id (200) and has no ``#``: it is no task's record and no proposal;
its value is empty (a tombstone), so compaction keeps at most one per partition."""


def new_reference() -> str:
    """A fresh reference for a proposed key: random, so no two submissions' proposals share a record."""
    return secrets.token_hex(16)


def proposal_record(task_id: str, reference: str) -> str:
    """The record key of a task's proposed data key."""
    return f"{task_id}#{reference}"


def proposal_task(record: str) -> str:
    """The task a proposal's record key (:func:`proposal_record`) names: what comes before its last ``#`` (a task
    id may hold one; a reference from :func:`new_reference` holds none)."""
    return record.rpartition("#")[0]


def proposal_change(msg: KafkaMessage) -> tuple[str, str | None] | None:
    """What a record read on ``keys`` says of a proposal: its record and wrapped key, or its record and None when
    an erasure tombstoned it (``ERASED``); None for any other record, the tombstone of a taking included."""
    key, value, headers = msg.key(), msg.value(), msg.headers() or []
    if key is None or PROPOSED not in headers:
        return None
    if value is not None:
        return key.decode(), value.decode()
    return (key.decode(), None) if ERASED in headers else None


@dataclass
class KeyRecords:
    """What a read of ``keys`` found: the last record of each task and of each proposal (None: tombstone)."""

    tasks: dict[str, str | None] = field(default_factory=dict)
    proposals: dict[str, str | None] = field(default_factory=dict)
    proposed_on: dict[str, int] = field(default_factory=dict)  # the partition of each proposal's last record


def read_key_records(bootstrap: str, topic: str, starts: dict[int, int], partitions: Iterable[int] | None = None
                     ) -> KeyRecords:
    """The records written from ``starts`` (per partition; advanced in place) to the topic's end."""
    found = KeyRecords()
    for msg in LogRange(bootstrap, topic, partitions=partitions, starts=starts):
        key, value = msg.key(), msg.value()
        starts[msg.partition()] = msg.offset() + 1
        if key is None:
            continue
        headers = msg.headers() or []
        if ROLL in headers:
            continue
        into = found.proposals if PROPOSED in headers else found.tasks
        into[key.decode()] = None if value is None else value.decode()
        if PROPOSED in headers:
            found.proposed_on[key.decode()] = msg.partition()
    return found


def read_keys(bootstrap: str, topic: str, starts: dict[int, int], partitions: Iterable[int] | None = None
              ) -> dict[str, str | None]:
    """The tasks' own keys written from ``starts`` to the topic's end: the last record of each task, None
    for a tombstone."""
    return read_key_records(bootstrap, topic, starts, partitions).tasks


@dataclass(frozen=True)
class KeyReport:
    """How many data keys each master key wraps on ``keys``: a retired master key may be deleted once it
    wraps none (every scheduler rewrapped its partitions' keys, no proposal of it is waiting)."""

    data_keys: dict[str, int]  # by master key id: the tasks' own keys
    proposed: dict[str, int]  # by master key id: keys proposed for submissions not taken yet
    erased: int  # tasks whose tombstone is still on the topic

    def wraps(self, key_id: str) -> int:
        """The data keys ``key_id`` still wraps, the tasks' and the proposed ones."""
        return self.data_keys.get(key_id, 0) + self.proposed.get(key_id, 0)


def key_report(bootstrap: str, topic: str) -> KeyReport:
    """Read ``keys`` to its end and count, per master key id, the data keys it wraps (no key is needed:
    the id is the clear prefix of a wrapped key)."""
    records = read_key_records(bootstrap, topic, {})

    def per_master(wrapped: Iterable[str | None]) -> dict[str, int]:
        return dict(Counter(Keyring.wrapped_with(value) for value in wrapped if value is not None))

    return KeyReport(per_master(records.tasks.values()), per_master(records.proposals.values()),
                     sum(1 for value in records.tasks.values() if value is None))


def roll(producer: EventProducer, topic: str, partitions: int) -> None:
    """Append the roll marker to each partition of ``topic`` (sent; the caller flushes)."""
    for partition in range(partitions):
        producer.send_raw(topic, ROLL_RECORD, None, [ROLL], partition=partition)


class KeyFollower:
    """Partitions of ``keys`` followed by one long-lived consumer: a lookup reads only what was appended since
    the last one, over connections already open.

    A read with a consumer made for each lookup (``LogRange``) took about 550 ms here even with nothing new
    to read (a connection, metadata, offsets, a first fetch, a close): an agent paid it for each task whose
    sealed input it opened (most of a lone order's time) and the scheduler for each batch of new submissions
    on a partition, stalling that partition meanwhile. The consumer is made at the first read, so an object
    that never needs to read never connects. Where the partitions end is asked by a second consumer that
    never fetches: the broker answers a connection's requests in order, and the follower's own connection
    usually holds a fetch waiting for new records (``fetch.wait.max.ms``), which held each such question up
    to 500 ms.
    """

    def __init__(self, bootstrap: str, topic: str, starts: Mapping[int, int] | None, *, committed_only: bool,
                 partitions: Iterable[int] | None = None) -> None:
        self.bootstrap = bootstrap
        self.topic = topic
        self.committed_only = committed_only
        self._starts = dict(starts or {})
        self._partitions = None if partitions is None else sorted(partitions)
        self._consumer: Consumer | None = None
        self._ends: Consumer | None = None  # asks where partitions end; never fetches
        self._reached: dict[int, int] = {}  # per partition: the offset the reading has reached

    def _follow(self) -> Consumer:
        if self._consumer is None:
            isolation = "read_committed" if self.committed_only else "read_uncommitted"
            consumer = Consumer({
                **connection_config(self.bootstrap),
                "group.id": reader_group("keys"),
                "enable.auto.commit": False,
                "enable.partition.eof": True,
                "isolation.level": isolation,
                # A lookup waits for the fetch in flight when what it needs came after it: at most this long
                # (default 500 ms), for ten fetches a second from an idle follower.
                "fetch.wait.max.ms": 100,
            })
            if self._partitions is None:
                metadata = consumer.list_topics(self.topic, timeout=30).topics[self.topic]
                if metadata.error is not None or not metadata.partitions:
                    consumer.close()
                    raise LogReadError(f"cannot read {self.topic}: {metadata.error}")
                self._partitions = sorted(metadata.partitions)
            consumer.assign([TopicPartition(self.topic, p, self._starts.get(p, OFFSET_BEGINNING))
                             for p in self._partitions])
            self._consumer = consumer
        return self._consumer

    def _ends_of(self, partitions: list[int], deadline: float) -> dict[int, int]:
        """Where ``partitions`` end now, asked by the consumer that never fetches.

        That consumer learns where partitions lead only when it is made: assigned nothing, it never refreshes
        its metadata, so after its partition's leader was SIGKILLed it asked the dead broker until the query
        timed out, and a new one timed out again (an agent took 30 s per request it opened). A question not
        answered within ``ENDS_TRY_S`` is asked again by a consumer made afresh, which finds the new leader.
        """
        while True:
            if self._ends is None:
                # Of the follower's isolation level: a read_committed query answers the last stable offset,
                # which stops before a proposal written behind the scheduler's open transaction.
                isolation = "read_committed" if self.committed_only else "read_uncommitted"
                self._ends = Consumer({**connection_config(self.bootstrap), "group.id": reader_group("keys-ends"),
                                       "enable.auto.commit": False, "isolation.level": isolation})
            try:
                return {p: watermarks(self._ends, TopicPartition(self.topic, p),
                                      timeout_s=max(0.1, min(ENDS_TRY_S, deadline - time.monotonic())))[1]
                        for p in partitions}
            except KafkaException as exc:
                self._ends.close()
                self._ends = None
                if time.monotonic() >= deadline:
                    raise LogReadError(f"{self.topic}: where its partitions end was not answered: {exc}") from exc
                log.warning("asking where keys end again, from a fresh connection", topic=self.topic,
                            error=repr(exc))

    def read_on(self, partitions: Iterable[int] | None, done: Callable[[], bool],
                timeout_s: float = 30.0) -> Iterator[KafkaMessage]:
        """The followed partitions' records from where the last read stopped, until ``done()`` holds or each
        of ``partitions`` (None: all followed) reached the end it had when this read began."""
        consumer = self._follow()
        wanted = self._partitions if partitions is None else sorted(partitions)
        assert wanted is not None
        deadline = time.monotonic() + timeout_s
        targets = self._ends_of(wanted, deadline)
        while not done() and any(self._reached.get(p, -1) < end for p, end in targets.items()):
            if time.monotonic() > deadline:
                raise LogReadError(f"{self.topic}: not read to its end within {timeout_s:g}s "
                                   f"(reached {self._reached}, end {targets})")
            for msg in consume_available(consumer, 1000, 0.1):
                error = msg.error()
                if error is not None:
                    if error.code() != KafkaError._PARTITION_EOF:
                        raise LogReadError(f"reading {self.topic}[{msg.partition()}] failed: {error}")
                    self._reached[msg.partition()] = max(self._reached.get(msg.partition(), -1), msg.offset())
                    continue
                self._reached[msg.partition()] = max(self._reached.get(msg.partition(), -1), msg.offset() + 1)
                yield msg

    def close(self) -> None:
        for consumer in (self._consumer, self._ends):
            if consumer is not None:
                consumer.close()
        self._consumer = self._ends = None


class DataKeys:
    """Wrapped data keys by task id, followed from the topic as far as a lookup needed."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self._follower = KeyFollower(bootstrap, topic, None, committed_only=True)
        self._wrapped: dict[str, str | None] = {}
        self._lock = threading.Lock()

    def wrapped(self, task_id: str) -> str | None:
        """The task's wrapped data key; None when it was erased or never written."""
        with self._lock:
            if task_id not in self._wrapped:
                for msg in self._follower.read_on(None, lambda: task_id in self._wrapped):
                    key, value = msg.key(), msg.value()
                    if key is not None and not {ROLL, PROPOSED} & set(msg.headers() or []):
                        self._wrapped[key.decode()] = None if value is None else value.decode()
            return self._wrapped.get(task_id)

    def close(self) -> None:
        self._follower.close()


class Proposals:
    """One ``keys`` partition's proposed data keys not yet taken, followed on from where a restore read.

    A submission's proposal was acknowledged before the submission was produced, so reading on to the
    partition's end finds it. That read is read_uncommitted: the scheduler's transaction stays open over
    several polls of ``inbox``, and once it wrote to the partition, a read_committed reader would stop at
    its first record and miss a proposal written after it (a submission polled later in the same batch).
    Proposals are written without a transaction, so none read is ever aborted; of the scheduler's own
    records only an erasure's tombstone of a proposal is heeded (``ERASED`` says why); a proposal leaves
    memory when the transaction that took or erased it committed (``taken``): an aborted batch comes again.
    """

    def __init__(self, bootstrap: str, topic: str, partition: int, starts: dict[int, int],
                 pending: dict[str, str | None]) -> None:
        self.partition = partition
        self._follower = KeyFollower(bootstrap, topic, starts, committed_only=False, partitions=[partition])
        # By record: the wrapped key, None once an erasure tombstoned it (kept until that erasure commits).
        self._pending: dict[str, str | None] = {record: wrapped for record, wrapped in pending.items()
                                                if wrapped is not None}

    def wrapped(self, record: str) -> str | None:
        """The wrapped key proposed under ``record``; None when it is not (or no longer) on the partition."""
        if record not in self._pending:
            for msg in self._follower.read_on([self.partition], lambda: record in self._pending):
                if (change := proposal_change(msg)) is not None:
                    self._pending[change[0]] = change[1]
        return self._pending.get(record)

    def taken(self, record: str) -> None:
        """The submission of ``record`` was handled (or its task erased) and committed, with its tombstone."""
        self._pending.pop(record, None)

    def of_task(self, task_id: str) -> list[str]:
        """The records of ``task_id``'s proposals still here: a dead-lettered submission's, kept for its replay,
        or one an erasure not known to be committed tombstoned."""
        return [record for record in self._pending if proposal_task(record) == task_id]

    def close(self) -> None:
        self._follower.close()

    def __len__(self) -> int:
        return sum(1 for wrapped in self._pending.values() if wrapped is not None)


class StrayProposals:
    """Proposed data keys on every partition of ``keys``, for a submission whose proposal is not on its task's.

    A producer that lets its client place the proposal (by its own record key, ``<task id>#<reference>``, or
    by another partitioner than murmur2) puts it anywhere. The scheduler looks here only when the task's
    own partition does not hold it: one follower over the whole topic, made at the first such look, reading
    on from where the last look stopped (read_uncommitted, as ``Proposals`` does and for the same reason).

    Only an erasure's tombstone of a proposal is heeded (``ERASED``), so a follower made afresh, reading from
    the beginning over tombstones of transactions that were aborted, finds what an aborted taking tombstoned.
    A proposal leaves memory when the transaction that took or erased it committed (``taken``).
    """

    def __init__(self, bootstrap: str, topic: str) -> None:
        self._follower = KeyFollower(bootstrap, topic, None, committed_only=False)
        # By record: its partition and wrapped key, None once an erasure tombstoned it (until that erasure commits).
        self._found: dict[str, tuple[int, str | None]] = {}

    def _read(self, done: Callable[[], bool]) -> None:
        for msg in self._follower.read_on(None, done):
            if (change := proposal_change(msg)) is not None:
                self._found[change[0]] = (msg.partition(), change[1])

    def find(self, record: str) -> tuple[int, str] | None:
        """The partition holding the proposal ``record`` and its wrapped key; None when no partition does.

        Read to the topic's end even when the proposal was found before: an erasure written since (by the
        scheduler that owned the task then) must hide it. Misses on a task's own partition are rare."""
        self._read(lambda: False)
        partition, wrapped = self._found.get(record, (-1, None))
        return None if wrapped is None else (partition, wrapped)

    def taken(self, record: str) -> None:
        """The transaction that took (or erased) ``record`` committed."""
        self._found.pop(record, None)

    def of_task(self, task_id: str) -> list[tuple[int, str]]:
        """Where the proposals of ``task_id`` are (partition, record), the topic read to its end first: a scheduler
        that erases the task tombstones every one, found by a submission of its own or not."""
        self._read(lambda: False)
        return [(partition, record) for record, (partition, _wrapped) in self._found.items()
                if proposal_task(record) == task_id]

    def close(self) -> None:
        self._follower.close()


class KeyProposer:
    """Writes submissions' proposed data keys to ``keys`` and takes the wrapped keys off the submissions.

    ``publish`` returns once the broker acknowledged every proposal: only then may the submissions go to
    ``inbox``, so the scheduler always finds the key it is told to look for. Its producer is made with the
    first proposal: a submitter of unmarked workflows never connects one.
    """

    def __init__(self, bootstrap: str, topic: str, inbox: str) -> None:
        self.bootstrap = bootstrap
        self.topic = topic
        self.inbox = inbox
        self._made: EventProducer | None = None
        self._partitions: int | None = None

    @property
    def _producer(self) -> EventProducer:
        if self._made is None:
            self._made = EventProducer(self.bootstrap)
        return self._made

    def publish(self, commands: Sequence[SubmitTask], timeout_s: float = 60.0) -> list[SubmitTask]:
        """``commands`` as they may be produced to ``inbox``: each one's wrapped key proposed and removed."""
        proposing = [c for c in commands if c.data_key is not None and c.key_ref is not None]
        for command in proposing:
            assert command.data_key is not None and command.key_ref is not None
            self._producer.send_raw(self.topic, proposal_record(command.task_id, command.key_ref),
                                    command.data_key.encode(), [PROPOSED],
                                    partition=partition_of(command.task_id, self._inbox_partitions()))
        if proposing:
            self._producer.flush(timeout_s)
        return [c.model_copy(update={"data_key": None}) if c.key_ref is not None else c for c in commands]

    def _inbox_partitions(self) -> int:
        """The partition count of ``inbox`` (the same as ``keys``'s), asked once."""
        if self._partitions is None:
            self._partitions = partition_count(self._producer.raw, self.inbox)
        return self._partitions

    def close(self) -> None:
        if self._made is not None:
            self._made.flush()
