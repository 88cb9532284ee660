"""Starting each service process: signals first, then settings, logging, metrics, then its loop."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import structlog

from eventstore.errors import StepstreamError
from eventstore.health import HEALTH, serve_health
from eventstore.logs import configure_logging
from eventstore.settings import ConsumerSettings, KafkaSettings, ObservabilitySettings
from eventstore.shutdown import GracefulShutdown
from eventstore.topics import TopicLayout
from eventstore.tracing import configure_tracing

if TYPE_CHECKING:
    from agents.policy import FilePolicy


def _prepare(service: str) -> tuple[KafkaSettings, ConsumerSettings, threading.Event]:
    consumer = ConsumerSettings()
    stop = GracefulShutdown(consumer.drain_timeout_s).install().event
    threading.Thread(target=_unready_on, args=(stop,), name="readiness", daemon=True).start()
    observability = ObservabilitySettings()
    configure_logging(observability.log_level, observability.log_json)
    configure_tracing(service)
    if observability.metrics_port is not None:
        serve_health(observability.metrics_port)
    # From this line on, SIGTERM drains the service (the start-up scripts and tests wait for it).
    structlog.get_logger("stepstream").info("service starting", service=service)
    return KafkaSettings(), consumer, stop


def _unready_on(stop: threading.Event) -> None:
    """SIGTERM: the service drains, and says so on ``/readyz`` at once."""
    stop.wait()
    HEALTH.draining()


def run_scheduler() -> int:
    from scheduler.decider import Limits
    from scheduler.instance import scheduler_instance
    from scheduler.service import build_scheduler
    from scheduler.settings import SchedulerSettings
    from schemas.sealed import EncryptionSettings

    kafka, consumer, stop = _prepare("scheduler")
    settings = SchedulerSettings()
    # Named, so that its restart after a crash fences the transaction it left open (scheduler/instance.py).
    with scheduler_instance(settings.instance, kafka.home) as instance:
        structlog.get_logger("stepstream.scheduler").info("scheduler instance", instance=instance,
                                                          given=settings.instance is not None)
        build_scheduler(kafka, consumer, settings.load_registry(), Limits(max_in_flight=settings.max_in_flight),
                        instance, stop, keyring=EncryptionSettings().keyring()).run()
    return 0


class PolicyRefused(StepstreamError):
    """The agent policy file is invalid at start: the agent does not start (its message names the field)."""


def run_agent(name: str) -> int:
    """``stepstream run agent NAME``: one agent alone (its replicas scale out through its consumer group)."""
    return _host([name], f"agent {name}")


def run_agents(names: list[str]) -> int:
    """``stepstream run agents [NAME ...]``: the agents named, or every agent the workflows name (forward
    and compensation, as ``up`` runs them), in one process (:mod:`agents.host`)."""
    if not names:
        from scheduler.settings import SchedulerSettings

        names = sorted(SchedulerSettings().load_registry().agents)
    return _host(names, "agents")


def _host(names: list[str], service: str) -> int:
    """Run the agents ``names`` in this process, sharing one producer, one data-keys reader, the policy and
    the breaker, budget and pace of each service; each keeps its consumer, workers, connection pool, metrics
    and drain."""
    from agents.dependencies import process_registry
    from agents.host import AgentHost
    from agents.policy import FilePolicy, PolicyError
    from agents.reporting import Reporter
    from agents.runtime import build_agent
    from agents.settings import AgentSettings
    from eventstore.keys import DataKeys
    from eventstore.producer import EventProducer
    from stepstream.project.agents import declared_agents
    from stepstream.project.files import find_project

    project = find_project()
    for name in names:
        project.agent(name)  # an undeclared name is refused in one line, before the service starts
    kafka, consumer, stop = _prepare(service)
    settings = AgentSettings()
    try:
        policy = settings.policy_provider()
    except PolicyError as exc:  # one line naming the field, not the chain of parsers it came through
        raise PolicyRefused(f"{service} not started: {exc}") from None
    if isinstance(policy, FilePolicy):
        threading.Thread(target=_watch_policy, args=(policy, stop), name="policy-watch", daemon=True).start()
    agents = declared_agents(project, names, policy, stop, connections=settings.concurrency,
                             urls={name: settings.url_for(name) for name in names})
    bootstrap = kafka.resolved_bootstrap()
    keys = DataKeys(bootstrap, TopicLayout.from_settings(kafka).keys)
    # Answers wait up to linger_ms to leave together: under a burst, fewer and larger produce requests (and
    # fewer fetches for the scheduler reading them); alone, a few milliseconds more per step.
    linger: dict[str, Any] = {"linger.ms": settings.linger_ms}
    output = EventProducer(bootstrap, **linger)
    loops = {name: build_agent(kafka, consumer, agent, settings.concurrency, keys=keys, output=output.share()).run
             for name, agent in agents.items()}
    # What the console shows of these agents' dependencies (breaker, budget, throttles): published beside them.
    reporter = Reporter(bootstrap, TopicLayout.from_settings(kafka).dependencies,
                        concurrency=settings.concurrency).start()
    try:
        AgentHost(loops, stop, consumer.drain_timeout_s).run()
    finally:
        process_registry().flush()  # the calls' trouble since the last aggregated line
        reporter.stop()
        keys.close()
    return 0


def _watch_policy(policy: FilePolicy, stop: threading.Event) -> None:
    """Re-read the policy file every poll interval, not only when a call asks for the policy: an edit is
    applied (or a bad one refused with its ERROR log) within the interval even while the agent is idle."""
    while not stop.wait(policy.poll_interval_s):
        policy.check()


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
