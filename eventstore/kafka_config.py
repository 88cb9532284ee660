"""librdkafka configurations for each role, in one place so every service behaves alike."""

from __future__ import annotations

from typing import Any

from confluent_kafka import KafkaError
from pydantic import ValidationError

from eventstore.errors import KafkaUnreachable, StepstreamError
from eventstore.kafka_settings import ConsumerSettings, KafkaSecuritySettings


class KafkaSecurityError(StepstreamError, ValueError):
    """The ``STEPSTREAM_KAFKA_*`` settings are incomplete or contradict each other; the message names them."""


def connection_config(bootstrap: str, security: KafkaSecuritySettings | None = None) -> dict[str, Any]:
    """Where the cluster is and how to authenticate: the base of every Kafka client the product builds.

    The security settings come from ``STEPSTREAM_KAFKA_*`` (read at each call, so every client of a process
    sees the same environment); a missing or contradictory one raises KafkaSecurityError naming the variable.
    """
    if security is None:
        try:
            security = KafkaSecuritySettings()
        except ValidationError as exc:
            problems = "; ".join(
                (f"STEPSTREAM_KAFKA_{str(error['loc'][0]).upper()}: " if error["loc"] else "")
                + str(error["msg"]).removeprefix("Value error, ") for error in exc.errors())
            raise KafkaSecurityError(f"Kafka security settings: {problems}") from None
    return {"bootstrap.servers": bootstrap, **security.client_config()}


def check_reachable(bootstrap: str, timeout_s: float, where: str) -> None:
    """Raise KafkaUnreachable unless the cluster at ``bootstrap`` answers a metadata request in time.

    The probe logs nothing (librdkafka would print a line per failed connection attempt); its one error
    says where the address came from (``where``), so a wrong setting is found at once.
    """
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({**connection_config(bootstrap), "log_level": 0})
    try:
        admin.list_topics(timeout=timeout_s)
    except KafkaException as exc:
        raise KafkaUnreachable(f"no Kafka cluster answered at {bootstrap} ({where}) within {timeout_s:g}s: "
                               f"{kafka_reason(exc)}") from None


def kafka_error(exc: Exception) -> KafkaError | None:
    """The KafkaError a KafkaException carries (librdkafka's code and flags); None for any other exception."""
    error = exc.args[0] if exc.args else None
    return error if isinstance(error, KafkaError) else None


def kafka_reason(exc: Exception) -> str:
    """The librdkafka error's own words (a KafkaException carries a KafkaError), else the exception's."""
    error: Any = exc.args[0] if exc.args else None
    return str(error.str()) if hasattr(error, "str") else str(exc)


def producer_config(bootstrap: str, **extra: Any) -> dict[str, Any]:
    """Idempotent, acks=all: a retried send never duplicates or reorders within a partition.

    murmur2 is the Java client's partitioner: a task id lands on the same partition whichever client
    (Python, Java, Kafka Connect) produced it, so inbox commands and events of a task stay together.
    """
    return {
        **connection_config(bootstrap),
        "partitioner": "murmur2_random",
        "enable.idempotence": True,
        "acks": "all",
        "linger.ms": 5,
        "compression.type": "lz4",
        "delivery.report.only.error": True,  # the delivery callback only collects failures
        **extra,
    }


TRANSACTION_LINGER_MS = 100
"""How long a transactional producer's records wait to be sent together before the commit sends them."""


def transactional_config(bootstrap: str, transactional_id: str, **extra: Any) -> dict[str, Any]:
    # A transaction left open (its producer hung or dead) holds back every read_committed reader of the
    # partitions it wrote until its coordinator aborts it: 10 s (ConsumerSettings.transaction_timeout_s), not
    # librdkafka's 60 s. librdkafka derives message.timeout.ms and socket.timeout.ms from it.
    # The broker often answers CONCURRENT_TRANSACTIONS right after a commit; librdkafka's default 100 ms
    # back-off before retrying then stalls every batch. 10 ms halves the commit time on a local broker.
    # Every delivery is reported: where a committed transaction's records landed is how far the scheduler's
    # changelog reflects ``events`` (``EventProducer.delivered_ends``).
    # A transaction's records are read (read_committed) only once it commits, and the commit sends whatever
    # still lingers at once: lingering within the transaction delays no reader. 5 ms (``producer_config``)
    # sent a burst's half-second transactions in a hundred small produce requests each.
    return producer_config(bootstrap, **{"transactional.id": transactional_id,
                                          "transaction.timeout.ms": 10000, "retry.backoff.ms": 10,
                                          "linger.ms": TRANSACTION_LINGER_MS,
                                          "delivery.report.only.error": False, **extra})


def consumer_config(bootstrap: str, group_id: str, settings: ConsumerSettings, **extra: Any) -> dict[str, Any]:
    """Offsets are stored by the runtime only after the work for a message is done."""
    return {
        **connection_config(bootstrap),
        "group.id": group_id,
        "enable.auto.commit": True,
        "enable.auto.offset.store": False,
        "auto.commit.interval.ms": settings.commit_interval_ms,
        "auto.offset.reset": "earliest",
        "isolation.level": "read_committed",
        "session.timeout.ms": settings.session_timeout_ms,
        "heartbeat.interval.ms": max(100, settings.session_timeout_ms // 4),
        **extra,
    }


def consume_available(consumer: Any, max_messages: int, timeout_s: float) -> list[Any]:
    """Whatever is ready now, up to ``max_messages``; waits up to ``timeout_s`` only when nothing is.

    librdkafka's ``consume(n, timeout)`` waits for ``n`` messages or the whole timeout, which adds the
    poll timeout to every hop of a lightly loaded pipeline and stalls the end of a replay.
    """
    batch: list[Any] = consumer.consume(max_messages, 0)
    if batch:
        return batch
    batch = consumer.consume(1, timeout_s)
    if batch and max_messages > 1:
        batch.extend(consumer.consume(max_messages - 1, 0))
    return batch
