"""Several agents in one process (``stepstream run agents``, :mod:`agents.host`) against the real broker: one
agent's trouble does not hold up another's requests, and SIGTERM drains every agent of the host.

Requests are produced straight to the agents' topics (no scheduler) and the answers read back from ``inbox``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from confluent_kafka.admin import AdminClient

from agents.host import AgentHost
from agents.runtime import Agent, Call, build_agent
from eventstore.keys import DataKeys
from eventstore.producer import EventProducer
from eventstore.replay import ReplayReader
from eventstore.settings import KafkaSettings
from eventstore.topics import TopicLayout, ensure_topics
from schemas.messages import AgentRequest, AttemptAccepted, StepResult
from tests.kafka_helpers import wait_for
from tests.runtime_harness import FAST
from tests.system import System

pytestmark = pytest.mark.kafka


def _request(task_id: str, step: str) -> AgentRequest:
    """A queued attempt as the scheduler makes it: to be taken within 5 minutes, a minute of work from then."""
    start_by = datetime.now(UTC) + timedelta(minutes=5)
    return AgentRequest(task_id=task_id, step=step, attempt=1, attempt_id=f"{task_id}:{step}:1",
                        idempotency_key=f"{task_id}:{step}", start_by=start_by, timeout_s=60,
                        complete_by=start_by + timedelta(seconds=60), calls_allowed=3,
                        input={"task": {"order_id": task_id, "sku": "A-1", "qty": 1, "amount": 10.0}})


def _inbox(bootstrap: str, layout: TopicLayout) -> tuple[dict[str, StepResult], set[str]]:
    """The answers on inbox by attempt id, and the attempts acknowledged (taken)."""
    answers: dict[str, StepResult] = {}
    taken: set[str] = set()
    for record in ReplayReader(bootstrap, layout.inbox):
        if isinstance(record.message, StepResult):
            answers[record.message.attempt_id] = record.message
        elif isinstance(record.message, AttemptAccepted):
            taken.add(record.message.attempt_id)
    return answers, taken


def _send(bootstrap: str, layout: TopicLayout, agent: str, requests: list[AgentRequest]) -> None:
    producer = EventProducer(bootstrap)
    for request in requests:
        producer.send(layout.agent(agent), request)
    producer.flush()


@contextmanager
def _host(bootstrap: str, layout: TopicLayout, handlers: dict[str, Callable[[Call], dict[str, Any]]],
          concurrency: int = 4) -> Iterator[tuple[threading.Event, list[BaseException], threading.Thread]]:
    """An agent host in this process, as ``stepstream run agents`` builds it (one producer, one keys reader);
    yields its stop event (SIGTERM sets it), where its crash lands, and the thread ``run`` runs on."""
    ensure_topics(AdminClient({"bootstrap.servers": bootstrap}), [layout.agent_spec(name) for name in handlers])
    kafka = KafkaSettings(bootstrap_servers=bootstrap, topic_prefix=layout.prefix, partitions=layout.partitions)
    stop = threading.Event()
    keys = DataKeys(bootstrap, layout.keys)
    output = EventProducer(bootstrap)
    loops = {name: build_agent(kafka, FAST, Agent(name, handler, stopping=stop), concurrency, keys=keys,
                               output=output.share()).run for name, handler in handlers.items()}
    crashes: list[BaseException] = []

    def run() -> None:
        try:
            AgentHost(loops, stop, drain_timeout_s=20, give_up=lambda code: crashes.append(SystemExit(code))).run()
        except BaseException as exc:
            crashes.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield stop, crashes, thread
    finally:
        stop.set()
        thread.join(timeout=60)
        keys.close()
        assert not thread.is_alive(), "the host did not stop"


def test_a_stuck_agent_in_the_host_does_not_stall_another_agents_requests(bootstrap: str, layout: TopicLayout) -> None:
    release = threading.Event()
    entered = threading.Event()

    def stuck(call: Call) -> dict[str, Any]:
        entered.set()
        release.wait(120)  # a call that does not come back (until the test lets it)
        return {"late": True}

    stuck_requests = [_request(f"s-{i}", "hang") for i in range(8)]  # more than its workers: it is full
    steady_requests = [_request(f"o-{i}", "work") for i in range(60)]
    with _host(bootstrap, layout, {"stuck": stuck, "steady": lambda call: {"done": call.request.task_id}}) as (
            stop, crashes, thread):
        _send(bootstrap, layout, "stuck", stuck_requests)
        assert entered.wait(60), "the stuck agent took its requests"
        _send(bootstrap, layout, "steady", steady_requests)

        steady = {r.attempt_id for r in steady_requests}
        assert wait_for(lambda: steady <= _inbox(bootstrap, layout)[0].keys(), timeout_s=60, interval_s=0.5), \
            "the steady agent answered every request while the other one's calls hung"
        answers, _taken = _inbox(bootstrap, layout)
        assert all(answers[a].ok for a in steady)
        assert not {r.attempt_id for r in stuck_requests} & answers.keys(), "the stuck agent's calls still hang"

        release.set()
        stop.set()  # what SIGTERM does
        thread.join(60)
        assert not thread.is_alive() and crashes == [], crashes
    answers, taken = _inbox(bootstrap, layout)
    stuck_taken = {r.attempt_id for r in stuck_requests} & taken
    assert stuck_taken and stuck_taken <= answers.keys(), "the drain finished the calls in flight and answered them"


class Broken(BaseException):
    """Not a fault of a call (those are answered): the agent's runtime itself breaks on it."""


def test_an_agent_crashing_in_the_host_ends_it_after_the_others_drained_and_a_restart_answers_the_rest(
    bootstrap: str, layout: TopicLayout,
) -> None:
    crashed = threading.Event()

    def crashing(call: Call) -> dict[str, Any]:
        if not crashed.is_set():
            crashed.set()
            raise Broken("the runtime breaks")
        return {"ok": True}

    def slow(call: Call) -> dict[str, Any]:
        time.sleep(1.0)
        return {"done": call.request.task_id}

    slow_requests = [_request(f"w-{i}", "work") for i in range(40)]
    handlers = {"crashing": crashing, "slow": slow}
    with _host(bootstrap, layout, handlers) as (_stop, crashes, thread):
        _send(bootstrap, layout, "slow", slow_requests)
        assert wait_for(lambda: len(_inbox(bootstrap, layout)[0]) >= 4, timeout_s=60), "the slow agent works"
        began = time.monotonic()
        _send(bootstrap, layout, "crashing", [_request("c-1", "boom")])
        thread.join(60)
        assert not thread.is_alive() and len(crashes) == 1 and isinstance(crashes[0], Broken), crashes
        assert time.monotonic() - began < 30, "the host ended at once, not after a timeout"
    answers, taken = _inbox(bootstrap, layout)
    slow_taken = {r.attempt_id for r in slow_requests} & taken
    assert slow_taken <= answers.keys(), "every call the other agent had in flight was finished and answered"
    assert len(answers) < len(slow_requests), "the crash ended the host before the other agent was done"

    with _host(bootstrap, layout, handlers):  # what `up` (or an orchestrator) does with the exit: a restart
        wanted = {r.attempt_id for r in slow_requests} | {"c-1:boom:1"}
        assert wait_for(lambda: wanted <= _inbox(bootstrap, layout)[0].keys(), timeout_s=90, interval_s=0.5)


def test_sigterm_drains_every_agent_of_the_host_answers_each_call_in_flight_and_exits_zero(system: System) -> None:
    agents = {"inventory": "inventory/reserve", "payments": "payments/charge"}
    ensure_topics(AdminClient({"bootstrap.servers": system.bootstrap}),
                  [system.layout.agent_spec(name) for name in agents])
    system.env["STEPSTREAM_AGENT_CONCURRENCY"] = "16"
    system.admin.set_faults(latency_ms=600)
    requests = {name: [_request(f"{name}-{i}", "step") for i in range(40)] for name in agents}
    for name, batch in requests.items():
        _send(system.bootstrap, system.layout, name, batch)
    system.procs.service("agents", "agents", *agents)
    system.procs.wait_started("agents")

    def in_flight_at_both() -> bool:
        started = system.admin.calls()["requests"]
        return all(len(started.get(op, {})) >= 4 for op in agents.values())

    assert wait_for(in_flight_at_both, timeout_s=60), system.procs.log("agents")[-3000:]
    assert system.procs.terminate("agents") == 0, system.procs.log("agents")[-3000:]

    answered = {attempt.split(":")[0] for attempt in _inbox(system.bootstrap, system.layout)[0]}
    for op in agents.values():
        started = {key.split(":")[0] for key in system.admin.calls()["requests"][op]}
        assert started <= answered, f"{op}: calls in flight at SIGTERM left unanswered: {sorted(started - answered)}"
    assert system.admin.calls()["in_flight"] == 0
