"""Fixtures: one real Kafka broker per test session, and a topic prefix per test.

The broker is, in order: the cluster named by STEPSTREAM_BOOTSTRAP_SERVERS, a testcontainers Kafka
where a Docker engine answers, else the project's own local broker (Kafka jars from Maven Central). Every
test that uses it is marked ``kafka`` (checked at collection), so ``-m "not kafka"`` starts no broker.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka.admin import AdminClient
from hypothesis import settings

from eventstore.broker import BrokerInfo, LocalBroker
from eventstore.topics import TopicLayout, ensure_topics

# Property tests check what holds, not how fast: on two cores shared with broker-backed tests beside them, one
# example may take longer than hypothesis' default 200 ms deadline, which would fail a correct property.
settings.register_profile("stepstream", deadline=None)
settings.load_profile("stepstream")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test that reaches the broker through the fixtures must be marked ``kafka``, so that
    ``pytest -m "not kafka"`` never starts one; an unmarked one stops the run here, named. (A test that starts
    a broker of its own, like tests/test_broker.py, is marked by hand.)"""
    unmarked = [item.nodeid for item in items
                if "kafka" in getattr(item, "fixturenames", ()) and item.get_closest_marker("kafka") is None]
    if unmarked:
        raise pytest.UsageError("these tests need a broker but are not marked kafka (pytest.mark.kafka):\n  "
                                + "\n  ".join(unmarked))


@pytest.fixture(autouse=True)
def _no_broker_unless_marked(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test not marked ``kafka`` that starts a local broker in this process fails, named, rather than
    making ``-m "not kafka"`` need Java and a broker after all."""
    if request.node.get_closest_marker("kafka") is None:
        def refuse(_broker: LocalBroker) -> BrokerInfo:
            raise AssertionError(f"{request.node.nodeid} starts a Kafka broker: mark it kafka")

        monkeypatch.setattr(LocalBroker, "launch", refuse)  # start() and a cluster's nodes both launch


@pytest.fixture(autouse=True)
def _environment_restored() -> Iterator[None]:
    """What a test's in-process command sets in the environment (``stepstream.cli.main`` makes the project
    file this process's configuration, for the children it starts) ends with the test: left behind, it
    became the configuration of every later test's service processes on that worker."""
    saved = os.environ.copy()
    yield
    os.environ.clear()
    os.environ.update(saved)


def _docker_answers() -> bool:
    try:
        import docker

        docker.from_env(timeout=3).ping()
        return True
    except Exception:
        return False


class KafkaUnderTest:
    def __init__(self, bootstrap: str, local: LocalBroker | None) -> None:
        self.bootstrap = bootstrap
        self.local = local


@pytest.fixture(scope="session")
def kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KafkaUnderTest]:
    external = os.environ.get("STEPSTREAM_BOOTSTRAP_SERVERS")
    if external:
        yield KafkaUnderTest(external, None)
        return
    if _docker_answers():
        from testcontainers.kafka import KafkaContainer

        # testcontainers' KafkaContainer drives the Confluent image's start scripts (not apache/kafka's).
        with KafkaContainer("confluentinc/cp-kafka:7.6.0").with_kraft() as container:
            yield KafkaUnderTest(container.get_bootstrap_server(), None)
        return
    broker = LocalBroker(tmp_path_factory.mktemp("kafka-home"))
    info = broker.start()
    try:
        yield KafkaUnderTest(info.bootstrap_servers, broker)
    finally:
        broker.stop()


@pytest.fixture(scope="session")
def bootstrap(kafka: KafkaUnderTest) -> str:
    return kafka.bootstrap


@pytest.fixture
def layout(bootstrap: str) -> TopicLayout:
    """A fresh prefix per test, its core topics created: tests never see each other's messages."""
    layout = TopicLayout(prefix=f"t{uuid.uuid4().hex[:10]}.", partitions=3)
    ensure_topics(AdminClient({"bootstrap.servers": bootstrap}), layout.core_specs())
    return layout


@pytest.fixture
def test_env(bootstrap: str, layout: TopicLayout, tmp_path: Path) -> dict[str, str]:
    """Environment for service subprocesses started by a test: same cluster, same prefix, short cadences."""
    from tests.system import service_env

    return service_env(bootstrap, layout, tmp_path / "home")


@pytest.fixture
def system(bootstrap: str, layout: TopicLayout, test_env: dict[str, str], tmp_path: Path) -> Iterator[Any]:
    """A whole system (every service as a process, the order service over HTTP); nothing started yet."""
    from demo.orders_client import ServiceProcess
    from tests.system import System

    with ServiceProcess(log_path=tmp_path / "orders-service.log", env=test_env) as service:
        system = System(bootstrap, layout, test_env, tmp_path, service)
        try:
            yield system
        finally:
            system.stop()


# PostgreSQL: a throwaway cluster per session, a database per test, and the per-backend store fixture.
from tests.postgres import postgres_server, postgres_url, store_spec  # noqa: E402, F401
