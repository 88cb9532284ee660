"""Reply topics under ACLs: a SASL broker with the StandardAuthorizer, where a submitter reads only its own.

The module starts a broker of its own (SASL_PLAINTEXT, mechanism PLAIN, users admin/scheduler/alice/bob,
``allow.everyone.if.no.acl.found=false``), applies the ACLs of docs/acls.md with the admin client, and
logs every other client in through ``STEPSTREAM_KAFKA_*``, as a deployment does.
"""

from __future__ import annotations

import itertools
import shutil
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from confluent_kafka import Consumer, KafkaError, Message
from confluent_kafka.admin import (
    AclBinding,
    AclBindingFilter,
    AclOperation,
    AclPermissionType,
    AdminClient,
    ResourcePatternType,
    ResourceType,
)

from eventstore.broker import LocalBroker
from eventstore.errors import InfrastructureError
from eventstore.kafka_config import KafkaSecurityError, connection_config
from eventstore.producer import EventProducer
from eventstore.settings import KafkaSecuritySettings, KafkaSettings
from eventstore.topics import TopicLayout, TopicSpec, ensure_topics
from schemas.codec import default_codec
from schemas.messages import StatusUpdate

USERS = {"admin": "admin-secret", "scheduler": "scheduler-secret", "alice": "alice-secret", "bob": "bob-secret"}
SUBMITTERS = ("alice", "bob")


@dataclass(frozen=True)
class Secured:
    bootstrap: str
    layout: TopicLayout
    published: dict[str, StatusUpdate]  # submitter -> the update the scheduler wrote to its reply topic


def login(mp: pytest.MonkeyPatch, user: str, password: str | None = None) -> None:
    """The environment a service or submitter process of ``user`` runs with."""
    mp.setenv("STEPSTREAM_KAFKA_SECURITY_PROTOCOL", "SASL_PLAINTEXT")
    mp.setenv("STEPSTREAM_KAFKA_SASL_MECHANISM", "PLAIN")
    mp.setenv("STEPSTREAM_KAFKA_SASL_USERNAME", user)
    mp.setenv("STEPSTREAM_KAFKA_SASL_PASSWORD", USERS[user] if password is None else password)


def _allow(user: str, kind: ResourceType, name: str, pattern: ResourcePatternType,
           *operations: AclOperation) -> list[AclBinding]:
    return [AclBinding(kind, name, pattern, f"User:{user}", "*", op, AclPermissionType.ALLOW) for op in operations]


def reply_topic_acls(layout: TopicLayout, scheduler: str, submitters: tuple[str, ...]) -> list[AclBinding]:
    """The reply-topic part of docs/acls.md: the scheduler writes every status topic, a submitter reads its own."""
    topic, group = ResourceType.TOPIC, ResourceType.GROUP
    literal, prefixed = ResourcePatternType.LITERAL, ResourcePatternType.PREFIXED
    acls = _allow(scheduler, topic, layout.status(""), prefixed,
                  AclOperation.WRITE, AclOperation.DESCRIBE, AclOperation.CREATE)
    for name in submitters:
        acls += _allow(name, topic, layout.inbox, literal, AclOperation.WRITE)  # it submits tasks
        acls += _allow(name, topic, layout.status(name), literal, AclOperation.READ, AclOperation.DESCRIBE)
        acls += _allow(name, group, layout.submitter_groups(name), prefixed, AclOperation.READ)
    return acls


def _grant(admin: AdminClient, acls: list[AclBinding], timeout_s: float = 15.0) -> None:
    for future in admin.create_acls(acls).values():
        future.result(timeout=timeout_s)
    # The broker answers DescribeAcls from its own authorizer: once it lists them all, it enforces them.
    everything = AclBindingFilter(ResourceType.ANY, None, ResourcePatternType.ANY, None, None,
                                  AclOperation.ANY, AclPermissionType.ANY)
    deadline = time.monotonic() + timeout_s
    while len(admin.describe_acls(everything).result(timeout=timeout_s)) < len(acls):
        assert time.monotonic() < deadline, "the broker did not apply the ACLs"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    if shutil.which("java") is None:
        pytest.skip("the SASL broker runs from the Kafka jars and needs a JDK")
    broker = LocalBroker(tmp_path_factory.mktemp("sasl-broker"), sasl_users=USERS, super_users=["admin"])
    bootstrap = broker.start().bootstrap_servers
    try:
        layout = TopicLayout(prefix=f"acl{uuid.uuid4().hex[:8]}.", partitions=1)
        admin = AdminClient({"bootstrap.servers": bootstrap, **broker.sasl_client_config("admin")})
        ensure_topics(admin, [TopicSpec(layout.inbox, layout.partitions)])
        _grant(admin, reply_topic_acls(layout, "scheduler", SUBMITTERS))
        published: dict[str, StatusUpdate] = {}
        with pytest.MonkeyPatch.context() as mp:
            # What the scheduler service does for a reply: create the topic if missing, then write to it.
            login(mp, "scheduler")
            scheduler_admin = AdminClient(connection_config(bootstrap))
            producer = EventProducer(bootstrap)
            for name in SUBMITTERS:
                ensure_topics(scheduler_admin, [layout.status_spec(name)])
                published[name] = StatusUpdate(task_id=f"task-of-{name}", status="accepted", detail=name)
                producer.send(layout.status(name), published[name])
            producer.flush()
            del producer, scheduler_admin  # no client of the fixture outlives the broker
        yield Secured(bootstrap, layout, published)
    finally:
        broker.stop()


def _follow(bootstrap: str, topic: str, group: str, timeout_s: float = 15.0) -> tuple[list[Message], list[KafkaError]]:
    """Read ``topic`` from the start with the environment's credentials until a message or an error arrives."""
    consumer = Consumer({**connection_config(bootstrap), "group.id": group, "auto.offset.reset": "earliest",
                         "enable.auto.commit": False, "isolation.level": "read_committed"})
    consumer.subscribe([topic])
    messages: list[Message] = []
    errors: list[KafkaError] = []
    deadline = time.monotonic() + timeout_s
    try:
        while not (messages or errors) and time.monotonic() < deadline:
            msg = consumer.poll(0.2)
            if msg is None:
                continue
            if msg.error() is not None:
                errors.append(msg.error())
            else:
                messages.append(msg)
    finally:
        consumer.close()
    return messages, errors


@pytest.mark.kafka
def test_a_submitter_reads_the_status_the_scheduler_wrote_to_its_reply_topic(
        secured: Secured, monkeypatch: pytest.MonkeyPatch) -> None:
    layout = secured.layout
    login(monkeypatch, "alice")
    messages, errors = _follow(secured.bootstrap, layout.status("alice"), layout.submitter_group("alice"))
    assert errors == []
    assert [default_codec().decode(m.value()) for m in messages] == [secured.published["alice"]]


@pytest.mark.kafka
def test_another_submitter_cannot_read_the_reply_topic(secured: Secured, monkeypatch: pytest.MonkeyPatch) -> None:
    layout = secured.layout
    login(monkeypatch, "bob")
    messages, errors = _follow(secured.bootstrap, layout.status("alice"), layout.submitter_group("bob"))
    assert messages == []
    assert [e.code() for e in errors] == [KafkaError.TOPIC_AUTHORIZATION_FAILED]
    # His own group prefix is fine: he reads his own reply topic with it.
    own, errors = _follow(secured.bootstrap, layout.status("bob"), layout.submitter_group("bob"))
    assert errors == [] and [default_codec().decode(m.value()) for m in own] == [secured.published["bob"]]


@pytest.mark.kafka
def test_another_submitter_cannot_join_the_submitters_groups(secured: Secured,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    layout = secured.layout
    login(monkeypatch, "bob")
    messages, errors = _follow(secured.bootstrap, layout.status("bob"), layout.submitter_group("alice"))
    assert messages == []
    assert [e.code() for e in errors] == [KafkaError.GROUP_AUTHORIZATION_FAILED]


@pytest.mark.kafka
def test_a_submitter_cannot_write_to_another_reply_topic(secured: Secured, monkeypatch: pytest.MonkeyPatch) -> None:
    login(monkeypatch, "alice")
    producer = EventProducer(secured.bootstrap)
    producer.send(secured.layout.status("bob"), StatusUpdate(task_id="task-of-bob", status="completed"))
    with pytest.raises(InfrastructureError, match="Topic authorization failed"):
        producer.flush(timeout_s=15)


@pytest.mark.kafka
def test_a_wrong_password_fails_authentication(secured: Secured, monkeypatch: pytest.MonkeyPatch) -> None:
    login(monkeypatch, "alice", password="not-her-password")
    failures: list[KafkaError] = []
    consumer = Consumer({**connection_config(secured.bootstrap), "group.id": secured.layout.submitter_group("alice"),
                         "error_cb": failures.append, "log_level": 0})
    consumer.subscribe([secured.layout.status("alice")])
    deadline = time.monotonic() + 15
    received = []
    try:
        while not failures and time.monotonic() < deadline:
            msg = consumer.poll(0.2)
            if msg is not None and msg.error() is None:
                received.append(msg)
    finally:
        consumer.close()
    assert received == []
    assert failures and failures[0].code() == KafkaError._AUTHENTICATION, failures
    assert "Invalid username or password" in failures[0].str()


@pytest.mark.kafka
def test_the_product_client_follows_only_its_own_reply_topic(secured: Secured,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from stepstream.client import Client

    kafka = KafkaSettings(bootstrap_servers=secured.bootstrap, topic_prefix=secured.layout.prefix,
                          partitions=secured.layout.partitions)
    login(monkeypatch, "alice")
    with Client(kafka=kafka, submitter="alice") as alice:
        # The first update ends the loop; dropping the generator closes its consumer.
        assert list(itertools.islice(alice.updates(timeout_s=15), 1)) == [secured.published["alice"]]
    login(monkeypatch, "bob")
    with pytest.raises(InfrastructureError, match="TOPIC_AUTHORIZATION_FAILED"):
        Client(kafka=kafka, submitter="alice")  # bob cannot even see her reply topic
    with Client(kafka=kafka, submitter="bob") as bob:
        assert [u.task_id for u in bob.updates(timeout_s=15, idle_s=5)] == ["task-of-bob"]


# -- configuration, no broker ----------------------------------------------------------------------


def test_plaintext_adds_nothing_to_a_clients_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("SECURITY_PROTOCOL", "SASL_MECHANISM", "SASL_USERNAME", "SASL_PASSWORD", "SSL_CA_LOCATION"):
        monkeypatch.delenv(f"STEPSTREAM_KAFKA_{name}", raising=False)
    assert connection_config("h:9092") == {"bootstrap.servers": "h:9092"}


def test_sasl_settings_become_librdkafka_properties_and_hide_the_password(monkeypatch: pytest.MonkeyPatch) -> None:
    login(monkeypatch, "alice")
    monkeypatch.setenv("STEPSTREAM_KAFKA_SECURITY_PROTOCOL", "sasl_ssl")
    monkeypatch.setenv("STEPSTREAM_KAFKA_SASL_MECHANISM", "SCRAM-SHA-512")
    monkeypatch.setenv("STEPSTREAM_KAFKA_SSL_CA_LOCATION", "/etc/ssl/kafka-ca.pem")
    assert connection_config("h:9093") == {
        "bootstrap.servers": "h:9093", "security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.username": "alice", "sasl.password": "alice-secret", "ssl.ca.location": "/etc/ssl/kafka-ca.pem"}
    assert "alice-secret" not in repr(KafkaSecuritySettings())


@pytest.mark.parametrize(("env", "named"), [
    ({"SECURITY_PROTOCOL": "SASL_PLAINTEXT", "SASL_MECHANISM": "PLAIN"}, "STEPSTREAM_KAFKA_SASL_USERNAME"),
    ({"SECURITY_PROTOCOL": "SASL_SSL", "SASL_USERNAME": "u", "SASL_PASSWORD": "p"},
     "STEPSTREAM_KAFKA_SASL_MECHANISM"),
    ({"SECURITY_PROTOCOL": "SASL_PLAINTEXT", "SASL_MECHANISM": "PLAIN", "SASL_USERNAME": "u"},
     "STEPSTREAM_KAFKA_SASL_PASSWORD"),
    ({"SASL_USERNAME": "u"}, "STEPSTREAM_KAFKA_SASL_USERNAME is set but"),
    ({"SECURITY_PROTOCOL": "SASL_PLAINTEXT ", "SASL_MECHANISM": "PLAIN"}, "STEPSTREAM_KAFKA_SECURITY_PROTOCOL"),
    ({"SSL_CA_LOCATION": "/ca.pem"}, "STEPSTREAM_KAFKA_SSL_CA_LOCATION"),
])
def test_incomplete_security_settings_are_refused_naming_the_variable(
        env: dict[str, str], named: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in env.items():
        monkeypatch.setenv(f"STEPSTREAM_KAFKA_{name}", value)
    with pytest.raises(KafkaSecurityError, match=named):
        connection_config("h:9092")


def test_the_default_broker_configuration_has_no_sasl_and_sasl_users_are_checked(tmp_path: Path) -> None:
    plain = LocalBroker(tmp_path / "plain")
    plain._write_config(9092, 9093)
    properties = (tmp_path / "plain" / "broker" / "server.properties").read_text()
    assert "sasl" not in properties and "authorizer" not in properties
    assert "listeners=PLAINTEXT://127.0.0.1:9092,CONTROLLER://127.0.0.1:9093\n" in properties
    assert plain.sasl_client_config() == {}
    from eventstore.errors import BrokerError

    with pytest.raises(BrokerError, match="super user"):
        LocalBroker(tmp_path, sasl_users={"admin": "x"})
    with pytest.raises(BrokerError, match="quotes"):
        LocalBroker(tmp_path, sasl_users={"admin": 'x"y'}, super_users=["admin"])
    with pytest.raises(BrokerError, match="without a password"):
        LocalBroker(tmp_path, sasl_users={"admin": "x"}, super_users=["root"])
