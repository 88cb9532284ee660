"""Two of every service on a three-broker cluster through a SIGKILL of the broker that coordinates a scheduler's
transactions, and how long tasks stayed unfinished after it: the run behind tests/test_many_instances.py (its
verdict) and benchmarks/broker_kill_loop.py (its figures over many runs).

The broker killed is the transaction coordinator of one of the two schedulers (the leader of the
``__transaction_state`` partition its transactional id hashes to), found again in every run since the topic
prefix, and so the id, is new each time: the broker whose loss can leave a scheduler unable to finish a
transaction. The moment is random: once a random share of the tasks (by default a tenth to a half) ended. The
broker stays down through the rest of the run, so the failover alone must carry the tasks; the store is verified
against a replay of the log on the two brokers left (the loop starts it again before its next run).

What a run measures, from the SIGKILL: ``ended_after_kill_s``, until every task was terminal in the store, and
``moved_after_kill_s``, until every task unfinished at the kill had a new event on ``events`` (its
``occurred_at``): how long the slowest task waited for the cluster and the services to recover.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime

from confluent_kafka.admin import AdminClient

from eventstore.cluster import LocalCluster
from eventstore.topics import TopicLayout
from scheduler.service import scheduler_transactional_id
from schemas.states import TERMINAL
from tests.agreement import disagreements
from tests.kafka_helpers import wait_for
from tests.system import AGENTS, System
from tests.test_compensation_end_to_end import COMPENSATION_AGENTS

SERVICES = ("projector", "scheduler", *AGENTS, *COMPENSATION_AGENTS, "supervisor")
INSTANCES = (*SERVICES, *(f"{name}#2" for name in SERVICES))
"""Two of every service: ``#2`` names the second instance of each (tests/system.py)."""
SCHEDULERS = ("scheduler", "scheduler#2")
REFUSED_SHARE = 0.3
"""Shipments refused for good, so that some tasks compensate: of 24 tasks none does in one run in 5,000 (0.7^24)."""


def java_hash(text: str) -> int:
    """Java's ``String.hashCode`` (signed 32 bits over UTF-16 code units): how Kafka picks the partition of an
    internal topic, and so the coordinator, for a transactional id or a group id."""
    data = text.encode("utf-16-be")
    value = 0
    for i in range(0, len(data), 2):
        value = (31 * value + int.from_bytes(data[i:i + 2], "big")) & 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def coordinator_partition(key: str, partitions: int) -> int:
    """Kafka's ``Utils.abs(key.hashCode) % partitions`` (``abs`` of the smallest int is 0 there)."""
    hashed = java_hash(key)
    return (0 if hashed == -(1 << 31) else abs(hashed)) % partitions


def coordinator(admin: AdminClient, internal_topic: str, key: str) -> int:
    """The broker coordinating ``key`` (a transactional id on ``__transaction_state``, a group on
    ``__consumer_offsets``): the leader of the partition the key hashes to."""
    topic = admin.list_topics(internal_topic, timeout=30).topics[internal_topic]
    if topic.error is not None or not topic.partitions:
        raise AssertionError(f"{internal_topic} has no partitions yet: {topic.error}")
    return int(topic.partitions[coordinator_partition(key, len(topic.partitions))].leader)


def group_coordinator(admin: AdminClient, group: str) -> int:
    """The broker the cluster itself names as the group's coordinator (DescribeGroups)."""
    described = admin.describe_consumer_groups([group], request_timeout=30)[group].result()
    return int(described.coordinator.id)


def roles(system: System, broker: int) -> list[str]:
    """What ``broker`` is to this system now: whose transactions and group it coordinates, what it leads."""
    admin = AdminClient({"bootstrap.servers": system.bootstrap})
    instance = system.env["STEPSTREAM_SCHEDULER_INSTANCE"]
    found = [f"transaction coordinator of {name}" for name in SCHEDULERS
             if coordinator(admin, "__transaction_state", transactional_id(system.layout, instance, name)) == broker]
    group = system.layout.scheduler_group
    described = group_coordinator(admin, group)
    # The same hash finds the group's coordinator as the cluster names it: the transaction coordinators found
    # with it are the right brokers too.
    assert coordinator(admin, "__consumer_offsets", group) == described, "Kafka's coordinator hash, rebuilt"
    if described == broker:
        found.append("the schedulers' group coordinator")
    inbox = admin.list_topics(system.layout.inbox, timeout=30).topics[system.layout.inbox]
    led = sorted(p for p, meta in inbox.partitions.items() if meta.leader == broker)
    if led:
        found.append(f"leader of inbox partitions {led}")
    return found


def transactional_id(layout: TopicLayout, instance: str, name: str) -> str:
    """The transactional id of the scheduler process ``name`` (``scheduler#2`` runs as ``<instance>-2``)."""
    _service, _, copy = name.partition("#")
    return scheduler_transactional_id(layout, f"{instance}-{copy}" if copy else instance)


@dataclass
class KillRun:
    """How one run through a broker's SIGKILL went."""

    statuses: dict[str, str]
    wrong: dict[str, str]
    """Tasks whose end disagrees with the order service's records, and why."""
    killed: int
    killed_roles: list[str]
    unfinished_at_kill: int
    ended_after_kill_s: float | None
    """From the SIGKILL until every task was terminal in the store; None if some never was within the patience."""
    moved_after_kill_s: float
    """From the SIGKILL until every task unfinished at it had a new event on ``events``."""
    verified: str
    """``stepstream projections verify``'s outcome: "equal", else its output."""
    stall_restarts: list[tuple[str, str]] = field(default_factory=list)
    exits: dict[str, int | None] = field(default_factory=dict)
    """Services that ended on their own and were not started again (name: exit code)."""
    seconds: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds from the run's start at which each phase ended: services started, broker killed, every task ended,
    ends judged against the service's records, store verified."""

    @property
    def outcomes(self) -> Counter[str]:
        return Counter(self.statuses.values())

    def figures(self) -> dict[str, object]:
        """The run in one JSON-ready mapping (the benchmark prints one per run)."""
        return {"killed": self.killed, "roles": self.killed_roles, "unfinished_at_kill": self.unfinished_at_kill,
                "ended_after_kill_s": self.ended_after_kill_s, "moved_after_kill_s": round(self.moved_after_kill_s, 2),
                "outcomes": dict(self.outcomes), "disagreeing": len(self.wrong), "verified": self.verified == "equal",
                "stall_restarts": [name for name, _said in self.stall_restarts], "exits": self.exits,
                "seconds": round(self.seconds, 1), "phases": self.phases}


def run_through_kill(system: System, cluster: LocalCluster, *, tasks: int, rng: random.Random,
                     patience_s: float, kill_between: tuple[float, float] = (0.1, 0.5)) -> KillRun:
    """Start two of every service, submit ``tasks`` orders, SIGKILL a scheduler's transaction coordinator once a
    random share of them (drawn from ``kill_between``) ended, wait up to ``patience_s`` for every task to end,
    and judge: each end against the order service's records, the store against a replay of the log. The broker
    is left down."""
    began = time.monotonic()
    system.admin.set_faults(error_rate=0.05)
    system.admin.set_faults("shipping/create", error_rate=0.05, permanent_error_rate=REFUSED_SHARE)
    # Eighteen processes importing at once: at a load average of 36 a projector took over 60 s to start.
    system.start(*INSTANCES, timeout_s=180)
    phases = {"started": time.monotonic() - began}
    ids = [f"kill-{i:04d}" for i in range(tasks)]
    for task_id in ids:
        system.submit(task_id, workflow="orders-chaos")

    def ended() -> set[str]:
        return {t for t, s in system.statuses().items() if s in TERMINAL}

    moment = max(1, round(tasks * rng.uniform(*kill_between)))
    if not wait_for(lambda: len(ended()) >= moment, timeout_s=patience_s, interval_s=0.5):
        raise AssertionError(f"{len(ended())} of {tasks} tasks ended before the kill\n{system.logs_tail()}")
    instance = system.env["STEPSTREAM_SCHEDULER_INSTANCE"]
    admin = AdminClient({"bootstrap.servers": system.bootstrap})
    chosen = transactional_id(system.layout, instance, rng.choice(SCHEDULERS))
    target = coordinator(admin, "__transaction_state", chosen)
    killed_roles = roles(system, target)
    unfinished = set(ids) - ended()
    killed_at, killed_wall = time.monotonic(), datetime.now(UTC)
    cluster.node(target).kill()
    phases["killed"] = killed_at - began

    all_ended = wait_for(lambda: ended() >= set(ids), timeout_s=patience_s, interval_s=0.25)
    ended_after = time.monotonic() - killed_at if all_ended else None
    phases["ended"] = time.monotonic() - began
    statuses = {t: s for t, s in system.statuses().items() if t in ids}
    statuses.update({t: "unknown" for t in ids if t not in statuses})
    time.sleep(2.0)  # longer than a call timeout: every call still on its way has landed or been refused
    ended_ids = [t for t in ids if statuses[t] in TERMINAL]
    wrong = disagreements(system, statuses, ended_ids)
    wrong.update({t: f"not ended: {s}" for t, s in statuses.items() if s not in TERMINAL})
    moved = _moved_after(system, unfinished, killed_wall, statuses)
    phases["judged"] = time.monotonic() - began
    verify = system.cli("projections", "verify", "--no-progress")
    phases["verified"] = time.monotonic() - began
    verified = "equal" if verify.returncode == 0 else (verify.stdout + verify.stderr)[-2000:]
    exits = {name: proc.returncode for name, proc in system.procs.procs.items() if proc.poll() is not None}
    return KillRun(statuses=statuses, wrong=wrong, killed=target, killed_roles=killed_roles,
                   unfinished_at_kill=len(unfinished), ended_after_kill_s=None if ended_after is None
                   else round(ended_after, 2), moved_after_kill_s=moved, verified=verified,
                   stall_restarts=list(system.stall_restarts), exits=exits, seconds=time.monotonic() - began,
                   phases={name: round(at, 1) for name, at in phases.items()})


def _moved_after(system: System, unfinished: set[str], killed: datetime, statuses: dict[str, str]) -> float:
    """Seconds from ``killed`` until the last of ``unfinished`` had an event after it; ``inf`` if one that is not
    terminal never had one. (A task may have ended on the log before the kill while the store did not show it
    yet: no event after the kill is due for it.)"""
    first: dict[str, datetime] = {}
    for event in system.events():
        if event.task_id in unfinished and event.occurred_at >= killed and event.task_id not in first:
            first[event.task_id] = event.occurred_at
    if any(statuses[t] not in TERMINAL for t in unfinished - set(first)):
        return float("inf")
    return max(((when - killed).total_seconds() for when in first.values()), default=0.0)
