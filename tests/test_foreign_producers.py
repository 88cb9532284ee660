"""Submissions from a user's own Kafka client, on a real system: a plain ``confluent_kafka.Producer`` at its
defaults (librdkafka's ``consistent_random`` partitioner, crc32, not murmur2) with the project's codec for
the bytes. Its records land on other partitions than the scheduler's owners; each task still ends as a
correct producer's would, checked against the order service's own records. And a sealed submission that the
scheduler dead-lettered completes when the dead letter is replayed, or loses its data key when it is discarded."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import orjson
import pytest
from confluent_kafka import KafkaError, Producer
from confluent_kafka import Message as KafkaMessage

from eventstore.keys import PROPOSED, proposal_record, read_key_records
from eventstore.partitioning import partition_of
from eventstore.replay import LogRange
from scheduler.placement import MOVED_FROM
from scheduler.sealing import SubmissionSealer
from schemas.codec import default_codec
from schemas.messages import SubmitTask
from schemas.sealed import Keyring
from tests.agreement import disagreements
from tests.kafka_helpers import wait_for
from tests.system import System
from tests.test_sensitive_end_to_end import K1, K2, card_system, charged_token, order, start  # noqa: F401
from tests.workflows import SENSITIVE_REGISTRY

pytestmark = pytest.mark.kafka

JAVA = Path(__file__).parent / "java"


class ForeignProducer:
    """A user's own application: a plain producer at librdkafka's defaults, nothing of stepstream but the
    codec (and, for sealed fields, the sealer and the proposal's record key and header)."""

    def __init__(self, bootstrap: str) -> None:
        self._producer = Producer({"bootstrap.servers": bootstrap})
        self.placed: dict[tuple[str, str], int] = {}  # (topic, record key) -> the partition its partitioner chose
        self._failures: list[KafkaError] = []

    def produce(self, topic: str, key: str, value: bytes, headers: list[tuple[str, bytes]] | None = None) -> None:
        def report(err: KafkaError | None, msg: KafkaMessage) -> None:
            if err is not None:
                self._failures.append(err)
            else:
                self.placed[(topic, key)] = msg.partition()

        self._producer.produce(topic, key=key, value=value, headers=headers, on_delivery=report)

    def submit(self, topic: str, command: SubmitTask) -> None:
        self.produce(topic, command.task_id, default_codec().encode(command))

    def flush(self) -> None:
        assert self._producer.flush(30) == 0 and not self._failures, self._failures


def propose(foreign: ForeignProducer, system: System, command: SubmitTask, keyring: str = K1) -> SubmitTask:
    """Seal ``command``'s marked fields, propose its data key on ``keys`` wherever the client puts it, and
    return the submission as it goes to ``inbox``: naming the proposal, not carrying the key."""
    sealed = SubmissionSealer(SENSITIVE_REGISTRY, Keyring.parse(keyring)).seal(command)
    assert sealed.key_ref is not None and sealed.data_key is not None
    foreign.produce(system.layout.keys, proposal_record(sealed.task_id, sealed.key_ref), sealed.data_key.encode(),
                    [PROPOSED])
    return sealed.model_copy(update={"data_key": None})


@pytest.fixture
def paid_orders(card_system: System) -> System:  # noqa: F811 (the fixture imported above)
    """The system on the paid-order workflows (sealed ``card_token``) and ``orders`` v1, started."""
    start(card_system)
    return card_system


def plain_order(task_id: str, amount: int = 10) -> dict[str, Any]:
    return {"order_id": task_id, "sku": "A-1", "qty": 1, "amount": amount}


def test_fifty_submissions_placed_by_librdkafkas_default_partitioner_end_as_a_correct_producers_would(
    paid_orders: System,
) -> None:
    system = paid_orders
    system.restart("scheduler#2")  # two schedulers: a record is moved to a partition another one owns
    assert wait_for(lambda: "partitions ready" in system.procs.log("scheduler#2"), timeout_s=60)
    foreign = ForeignProducer(system.bootstrap)
    plain = [SubmitTask(task_id=f"crc-{n}", workflow="orders", workflow_version=1, input=plain_order(f"crc-{n}"),
                        submitter="shop") for n in range(40)]
    cards = [propose(foreign, system, SubmitTask(task_id=f"crc-card-{n}", workflow="orders-card", workflow_version=1,
                                                 input=order(f"crc-card-{n}"), submitter="shop"))
             for n in range(10)]
    foreign.flush()  # the proposals are acknowledged before their submissions go
    for command in plain + cards:
        foreign.submit(system.layout.inbox, command)
    # Behind their originals, on the same (wrong) partition: three repeats, a no-op each, and two contradictions,
    # each a dead letter whose data reaches no service.
    for command in plain[:3]:
        foreign.submit(system.layout.inbox, command)
    for command in plain[3:5]:
        foreign.submit(system.layout.inbox, command.model_copy(update={"input": plain_order(command.task_id, 99)}))
    foreign.flush()

    ids = [c.task_id for c in plain + cards]
    owners = {t: partition_of(t, system.layout.partitions) for t in ids}
    astray = {t for t in ids if foreign.placed[(system.layout.inbox, t)] != owners[t]}
    assert len(astray) >= 20, "librdkafka's default partitioner puts most of them elsewhere than murmur2"
    proposals_astray = sum(1 for c in cards if foreign.placed[(system.layout.keys, proposal_record(
        c.task_id, str(c.key_ref)))] != owners[c.task_id])
    assert proposals_astray >= 5, "a proposal keyed by its own record key lands anywhere"

    statuses = system.wait_terminal(ids, timeout_s=120)
    assert set(statuses.values()) == {"completed"}, statuses
    assert disagreements(system, statuses, ids) == {}, "each step applied once, every effect still held"
    for command in cards:
        assert charged_token(system, command.task_id) == order(command.task_id)["card_token"], "opened, charged"
    for command in plain[3:5]:
        charges = system.admin.records(command.task_id)["charges"].values()
        assert [c["amount"] for c in charges] == [10], "the contradiction's data was applied nowhere"

    inbox = list(LogRange(system.bootstrap, system.layout.inbox))
    moved = [m for m in inbox if any(k == MOVED_FROM for k, _v in m.headers() or [])]
    assert sorted(m.key().decode() for m in moved) == sorted(
        [t for t in ids if t in astray] + [c.task_id for c in plain[:5] if c.task_id in astray])
    assert all(m.partition() == owners[m.key().decode()] for m in moved), "each moved to the partition owning it"
    letters = list(LogRange(system.bootstrap, system.layout.dlq))
    reasons = [dict(m.headers() or []).get("stepstream.dlq.reason", b"").decode() for m in letters]
    assert sorted(m.key().decode() for m, r in zip(letters, reasons, strict=True) if "contradictory" in r) \
        == sorted(c.task_id for c in plain[3:5])
    assert not [r for r in reasons if "contradictory" not in r], "nothing else dead-lettered (no unknown task)"
    proposals = read_key_records(system.bootstrap, system.layout.keys, {}).proposals
    assert all(value is None for value in proposals.values()), "every proposal taken, wherever it was"
    logs = system.procs.log("scheduler") + system.procs.log("scheduler#2")
    logged = [orjson.loads(line) for line in logs.splitlines()
              if "records on a partition that does not own their task" in line]
    assert logged and len(logged) < len(astray), "told in aggregate, not a line per record"


def test_a_dead_lettered_sealed_submission_completes_on_replay_one_discarded_has_its_key_shredded_and_stays_dead(
    paid_orders: System,
) -> None:
    system = paid_orders
    foreign = ForeignProducer(system.bootstrap)
    # A submitter already on a new master key the scheduler does not hold yet: the proposed key cannot be
    # unwrapped, and the submission is dead-lettered (two of them: one is replayed after the fix, one discarded).
    command, given_up = (propose(foreign, system, SubmitTask(task_id=task, workflow="orders-card", workflow_version=1,
                                                             input=order(task), submitter="shop"), f"{K2},{K1}")
                         for task in ("replayed-card", "discarded-card"))
    foreign.flush()
    foreign.submit(system.layout.inbox, command)
    foreign.submit(system.layout.inbox, given_up)
    # And one naming a proposal that never came: it cannot be opened by any fix.
    lost = SubmissionSealer(SENSITIVE_REGISTRY, Keyring.parse(K1)).seal(SubmitTask(
        task_id="lost-key", workflow="orders-card", workflow_version=1, input=order("lost-key"), submitter="shop"))
    foreign.submit(system.layout.inbox, lost.model_copy(update={"data_key": None}))
    foreign.flush()

    entries: dict[str, str] = {}

    def dead_lettered() -> bool:
        listed = system.cli("dlq", "list", "--json")
        entries.update({e["key"]: e["entry"] for e in orjson.loads(listed.stdout or "[]")})
        return {"replayed-card", "discarded-card", "lost-key"} <= set(entries)

    assert wait_for(dead_lettered, timeout_s=60), system.logs_tail()
    assert "replayed-card" not in system.statuses() and charged_token(system, "replayed-card") is None
    record = proposal_record("replayed-card", str(command.key_ref))
    shredded = proposal_record("discarded-card", str(given_up.key_ref))
    kept = read_key_records(system.bootstrap, system.layout.keys, {}).proposals
    assert kept.get(record) and kept.get(shredded), "the proposed key is kept while its submission is a dead letter"

    discarded = system.cli("dlq", "discard", entries["discarded-card"], "--json")
    assert discarded.returncode == 0, discarded.stdout + discarded.stderr
    assert [(o["key"], o["discarded"], o["shredded"]) for o in orjson.loads(discarded.stdout)] == [
        ("discarded-card", True, shredded)]
    after = read_key_records(system.bootstrap, system.layout.keys, {})
    assert shredded in after.proposals and after.proposals[shredded] is None, "its data key tombstoned on keys"
    assert after.proposals.get(record), "the other dead letter's key is kept"
    listed = {e["key"]: e for e in orjson.loads(system.cli("dlq", "list", "--json").stdout)}
    assert listed["discarded-card"]["discarded"]["shredded"] == shredded
    assert listed["replayed-card"]["discarded"] is None
    again = system.cli("dlq", "discard", entries["discarded-card"], "--json")
    assert orjson.loads(again.stdout)[0]["skipped"] == "already discarded"

    system.env["STEPSTREAM_ENCRYPTION_KEYS"] = f"{K1},{K2}"  # the fix: the scheduler learns the new master key
    system.procs.terminate("scheduler")
    system.restart("scheduler")
    replayed = system.cli("dlq", "replay", entries["replayed-card"], entries["lost-key"], entries["discarded-card"],
                          "--force", "--json")
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    outcomes = {o["key"]: o for o in orjson.loads(replayed.stdout)}
    assert outcomes["replayed-card"]["replayed_to"] and outcomes["lost-key"]["replayed_to"] is None
    assert "is no longer on" in outcomes["lost-key"]["skipped"] and "submit the task again" in \
        outcomes["lost-key"]["skipped"]
    assert outcomes["discarded-card"]["replayed_to"] is None, "a discarded dead letter is not replayed, even forced"
    assert "a discarded dead letter is never replayed" in outcomes["discarded-card"]["skipped"]

    statuses = system.wait_terminal(["replayed-card"], timeout_s=90)
    assert statuses == {"replayed-card": "completed"}
    assert disagreements(system, statuses, ["replayed-card"]) == {}
    assert charged_token(system, "replayed-card") == order("replayed-card")["card_token"]
    assert wait_for(lambda: read_key_records(system.bootstrap, system.layout.keys, {}).proposals.get(record) is None,
                    timeout_s=30), "taken by the replay, like any proposal"
    assert "discarded-card" not in system.statuses() and charged_token(system, "discarded-card") is None


def java_classpath(tmp: Path) -> str:
    """The class path of the Java submitter's jars (the Kafka client, Avro), fetched by Maven once."""
    if shutil.which("java") is None or shutil.which("mvn") is None:
        pytest.skip("the Java submitter needs a JDK and Maven")
    out = tmp / "classpath.txt"
    fetched = subprocess.run(["mvn", "-q", "-B", "-f", str(JAVA / "pom.xml"), "dependency:build-classpath",
                              f"-Dmdep.outputFile={out}"], capture_output=True, text=True, timeout=600, check=False)
    assert fetched.returncode == 0, fetched.stdout + fetched.stderr
    return out.read_text().strip()


def test_a_java_application_submits_with_avros_own_encoder_and_follows_its_task_to_completed(
    system: System, tmp_path: Path,
) -> None:
    classpath = java_classpath(tmp_path)
    system.start()
    task = "java-1"
    ran = subprocess.run(["java", "-cp", classpath, str(JAVA / "SubmitFromJava.java"), system.bootstrap,
                          system.layout.prefix, str(Path(__file__).parent.parent / "schemas" / "avro"), task,
                          "orders", "1", orjson.dumps(plain_order(task)).decode(), "java-shop"],
                         capture_output=True, text=True, timeout=150, check=False)
    assert ran.returncode == 0, ran.stdout + ran.stderr + system.logs_tail()
    assert ran.stdout.split()[-2:] == [task, "completed"], "the reply decoded by Avro's own decoder"
    assert "accepted" in ran.stdout.split()
    statuses = system.wait_terminal([task])
    assert statuses == {task: "completed"} and disagreements(system, statuses, [task]) == {}
