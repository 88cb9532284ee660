"""``eventstore.partitioning`` computes Kafka's murmur2 partitioner (the producers' ``murmur2_random``): the
same vectors as Kafka's own test of ``Utils.murmur2``. ``tests/test_keys_topic.py`` checks it against where
the broker put records."""

from __future__ import annotations

import ctypes

import pytest

from eventstore.partitioning import murmur2, partition_of


@pytest.mark.parametrize(("key", "java_int"), [
    ("21", -973932308), ("foobar", -790332482), ("a-little-bit-long-string", -985981536),
    ("a-little-bit-longer-string", -1486304829), ("lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8", -58897971),
    ("abc", 479470107),
])
def test_murmur2_matches_kafkas_java_hash(key: str, java_int: int) -> None:
    assert ctypes.c_int32(murmur2(key.encode())).value == java_int


def test_a_partition_is_the_positive_hash_modulo_the_count_and_a_topic_needs_a_partition() -> None:
    assert partition_of("foobar", 7) == (-790332482 & 0x7FFFFFFF) % 7
    with pytest.raises(ValueError, match="partitions"):
        partition_of("foobar", 0)
