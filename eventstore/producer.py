"""Producers of the event store: idempotent for plain sends, transactional for exactly-once batches."""

from __future__ import annotations

import copy
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Producer

from eventstore.errors import InfrastructureError
from eventstore.kafka_config import kafka_error, producer_config, transactional_config
from schemas.codec import Codec, default_codec
from schemas.messages import Message

Headers = list[tuple[str, bytes]]


class EventProducer:
    """Encodes messages and sends them keyed by task id, so a task's messages keep their order."""

    def __init__(self, bootstrap: str, codec: Codec | None = None, *, transactional_id: str | None = None,
                 **config: Any) -> None:
        self.codec = codec or default_codec()
        conf = (transactional_config(bootstrap, transactional_id, **config) if transactional_id
                else producer_config(bootstrap, **config))
        self._producer = Producer(conf)
        self._failures: list[KafkaError] = []
        # Per (topic, partition), one past the highest offset a send was delivered at (``delivered_ends``).
        self._delivered_end: dict[tuple[str, int], int] = {}
        self.transactional = transactional_id is not None

    def share(self) -> EventProducer:
        """Another sender over this producer's connections and batches, with delivery failures of its own.

        Several consumers of one process (the agents of an agent host) send through one librdkafka producer:
        their answers to the same inbox partition ride in one produce request instead of one each. Each keeps
        its own failures, so a ``flush`` raises only for the sender whose sends were lost: one consumer never
        stores offsets past its lost output because another's flush took the failure. (A flush still waits
        for every sender's messages in flight: milliseconds.) A transaction is one sender's, never shared.
        """
        if self.transactional:
            raise ValueError("a transactional producer is one sender's: its transaction cannot be shared")
        shared = copy.copy(self)
        shared._failures = []
        shared._delivered_end = {}
        return shared

    @property
    def raw(self) -> Producer:
        return self._producer

    def send(self, topic: str, message: Message, *, key: str | None = None, headers: Headers | None = None,
             partition: int | None = None) -> None:
        self.send_raw(topic, key if key is not None else message.task_id, self.codec.encode(message), headers,
                      partition=partition)

    def send_raw(self, topic: str, key: str | bytes | None, value: bytes | None,
                 headers: Headers | None = None, *, partition: int | None = None) -> None:
        extra = {} if partition is None else {"partition": partition}
        while True:
            try:
                self._producer.produce(topic, value=value, key=key, headers=headers, on_delivery=self._delivered,
                                       **extra)
                return
            except BufferError:
                # The local queue is full: serve delivery reports until there is room.
                self._producer.poll(0.1)

    def flush(self, timeout_s: float = 60.0) -> None:
        """Wait for every send; raise if any failed, so callers never store offsets past lost output."""
        remaining = self._producer.flush(timeout_s)
        if remaining:
            raise InfrastructureError(f"{remaining} messages not delivered within {timeout_s}s")
        if self._failures:
            failures, self._failures = self._failures, []
            raise InfrastructureError(f"delivery failed: {failures[0]} (+{len(failures) - 1} more)")

    def _delivered(self, err: KafkaError | None, msg: Any) -> None:
        if err is not None:
            self._failures.append(err)
            return
        where = (msg.topic(), msg.partition())
        self._delivered_end[where] = max(self._delivered_end.get(where, 0), msg.offset() + 1)

    def delivered_ends(self, topic: str) -> dict[int, int]:
        """Per partition of ``topic``, one past the highest offset this producer's sends were delivered at, so
        far as their delivery reports came in: after a transaction committed, where the log stood then (the
        scheduler's changelog records how far ``events`` is reflected). A commit delivers the sends but leaves
        their reports queued; they are served here."""
        self._producer.poll(0)
        return {partition: end for (name, partition), end in self._delivered_end.items() if name == topic}

    # -- transactions -------------------------------------------------------------------------

    def init_transactions(self, timeout_s: float = 30.0) -> None:
        self._producer.init_transactions(timeout_s)

    def begin(self) -> None:
        self._producer.begin_transaction()

    def commit(self, timeout_s: float = 30.0) -> None:
        self._producer.commit_transaction(timeout_s)
        self._failures.clear()

    def abort(self, timeout_s: float = 30.0) -> None:
        self._producer.abort_transaction(timeout_s)
        self._failures.clear()

    def send_offsets(self, offsets: list[Any], group_metadata: Any, timeout_s: float = 30.0) -> None:
        self._producer.send_offsets_to_transaction(offsets, group_metadata, timeout_s)


def is_fatal(exc: KafkaException) -> bool:
    """A fatal error of the client: it says so on a transactional call (``fatal()``); a produce after it only
    answers ``_FATAL``, without the flag."""
    error = kafka_error(exc)
    return error is not None and (error.fatal() or error.code() == KafkaError._FATAL)


def requires_abort(exc: KafkaException) -> bool:
    error = kafka_error(exc)
    return error is not None and error.txn_requires_abort()


def is_retriable(exc: KafkaException) -> bool:
    error = kafka_error(exc)
    return error is not None and error.retriable()
