"""Starting each service process: signals first, then settings, logging, metrics, then its loop."""

from __future__ import annotations

import threading

import structlog
from prometheus_client import start_http_server

from eventstore.logs import configure_logging
from eventstore.settings import ConsumerSettings, KafkaSettings, ObservabilitySettings
from eventstore.shutdown import GracefulShutdown


def _prepare(service: str) -> tuple[KafkaSettings, ConsumerSettings, threading.Event]:
    consumer = ConsumerSettings()
    stop = GracefulShutdown(consumer.drain_timeout_s).install().event
    observability = ObservabilitySettings()
    configure_logging(observability.log_level, observability.log_json)
    if observability.metrics_port is not None:
        start_http_server(observability.metrics_port, addr="127.0.0.1")
    # From this line on, SIGTERM drains the service (the start-up scripts and tests wait for it).
    structlog.get_logger("stepstream").info("service starting", service=service)
    return KafkaSettings(), consumer, stop


def run_scheduler() -> int:
    from scheduler.decider import Limits
    from scheduler.service import build_scheduler
    from scheduler.settings import SchedulerSettings
    from schemas.sealed import EncryptionSettings

    kafka, consumer, stop = _prepare("scheduler")
    settings = SchedulerSettings()
    build_scheduler(kafka, consumer, settings.load_registry(), Limits(max_in_flight=settings.max_in_flight),
                    settings.instance, stop, keyring=EncryptionSettings().keyring()).run()
    return 0


def run_agent(name: str) -> int:
    from agents.runtime import build_agent
    from agents.settings import AgentSettings
    from agents.shipped import shipped_agent

    kafka, consumer, stop = _prepare(f"agent {name}")
    settings = AgentSettings()
    agent = shipped_agent(name, settings.service_url, settings.policy_provider(), stop,
                          connections=settings.concurrency)
    build_agent(kafka, consumer, agent, settings.concurrency).run()
    return 0


def run_projector() -> int:
    from projections.projector import build_projector
    from projections.settings import StoreSettings

    kafka, consumer, stop = _prepare("projector")
    settings = StoreSettings()
    store = settings.open(kafka.home)
    try:
        build_projector(kafka, consumer, store, stop, settings.projector_group).run()
    finally:
        store.close()
    return 0


def run_supervisor() -> int:
    from projections.settings import StoreSettings
    from supervisor.service import build_supervisor
    from supervisor.settings import SupervisorSettings

    kafka, _consumer, stop = _prepare("supervisor")
    store = StoreSettings().open(kafka.home)
    try:
        build_supervisor(kafka, SupervisorSettings(), store, stop).run()
    finally:
        store.close()
    return 0
