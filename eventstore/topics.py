"""The topic layout and the consumer groups that read it, declared once; topics created idempotently.

``inbox`` and ``events`` share a partition count so that a task's commands and its history live on the
same partition number: the scheduler owning inbox partition p restores state from events partition p.

Group ids are named here, beside the topics, because they are part of the deployment's contract as much as
topic names: ACLs grant them (docs/acls.md), the lag report finds a deployment's groups by the prefix, and
a renamed group silently restarts its consumers from their reset position.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from confluent_kafka import KafkaError, KafkaException, Producer
from confluent_kafka.admin import AdminClient, NewTopic

from eventstore.broker import min_insync_replicas
from eventstore.errors import InfrastructureError
from eventstore.settings import KafkaSettings

FOREVER = "-1"


@dataclass(frozen=True)
class TopicSpec:
    name: str
    partitions: int
    config: dict[str, str] = field(default_factory=dict)


KEYS_SEGMENT_MS = 10 * 60 * 1000
"""How soon an erased data key leaves the disk of ``keys``: compaction never touches the active segment,
so a superseded record goes once the segment holding the erasure's tombstone has rolled (``segment.ms``,
checked when the next record is appended) and the log cleaner has run (``max.compaction.lag.ms`` makes the
partition due however little of it is dirty; the broker's ``log.cleaner.backoff.ms``, 15 s by default, is
its pause between runs). Ten minutes each: an erased key is gone from disk within about twenty minutes of
the erasure on a partition that takes writes (``tests/test_keys_topic.py`` shows it with a short window).
Small segments cost little here: the topic holds one short record per live task."""


@dataclass(frozen=True)
class TopicLayout:
    """Names of every topic of one deployment (one prefix)."""

    prefix: str
    partitions: int
    replication_factor: int = 1

    @classmethod
    def from_settings(cls, settings: KafkaSettings) -> TopicLayout:
        return cls(settings.topic_prefix, settings.partitions, settings.replication_factor)

    @property
    def inbox(self) -> str:
        return f"{self.prefix}inbox"

    @property
    def events(self) -> str:
        return f"{self.prefix}events"

    @property
    def dlq(self) -> str:
        return f"{self.prefix}dlq"

    @property
    def keys(self) -> str:
        """Each task's data key, wrapped by a master key; compacted, so an erased key leaves the log."""
        return f"{self.prefix}keys"

    @property
    def scheduler_state(self) -> str:
        """The scheduler's changelog of task state: one record per task after compaction (``scheduler.changelog``)."""
        return f"{self.prefix}scheduler-state"

    @property
    def workflows(self) -> str:
        """The workflow versions each running scheduler accepts, one record per scheduler (``scheduler.offers``)."""
        return f"{self.prefix}workflows"

    def workflows_spec(self) -> TopicSpec:
        """One partition, compacted: read whole by every submitter, a few records long."""
        return TopicSpec(self.workflows, 1, {"cleanup.policy": "compact", "min.compaction.lag.ms": "0",
                                             "delete.retention.ms": str(24 * 3600 * 1000)})

    @property
    def supervisor_lease(self) -> str:
        return f"{self.prefix}supervisor-lease"

    @property
    def dependencies(self) -> str:
        """Each agent process's report on the dependencies it calls (``agents.reporting``), read by the API;
        compacted: the last report of each agent, dependency and process."""
        return f"{self.prefix}dependencies"

    def agent(self, name: str) -> str:
        return f"{self.prefix}agent.{name}"

    def status(self, submitter: str) -> str:
        return f"{self.prefix}status.{submitter}"

    def core_specs(self) -> list[TopicSpec]:
        # The event store keeps everything: no deletion by time or size, and never compacted.
        event_store = {"cleanup.policy": "delete", "retention.ms": FOREVER, "retention.bytes": FOREVER}
        return [
            TopicSpec(self.inbox, self.partitions, {"retention.ms": str(7 * 24 * 3600 * 1000)}),
            TopicSpec(self.events, self.partitions, event_store),
            TopicSpec(self.dlq, self.partitions, {"retention.ms": FOREVER}),
            TopicSpec(self.supervisor_lease, 1),
            self.keys_spec(),
            self.scheduler_state_spec(),
            self.dependencies_spec(),
            self.workflows_spec(),
        ]

    def keys_spec(self, segment_ms: int | None = None) -> TopicSpec:
        """Compacted, and soon: see ``KEYS_SEGMENT_MS``; the tombstone itself, which holds no key, stays a
        day so a reader a day behind still learns of the erasure. Same partition count as inbox: a task's
        key and the keys proposed for it sit beside its events. ``segment_ms`` shortens it (tests)."""
        window = str(segment_ms or KEYS_SEGMENT_MS)
        return TopicSpec(self.keys, self.partitions, {
            "cleanup.policy": "compact", "segment.ms": window, "max.compaction.lag.ms": window,
            "min.cleanable.dirty.ratio": "0.01", "min.compaction.lag.ms": "0",
            "delete.retention.ms": str(24 * 3600 * 1000)})

    def scheduler_state_spec(self) -> TopicSpec:
        """Compacted, partitioned like ``inbox``: partition p holds the state of the tasks on ``events`` p.

        A restore reads the whole partition, so what it costs is what compaction left: small segments
        (64 MiB, or an hour) become cleanable soon, and a tenth of them dirty is enough to clean. The
        superseded records a restore still meets are skipped undecoded (the last record of a key wins).
        """
        return TopicSpec(self.scheduler_state, self.partitions, {
            "cleanup.policy": "compact", "segment.bytes": str(64 * 1024 * 1024), "segment.ms": str(3600 * 1000),
            "min.cleanable.dirty.ratio": "0.1", "delete.retention.ms": str(24 * 3600 * 1000)})

    def dependencies_spec(self) -> TopicSpec:
        """One partition (a few records per agent process: every reader reads it all), compacted soon (a
        report supersedes the last one), a tombstone kept an hour (a process that stopped leaves the view)."""
        return TopicSpec(self.dependencies, 1, {
            "cleanup.policy": "compact", "segment.ms": str(10 * 60 * 1000), "min.cleanable.dirty.ratio": "0.1",
            "min.compaction.lag.ms": "0", "delete.retention.ms": str(3600 * 1000)})

    # -- consumer groups (each starts with the prefix, so the lag report and one prefixed ACL find them) --

    @property
    def scheduler_group(self) -> str:
        return f"{self.prefix}scheduler"

    @property
    def projector_group(self) -> str:
        """The default; ``STEPSTREAM_STORE_PROJECTOR_GROUP`` names another (two stores fed side by side)."""
        return f"{self.prefix}projector"

    @property
    def supervisor_group(self) -> str:
        """Its members compete for partition 0 of ``supervisor_lease``: the holder is the leader."""
        return f"{self.prefix}supervisor"

    def agent_group(self, name: str) -> str:
        return f"{self.prefix}agent.{name}"

    def submitter_groups(self, submitter: str) -> str:
        """The prefix of every group a submitter reads its reply topic with (a submitter name has no dot,
        so ACLs granted on this prefix never match another submitter's groups)."""
        return f"{self.prefix}submitter.{submitter}."

    def submitter_group(self, submitter: str) -> str:
        """A fresh group per reader of the reply topic: each reads it from the start, none commits."""
        return f"{self.submitter_groups(submitter)}{uuid.uuid4().hex[:8]}"

    def watcher_group(self) -> str:
        """A fresh group per API process tailing ``events`` for decisions: it assigns, never commits, and
        carries the prefix so one prefixed ACL covers it."""
        return f"{self.prefix}api-watch-{uuid.uuid4().hex}"

    def agent_spec(self, name: str) -> TopicSpec:
        return TopicSpec(self.agent(name), self.partitions)

    def status_spec(self, submitter: str) -> TopicSpec:
        return TopicSpec(self.status(submitter), self.partitions)


def reader_group(purpose: str) -> str:
    """A throwaway group for a consumer that assigns partitions rather than subscribing (replay readers, the
    DLQ follower): it never joins or commits, but the broker still asks for DESCRIBE on a group id, so these
    are granted by the prefix ``stepstream-<purpose>-`` (docs/acls.md), which carries no topic prefix."""
    return f"stepstream-{purpose}-{uuid.uuid4().hex}"


def ensure_topics(admin: AdminClient, specs: list[TopicSpec], replication_factor: int = 1,
                  timeout_s: float = 30.0) -> list[str]:
    """Create what is missing; an existing topic is left as it is. Returns the names created.

    With three replicas or more a topic also gets ``min.insync.replicas`` 2 (unless its spec says otherwise),
    whatever the cluster's default: with producers at acks=all, one broker may fail without losing an
    acknowledged record or stopping writes.
    """
    existing = set(admin.list_topics(timeout=timeout_s).topics)
    missing = [s for s in specs if s.name not in existing]
    if not missing:
        return []
    quorum = min_insync_replicas(replication_factor)
    durability = {"min.insync.replicas": str(quorum)} if quorum > 1 else {}
    futures = admin.create_topics(
        [NewTopic(s.name, num_partitions=s.partitions, replication_factor=replication_factor,
                  config={**durability, **s.config})
         for s in missing],
        operation_timeout=timeout_s,
    )
    created = []
    for name, future in futures.items():
        try:
            future.result(timeout=timeout_s)
            created.append(name)
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise InfrastructureError(f"creating topic {name} failed: {exc}") from exc
    return created


def partition_count(client: AdminClient | Producer, topic: str, timeout_s: float = 30.0) -> int:
    """The partitions ``topic`` has on the cluster: what a partitioner divides by, whatever the settings say."""
    metadata = client.list_topics(topic, timeout=timeout_s).topics[topic]
    if metadata.error is not None or not metadata.partitions:
        raise InfrastructureError(f"{topic}: its partitions are not known ({metadata.error})")
    return len(metadata.partitions)
