"""Where a replay ends, while a partition's leadership moves between brokers."""

from __future__ import annotations

from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition

from eventstore.replay import watermarks


class MovingLeader:
    """A consumer whose watermark queries first reach the partition's former leader."""

    def __init__(self, *errors: int) -> None:
        self.errors = list(errors)
        self.queries = 0

    def get_watermark_offsets(self, _tp: TopicPartition, timeout: float) -> tuple[int, int]:
        self.queries += 1
        if self.errors:
            raise KafkaException(KafkaError(self.errors.pop(0)))
        return 3, 120


def test_the_watermarks_are_asked_again_while_the_partition_leader_moves_and_read_from_the_new_one() -> None:
    consumer = MovingLeader(KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE)
    assert watermarks(consumer, TopicPartition("events", 0)) == (3, 120)
    assert consumer.queries == 3


@pytest.mark.parametrize(("error", "timeout_s"), [(KafkaError.TOPIC_AUTHORIZATION_FAILED, 30.0),
                                                  (KafkaError.NOT_LEADER_FOR_PARTITION, 0.0)])
def test_any_other_error_or_one_that_outlasts_the_timeout_is_raised(error: int, timeout_s: float) -> None:
    consumer: Any = MovingLeader(*[error] * 10)
    with pytest.raises(KafkaException):
        watermarks(consumer, TopicPartition("events", 0), timeout_s=timeout_s)
