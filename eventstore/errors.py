"""Errors of the event store and the consumer runtime.

Every error says whether retrying can help (``retryable``), because the consumer runtime decides from
that alone whether a message is poison (dead-lettered at once) or the world is briefly broken (pause
and retry, never dead-letter).
"""

from __future__ import annotations


class StepstreamError(Exception):
    """Base of every error this project raises on purpose."""

    retryable: bool = False


class BrokerError(StepstreamError):
    """The local broker could not be fetched, formatted, started or reached."""


class InfrastructureError(StepstreamError):
    """A dependency (broker, database, remote service) is unreachable: retry with back-off, never DLQ."""

    retryable = True


class KafkaUnreachable(InfrastructureError):
    """No Kafka cluster answered where the settings point (or none is configured and no local broker runs);
    the message says where it looked. One-shot commands report it in one line instead of waiting on
    librdkafka's endless reconnects."""


class PoisonMessageError(StepstreamError):
    """The message itself is wrong (undecodable, schema-invalid, contradictory): DLQ it and move on."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class RestartRequired(StepstreamError):
    """The process cannot go on, and a fresh one can: its transactional producer is fenced or broken, or a
    transaction could be neither committed nor aborted. The service exits 75 (``eventstore.stall.EXIT_STALLED``)
    for its supervisor to start it again; the new instance's ``init_transactions`` ends whatever transaction
    this one left open, and its restore reads only what was committed."""


class DrainTimeoutError(StepstreamError):
    """In-flight work did not finish within the drain timeout after SIGTERM."""


class LogReadError(StepstreamError):
    """A topic range cannot be read: no such topic or partition, or the broker refused the fetch."""
