"""The DLQ topic of one deployment as operators work with it: every dead letter with the replays recorded
for it, one fetched by its place, and a replay after a fix.

A replay re-publishes the original key, value and headers to the origin topic and partition with the
idempotent producer, then records itself on the DLQ topic: a marker record (no value) in the dead letter's own
partition whose headers name the dead letter and where its copy landed. The record of what was replayed is
therefore on the log, in order after the dead letter, for these functions (a second replay of the same dead
letter needs ``force``) and for the projector's ``dlq_entries`` table alike.

A dead-lettered submission with sealed input names the data key its submitter proposed on ``keys``; the
scheduler keeps that proposal while the submission is a dead letter, so its replay opens it. One whose
proposal is gone (taken by an earlier replay, or dead-lettered because it never came) is not replayed: it
would only be dead-lettered again, and the outcome says why.

A dead letter that will never be replayed is discarded: its proposed data key, if it kept one, is tombstoned
on ``keys`` (once compacted, nothing can open its sealed input: crypto-shredded), then a discard marker is
recorded like a replay's. A discarded dead letter is never replayed, ``force`` or not. The tombstone goes
first: a discard cut short between the two leaves a dead letter whose key is gone, which a replay refuses
already and a second discard marks.

The log is read with ``eventstore.replay.LogRange`` (raw records, headers included); the record model
(``DeadLetter``) is ``eventstore.dlq``'s. ``stepstream dlq`` (``stepstream.cli.dlq``) shows what these return.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from confluent_kafka import KafkaError, Producer
from confluent_kafka import Message as KafkaMessage

from eventstore.dlq import (
    DISCARD_OF,
    DISCARD_SHREDDED,
    DISCARD_TIME,
    HEADER_PREFIX,
    REPLAY_OF,
    REPLAY_TIME,
    REPLAY_TO,
    REPLAYED_FROM_HEADER,
    DeadLetter,
)
from eventstore.errors import LogReadError, StepstreamError
from eventstore.kafka_config import producer_config
from eventstore.keys import ERASED, PROPOSED, KeyRecords, proposal_record, read_key_records
from eventstore.replay import LogRange
from schemas.codec import Codec, default_codec
from schemas.errors import DecodeError
from schemas.messages import SubmitTask


class DlqToolError(StepstreamError):
    """A request the tools cannot serve; the message names the argument or the record at fault."""


@dataclass
class DlqEntry:
    """A dead letter, the replays recorded for it, and its discard if it was discarded."""

    letter: DeadLetter
    replays: list[dict[str, str]] = field(default_factory=list)
    discarded: dict[str, str] | None = None

    def as_json(self) -> dict[str, Any]:
        return {**self.letter.summary(), "replays": self.replays, "discarded": self.discarded}

    @property
    def waiting(self) -> bool:
        """Neither replayed nor discarded: an operator's decision is still to come."""
        return not self.replays and self.discarded is None


class DeadLetters:
    """The DLQ topic of one deployment, as the operators' tools see it."""

    def __init__(self, bootstrap: str, topic: str, keys_topic: str, codec: Codec | None = None) -> None:
        self.bootstrap = bootstrap
        self.topic = topic
        self.keys_topic = keys_topic  # where sealed submissions' proposed data keys are
        self.codec = codec or default_codec()

    def entries(self) -> list[DlqEntry]:
        """Every dead letter, oldest first per partition, with the replays recorded for it."""
        found: dict[tuple[int, int], DlqEntry] = {}
        for msg in LogRange(self.bootstrap, self.topic):
            letter = DeadLetter.from_message(msg)
            info, marker = letter.info, f"{letter.partition}:{letter.offset}"
            if not letter.is_marker:
                found[(letter.partition, letter.offset)] = DlqEntry(letter)
            elif (target := letter.replay_of) in found:
                found[target].replays.append({"to": info.get(REPLAY_TO, "?"), "time": info.get(REPLAY_TIME, "?"),
                                              "marker": marker})
            elif (target := letter.discard_of) in found and found[target].discarded is None:
                found[target].discarded = {"time": info.get(DISCARD_TIME, "?"),
                                           "shredded": info.get(DISCARD_SHREDDED, ""), "marker": marker}
        return list(found.values())

    def fetch(self, partition: int, offset: int) -> DeadLetter:
        """One dead letter by position; a clear error when there is none there."""
        try:
            reader = LogRange(self.bootstrap, self.topic, partitions=[partition], starts={partition: offset},
                              ends={partition: offset + 1})
        except LogReadError as exc:
            raise DlqToolError(f"ENTRY {partition}:{offset}: {exc}") from exc
        low, high = reader.watermarks[partition]
        found = [DeadLetter.from_message(m) for m in reader if m.offset() == offset]
        if not found:
            held = f"offsets {low}-{high - 1}" if high > low else "no records"
            raise DlqToolError(f"ENTRY {partition}:{offset}: no record there ({self.topic}[{partition}] holds {held})")
        if found[0].is_marker:
            raise DlqToolError(f"ENTRY {partition}:{offset} is a replay or discard marker, not a dead letter")
        return found[0]

    def _chosen(self, chosen: list[tuple[int, int]]) -> list[DlqEntry]:
        """The dead letters at the chosen places, in that order; a clear error for a place that holds none."""
        entries = {(e.letter.partition, e.letter.offset): e for e in self.entries()}
        found = []
        for partition, offset in chosen:
            entry = entries.get((partition, offset))
            if entry is None:
                self.fetch(partition, offset)  # raises the precise error: no such partition, offset or marker
                raise DlqToolError(f"ENTRY {partition}:{offset}: not a dead letter")
            found.append(entry)
        return found

    def replay(self, chosen: list[tuple[int, int]], *, force: bool = False,
               dry_run: bool = False) -> list[dict[str, Any]]:
        """Re-publish the chosen dead letters to their origin, each once unless ``force``; record each. A
        discarded one is never replayed."""
        plan: list[tuple[DlqEntry, str | None]] = []
        for entry in self._chosen(chosen):
            if entry.letter.origin is None:
                raise DlqToolError(f"ENTRY {entry.letter.partition}:{entry.letter.offset}: has no "
                                   "origin.topic/partition headers")
            skip = (f"discarded at {entry.discarded['time']}: a discarded dead letter is never replayed"
                    if entry.discarded is not None else
                    "already replayed (use --force to replay again)" if entry.replays and not force else None)
            plan.append((entry, skip))
        unopenable = self._unopenable([entry.letter for entry, skip in plan if skip is None])
        plan = [(entry, skip or unopenable.get((entry.letter.partition, entry.letter.offset))) for entry, skip in plan]
        outcomes = [{**entry.letter.summary(), "replayed_to": None, "skipped": skip or ("dry run" if dry_run else None)}
                    for entry, skip in plan]
        todo = [(i, entry) for i, (entry, skip) in enumerate(plan) if skip is None and not dry_run]
        if not todo:
            return outcomes
        # Idempotent (no duplicate from a retried send); every delivery reported: its offset is recorded.
        producer = Producer(producer_config(self.bootstrap, **{"delivery.report.only.error": False}))
        landed: dict[int, str] = {}
        failures: list[str] = []

        def delivered(index: int) -> Any:
            def callback(err: KafkaError | None, msg: KafkaMessage) -> None:
                if err is not None:
                    failures.append(str(err))
                else:
                    landed[index] = f"{msg.topic()}[{msg.partition()}]@{msg.offset()}"
            return callback

        for index, entry in todo:
            letter = entry.letter
            topic, partition, _offset = letter.origin  # type: ignore[misc]  # checked above
            headers = [(k, v) for k, v in letter.headers if not k.startswith(HEADER_PREFIX)
                       and k != REPLAYED_FROM_HEADER]
            headers.append((REPLAYED_FROM_HEADER, f"{self.topic}[{letter.partition}]@{letter.offset}".encode()))
            producer.produce(topic, value=letter.value, key=letter.key, headers=headers, partition=partition,
                             on_delivery=delivered(index))
        producer.flush(60)
        if failures:
            raise DlqToolError(f"replay not delivered: {failures[0]}")
        now = datetime.now(UTC).isoformat(timespec="milliseconds")
        for index, entry in todo:
            letter = entry.letter
            marker = [(HEADER_PREFIX + REPLAY_OF, f"{letter.partition}:{letter.offset}".encode()),
                      (HEADER_PREFIX + REPLAY_TO, landed[index].encode()),
                      (HEADER_PREFIX + REPLAY_TIME, now.encode())]
            producer.produce(self.topic, value=None, key=letter.key, headers=marker, partition=letter.partition)
            outcomes[index]["replayed_to"] = landed[index]
        producer.flush(60)
        return outcomes

    def discard(self, chosen: list[tuple[int, int]], *, dry_run: bool = False) -> list[dict[str, Any]]:
        """Give up the chosen dead letters for good: tombstone the data key each sealed submission among them
        kept on ``keys``, then record each discard. One replayed already, or discarded already, is skipped
        (a replayed submission's copy may be a dead letter of its own that still needs that key)."""
        plan = [(entry, "already discarded" if entry.discarded is not None else
                 "already replayed: its copy went to its origin (discard that copy's dead letter, if it is one)"
                 if entry.replays else None) for entry in self._chosen(chosen)]
        todo = [entry.letter for entry, skip in plan if skip is None]
        named, records = self._proposals(todo)
        # Only a key still there is tombstoned: one taken or erased already has nothing left to shred.
        shredded = {where: record for where, record in named.items() if records.proposals.get(record) is not None}
        outcomes = [{**entry.letter.summary(), "discarded": skip is None and not dry_run,
                     "shredded": shredded.get((entry.letter.partition, entry.letter.offset)) if skip is None else None,
                     "skipped": skip or ("dry run" if dry_run else None)} for entry, skip in plan]
        if not todo or dry_run:
            return outcomes
        producer = Producer(producer_config(self.bootstrap))
        failures: list[str] = []

        def report(err: KafkaError | None, _msg: KafkaMessage) -> None:
            if err is not None:
                failures.append(str(err))

        def sent(what: str) -> None:
            """Every record produced so far delivered (a flush reports a failed one only to its callback)."""
            if producer.flush(60) or failures:
                raise DlqToolError(f"discard not done: {what} not delivered: {failures[0] if failures else 'timeout'}")

        for record in shredded.values():  # an erasure's tombstone: a scheduler holding the proposal forgets it too
            producer.produce(self.keys_topic, key=record, value=None, headers=[PROPOSED, ERASED],
                             partition=records.proposed_on[record], on_delivery=report)
        sent("the tombstones of the proposed data keys")
        now = datetime.now(UTC).isoformat(timespec="milliseconds")
        for letter in todo:
            marker = [(HEADER_PREFIX + DISCARD_OF, f"{letter.partition}:{letter.offset}".encode()),
                      (HEADER_PREFIX + DISCARD_TIME, now.encode()),
                      (HEADER_PREFIX + DISCARD_SHREDDED, shredded.get((letter.partition, letter.offset), "").encode())]
            producer.produce(self.topic, value=None, key=letter.key, headers=marker, partition=letter.partition,
                             on_delivery=report)
        sent("the markers (the data keys are gone: discard again to record it)")
        return outcomes

    def _proposals(self, letters: list[DeadLetter]) -> tuple[dict[tuple[int, int], str], KeyRecords]:
        """The proposal record each of these dead-lettered submissions with sealed input names (by place), and
        what ``keys`` holds now (read only when one names a proposal)."""
        named: dict[tuple[int, int], str] = {}
        for letter in letters:
            try:
                message = self.codec.decode(letter.value) if letter.value is not None else None
            except DecodeError:
                continue
            if isinstance(message, SubmitTask) and message.key_ref is not None:
                named[(letter.partition, letter.offset)] = proposal_record(message.task_id, message.key_ref)
        if not named:
            return {}, KeyRecords()
        return named, read_key_records(self.bootstrap, self.keys_topic, {})

    def _unopenable(self, letters: list[DeadLetter]) -> dict[tuple[int, int], str]:
        """Why each of these dead-lettered submissions with sealed input cannot be opened any more (by place):
        the data key it names is no longer proposed on ``keys``."""
        named, records = self._proposals(letters)
        return {where: f"its sealed input was sealed with the data key proposed as {record!r}, which is no longer "
                       f"on {self.keys_topic}: replayed, it would be dead-lettered again; submit the task again "
                       "from its source instead"
                for where, record in named.items() if records.proposals.get(record) is None}
