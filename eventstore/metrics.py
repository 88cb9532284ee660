"""Prometheus metrics of the consumer runtime, shared by every service."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

CONSUMER_LAG = Gauge(
    "stepstream_consumer_lag", "Messages between this consumer's fetch position and the high watermark (a "
    "debugging aid; alert on stepstream_group_lag, which counts from the committed offset)",
    ["group", "topic", "partition"],
)
MESSAGES_PROCESSED = Counter(
    "stepstream_messages_processed_total", "Messages handled to completion", ["group", "topic"]
)
DEAD_LETTERS = Counter(
    "stepstream_dead_letters_total", "Messages sent to the DLQ", ["group", "topic", "kind"]
)
HANDLER_RETRIES = Counter(
    "stepstream_handler_retries_total", "Retries of a handler after an infrastructure fault", ["group", "topic"]
)
HANDLER_SECONDS = Histogram(
    "stepstream_handler_seconds", "Time to handle one message, retries included", ["group", "topic"],
    buckets=(0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30),
)
TRANSACTIONS_ABORTED = Counter(
    "stepstream_transactions_aborted_total", "Batches whose transaction was aborted and re-read", ["group"]
)
