"""A record on an inbox partition that does not own its task (a producer with librdkafka's default
partitioner) is moved as it is to the partition that does, decided only there, and counted: the pure parts,
without a broker. ``tests/test_foreign_producers.py`` runs it against a real system."""

from __future__ import annotations

import zlib

from confluent_kafka import TopicPartition
from prometheus_client import REGISTRY as METRICS

from eventstore.keys import Proposals, StrayProposals
from eventstore.partitioning import partition_of
from eventstore.runtime import Record
from eventstore.topics import TopicLayout
from scheduler.decider import Limits
from scheduler.placement import MOVED_FROM, MisplacedRecords, owner_elsewhere
from scheduler.service import Scheduler
from schemas.codec import default_codec
from schemas.messages import SubmitTask
from tests.fakes import RecordingOutput
from tests.workflows import REGISTRY

PARTITIONS = 6


def crc32_partition(key: str, partitions: int) -> int:
    """Where librdkafka's default partitioner (``consistent_random``) puts a keyed record."""
    return zlib.crc32(key.encode()) % partitions


def astray(count: int) -> list[str]:
    """Task ids that librdkafka's default partitioner puts elsewhere than murmur2 does."""
    ids = (f"order-{n}" for n in range(1000))
    return [t for t in ids if crc32_partition(t, PARTITIONS) != partition_of(t, PARTITIONS)][:count]


def test_a_task_on_its_own_partition_stays_and_one_placed_by_crc32_belongs_to_its_murmur2_partition() -> None:
    task = astray(1)[0]
    assert owner_elsewhere(task, partition_of(task, PARTITIONS), PARTITIONS) is None
    assert owner_elsewhere(task, crc32_partition(task, PARTITIONS), PARTITIONS) == partition_of(task, PARTITIONS)


def test_a_submission_on_a_partition_not_owning_its_task_is_moved_whole_and_nothing_is_decided_for_it() -> None:
    layout = TopicLayout(prefix="placement.", partitions=PARTITIONS)
    made = Scheduler(bootstrap="127.0.0.1:9", layout=layout, registry=REGISTRY, limits=Limits())
    task = astray(1)[0]
    command = SubmitTask(task_id=task, workflow="orders", workflow_version=1,
                         input={"order_id": task, "sku": "A-1", "qty": 1, "amount": 10})
    value = default_codec().encode(command)
    landed, owner = crc32_partition(task, PARTITIONS), partition_of(task, PARTITIONS)
    output = RecordingOutput()
    before = METRICS.get_sample_value("stepstream_scheduler_misplaced_records_total", {"topic": "inbox"}) or 0

    made.handle(Record(layout.inbox, landed, 17, task, command, [("traceparent", b"00-ab")], value),
                output)  # type: ignore[arg-type]

    assert output.raw == [(layout.inbox, task, value, [("traceparent", b"00-ab"),
                                                       (MOVED_FROM, f"{layout.inbox}[{landed}]@17".encode())], owner)]
    assert output.sent == [], "no event, request or status for it where it landed"
    assert made.in_flight(landed) == 0 and task not in made._tasks.get(landed, {})
    made.committed()
    after = METRICS.get_sample_value("stepstream_scheduler_misplaced_records_total", {"topic": "inbox"})
    assert after == before + 1


def test_moved_records_are_counted_when_their_batch_commits_and_logged_in_aggregate_at_most_every_interval() -> None:
    now = [100.0]
    tally = MisplacedRecords(every_s=30.0, clock=lambda: now[0])
    tally.add("inbox", 3, 1)
    tally.aborted()
    assert tally.committed() is None, "an aborted batch's records come again and are counted then"

    tally.add("inbox", 3, 1)
    tally.add("inbox", 3, 1)
    tally.add("keys", 0, 1)
    assert tally.committed() == {"inbox 3->1": 2, "keys 0->1": 1}, "the first ones are told at once"
    tally.add("inbox", 2, 5)
    now[0] += 10
    assert tally.committed() is None, "within the interval: kept for the next report"
    tally.add("inbox", 2, 5)
    now[0] += 25
    assert tally.committed() == {"inbox 2->5": 2}
    now[0] += 60
    assert tally.committed() is None, "nothing new, nothing logged"


def test_the_follower_of_stray_proposals_closes_when_the_scheduler_owns_no_partition_any_more() -> None:
    layout = TopicLayout(prefix="placement.", partitions=PARTITIONS)
    made = Scheduler(bootstrap="127.0.0.1:9", layout=layout, registry=REGISTRY, limits=Limits())
    made._proposals = {p: Proposals("127.0.0.1:9", layout.keys, p, {}, {}) for p in (0, 1)}
    made._strays = StrayProposals("127.0.0.1:9", layout.keys)

    made.forget([TopicPartition(layout.inbox, 0)])
    assert made._strays is not None, "partition 1 is still owned: its submissions may need the follower"
    made.forget([TopicPartition(layout.inbox, 1)])
    assert made._strays is None, "nothing owned: the follower of the whole topic is closed, not left open"
