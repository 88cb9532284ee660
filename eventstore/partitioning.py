"""The partition a keyed record lands on, computed as the producers compute it.

Every producer here uses ``murmur2_random`` (``eventstore.kafka_config``): Kafka's Java partitioner,
``murmur2(key) & 0x7fffffff`` modulo the partition count. A submitter needs the number before it
produces: it writes a task's proposed data key to ``keys`` under a record key of its own, on the partition
where the task's inbox records (keyed by task id) land, which is the ``keys`` partition the scheduler
owning the task reads.
"""

from __future__ import annotations

_SEED = 0x9747B28C
_M = 0x5BD1E995
_MASK = 0xFFFFFFFF


def murmur2(data: bytes) -> int:
    """Kafka's murmur2 hash of ``data`` (``org.apache.kafka.common.utils.Utils.murmur2``), unsigned."""
    length = len(data)
    h = (_SEED ^ length) & _MASK
    whole = length - length % 4
    for i in range(0, whole, 4):
        k = int.from_bytes(data[i:i + 4], "little")
        k = (k * _M) & _MASK
        k ^= k >> 24
        k = (k * _M) & _MASK
        h = ((h * _M) & _MASK) ^ k
    tail = data[whole:]
    if len(tail) == 3:
        h ^= tail[2] << 16
    if len(tail) >= 2:
        h ^= tail[1] << 8
    if tail:
        h ^= tail[0]
        h = (h * _M) & _MASK
    h ^= h >> 13
    h = (h * _M) & _MASK
    h ^= h >> 15
    return h


def partition_of(key: str, partitions: int) -> int:
    """The partition a record keyed ``key`` goes to on a topic of ``partitions`` partitions."""
    if partitions < 1:
        raise ValueError(f"partitions: a topic has at least one, not {partitions}")
    return (murmur2(key.encode()) & 0x7FFFFFFF) % partitions
