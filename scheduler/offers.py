"""Which workflow versions the running schedulers accept: each scheduler says so on the ``workflows`` topic.

A scheduler publishes, as it starts, the versions its registry runs and what each one's input must hold,
under its instance name on the compacted ``workflows`` topic (one partition, one record per scheduler after
compaction). Instance names are stable (``scheduler.instance``), so a restarted scheduler replaces its own
record: after a rollout the topic says what the new deployment runs. The client and the CLI read the topic
to its end before a submission, so a version no scheduler runs is refused before anything is produced
(instead of being rejected by the scheduler a moment later) and a submission naming no version can be told
which version it will be pinned to. The scheduler still checks every submission itself: this is advice to
the submitter, read a moment ago, not a lock.

A scheduler stopped for good leaves its record until a scheduler of the same name starts: its versions still
count as offered, and a submission of one only it ran is rejected by the scheduler that owns the task's
partition, visibly, and admitted when repeated once a scheduler running it is back.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import structlog
from confluent_kafka import KafkaException
from pydantic import BaseModel, ValidationError

from eventstore.errors import LogReadError
from eventstore.producer import EventProducer
from eventstore.replay import LogRange
from scheduler.workflow import WorkflowRegistry

log = structlog.get_logger("stepstream.offers")


class OfferedVersion(BaseModel):
    name: str
    version: int
    input: str  # what its input must hold, for people (``Workflow.describe_input``)
    sensitive: list[str]  # the input fields sealed from submission on


class Offer(BaseModel):
    """One scheduler's record: the versions it runs, since when."""

    instance: str
    published_at: datetime
    workflows: list[OfferedVersion]


def offer_of(registry: WorkflowRegistry, instance: str, now: datetime) -> Offer:
    return Offer(instance=instance, published_at=now, workflows=[
        OfferedVersion(name=w.name, version=w.version, input=w.describe_input(), sensitive=sorted(w.sensitive_input))
        for w in sorted(registry.workflows(), key=lambda w: (w.name, w.version))])


def publish(bootstrap: str, topic: str, offer: Offer) -> None:
    """Write ``offer`` under its instance name and wait for the broker's acknowledgement."""
    producer = EventProducer(bootstrap)
    producer.send_raw(topic, offer.instance, offer.model_dump_json().encode())
    producer.flush(30.0)


@dataclass(frozen=True)
class Offers:
    """What the schedulers published: the last record of each instance."""

    offers: tuple[Offer, ...]

    @classmethod
    def read(cls, bootstrap: str, topic: str) -> Offers:
        """The topic read to its end; no topic yet (no scheduler ever started), or none this principal may read,
        is no offer: the scheduler's own check then answers."""
        latest: dict[bytes, Offer | None] = {}
        try:
            for msg in LogRange(bootstrap, topic):
                key, value = msg.key(), msg.value()
                if key is None:
                    continue
                try:
                    latest[key] = None if value is None else Offer.model_validate_json(value)
                except ValidationError:
                    log.warning("unreadable workflows record ignored", topic=topic, offset=msg.offset())
        except (LogReadError, KafkaException) as exc:  # no such topic yet, or no grant to read it (docs/acls.md)
            log.info("workflows topic not read: nothing known of the running schedulers' versions", topic=topic,
                     error=str(exc))
            return cls(())
        return cls(tuple(offer for offer in latest.values() if offer is not None))

    @property
    def known(self) -> bool:
        """Whether any scheduler published: without, nothing can be said before the scheduler answers."""
        return bool(self.offers)

    def versions(self, name: str) -> list[int]:
        """Every version of ``name`` some running scheduler accepts, ascending."""
        return sorted({w.version for offer in self.offers for w in offer.workflows if w.name == name})

    def latest(self, name: str) -> list[int]:
        """The version a submission of ``name`` naming none is pinned to: each scheduler pins its own latest,
        so during a rollout this can be two versions (the task's partition decides)."""
        return sorted({max(w.version for w in offer.workflows if w.name == name)
                       for offer in self.offers if any(w.name == name for w in offer.workflows)})

    def refusal(self, name: str, version: int | None) -> str | None:
        """Why no running scheduler would take a submission of ``name`` (``version``: None for the latest), or
        None when one would (or no scheduler published anything)."""
        if not self.known:
            return None
        versions = self.versions(name)
        if not versions:
            names = sorted({w.name for offer in self.offers for w in offer.workflows})
            return f"no running scheduler runs a workflow named {name!r} (they run {', '.join(names) or 'none'})"
        if version is not None and version not in versions:
            return (f"no running scheduler runs {name!r} v{version} (they run v{', v'.join(map(str, versions))}); "
                    "it is accepted once a scheduler running it has started")
        return None
