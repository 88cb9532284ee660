"""An agent process with many calls in flight, against the real broker and the real order service.

Requests are produced straight to ``agent.inventory`` (no scheduler), so each test controls exactly what
the agent sees; the answers are read back from ``inbox`` and the side effects counted at the service.
"""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime, timedelta

import pytest
from confluent_kafka.admin import AdminClient

from eventstore.replay import ReplayReader
from eventstore.topics import ensure_topics
from schemas.messages import AgentRequest, AttemptAccepted, StepResult
from tests.kafka_helpers import read_all, wait_for
from tests.system import System

pytestmark = pytest.mark.kafka

AGENT = "inventory"
OP = "inventory/reserve"


def _request(task_id: str, attempt: int = 1) -> AgentRequest:
    """A queued attempt as the scheduler makes it: to be taken within 5 minutes, a minute of work from then."""
    start_by = datetime.now(UTC) + timedelta(minutes=5)
    return AgentRequest(task_id=task_id, step="reserve", attempt=attempt, attempt_id=f"{task_id}:reserve:{attempt}",
                        idempotency_key=f"{task_id}:reserve", start_by=start_by, timeout_s=60,
                        complete_by=start_by + timedelta(seconds=60), calls_allowed=3,
                        input={"task": {"order_id": task_id, "sku": "A-1", "qty": 1}})


def _prepare(system: System, concurrency: int, latency_ms: int) -> None:
    ensure_topics(AdminClient({"bootstrap.servers": system.bootstrap}), [system.layout.agent_spec(AGENT)])
    system.env["STEPSTREAM_AGENT_CONCURRENCY"] = str(concurrency)
    system.admin.set_faults(latency_ms=latency_ms)


def _send(system: System, requests: list[AgentRequest]) -> None:
    for request in requests:
        system.producer.send(system.layout.agent(AGENT), request)
    system.producer.flush()


def _answers(system: System) -> dict[str, list[StepResult]]:
    """Every answer on inbox, by attempt id (an attempt redone after a crash may be answered twice)."""
    by_attempt: dict[str, list[StepResult]] = {}
    for record in ReplayReader(system.bootstrap, system.layout.inbox):
        if isinstance(record.message, StepResult):
            by_attempt.setdefault(record.message.attempt_id, []).append(record.message)
    return by_attempt


def _acknowledgements(system: System) -> Counter[str]:
    """How often each attempt was acknowledged on inbox (a request redone after a crash is taken again)."""
    return Counter(record.message.attempt_id for record in ReplayReader(system.bootstrap, system.layout.inbox)
                   if isinstance(record.message, AttemptAccepted))


def _all_answered(system: System, requests: list[AgentRequest], timeout_s: float = 90) -> dict[str, list[StepResult]]:
    wanted = {r.attempt_id for r in requests}
    found: dict[str, list[StepResult]] = {}

    def done() -> bool:
        found.update(_answers(system))
        return wanted <= found.keys()

    assert wait_for(done, timeout_s=timeout_s, interval_s=0.5), (
        f"{len(wanted - found.keys())} requests unanswered\n{system.logs_tail()}")
    return found


def _applied(system: System) -> dict[str, int]:
    return system.admin.calls()["applied"].get(OP, {})


def test_calls_of_one_task_arrive_one_after_another_in_offset_order_while_tasks_overlap(system: System) -> None:
    _prepare(system, concurrency=16, latency_ms=50)
    tasks = [f"order-{i}" for i in range(40)]
    # Three attempts of each task, interleaved with the other tasks' in the topic. Were two attempts of a
    # task in flight at once, the older would meet the newer's fence at the service and be refused (409).
    requests = [_request(task, attempt) for attempt in (1, 2, 3) for task in tasks]
    _send(system, requests)
    system.restart(AGENT)

    answers = _all_answered(system, requests)

    assert all(result.ok for results in answers.values() for result in results), "no call was fenced off"
    arrivals = system.admin.arrival_order(OP)
    assert {task: arrivals[f"{task}:reserve"] for task in tasks} == {task: [1, 2, 3] for task in tasks}
    assert system.admin.calls()["peak_in_flight"] >= 4, "calls of different tasks were in flight together"
    assert set(_applied(system).values()) == {1}


def test_an_agent_killed_with_dozens_of_calls_in_flight_is_restarted_and_answers_every_request_once_applied(
    system: System,
) -> None:
    _prepare(system, concurrency=32, latency_ms=400)
    requests = [_request(f"kill-{i}") for i in range(120)]
    _send(system, requests)
    system.restart(AGENT)
    assert wait_for(lambda: system.admin.calls()["in_flight"] >= 20, timeout_s=60), system.logs_tail()
    system.procs.kill(AGENT)
    system.restart(AGENT)

    answers = _all_answered(system, requests)

    assert all(results[-1].ok for results in answers.values())
    applied = _applied(system)
    assert len(applied) == len(requests), "no request was lost"
    assert set(applied.values()) == {1}, "no side effect was applied twice"
    assert sum(system.admin.calls()["requests"][OP].values()) > len(requests), "the killed calls were redone"
    acknowledged = _acknowledgements(system)
    assert set(acknowledged) == {r.attempt_id for r in requests}, "every request was acknowledged when taken"
    assert max(acknowledged.values()) >= 2, "a request redone after the crash was acknowledged again"


def test_sigterm_finishes_every_call_in_flight_answers_it_and_exits_zero(system: System) -> None:
    _prepare(system, concurrency=32, latency_ms=600)
    requests = [_request(f"drain-{i}") for i in range(80)]
    _send(system, requests)
    system.restart(AGENT)
    assert wait_for(lambda: system.admin.calls()["in_flight"] >= 10, timeout_s=60), system.logs_tail()

    assert system.procs.terminate(AGENT) == 0, system.procs.log(AGENT)[-3000:]

    started = {key.removesuffix(":reserve") for key in system.admin.calls()["requests"][OP]}
    answered = {attempt.removesuffix(":reserve:1") for attempt in _answers(system)}
    assert len(started) >= 10
    assert started <= answered, f"calls in flight at SIGTERM left unanswered: {sorted(started - answered)}"
    assert system.admin.calls()["in_flight"] == 0

    system.restart(AGENT)
    answers = _all_answered(system, requests)
    assert all(results[-1].ok for results in answers.values())
    assert set(_applied(system).values()) == {1} and len(_applied(system)) == len(requests)
    requests_per_key = system.admin.calls()["requests"][OP]
    assert set(requests_per_key.values()) == {1}, "after a drain nothing finished is redone, even above the watermark"


def test_a_poison_request_among_concurrent_ones_goes_to_the_dlq_and_every_other_request_completes(
    system: System,
) -> None:
    _prepare(system, concurrency=16, latency_ms=100)
    topic = system.layout.agent(AGENT)
    before = [_request(f"ok-{i}") for i in range(20)]
    after = [_request(f"ok-{i}") for i in range(20, 40)]
    _send(system, before)
    system.producer.send_raw(topic, b"ok-3", b"\x00not avro at all")  # undecodable, keyed like a live task
    system.producer.send(topic, StepResult(task_id="ok-5", step="reserve", attempt_id="ok-5:reserve:1", ok=True))
    _send(system, [*after, _request("ok-3", attempt=2)])  # the poison's task goes on behind it
    system.restart(AGENT)

    answers = _all_answered(system, [*before, *after, _request("ok-3", attempt=2)])

    assert all(result.ok for results in answers.values() for result in results)
    dead = read_all(system.bootstrap, system.layout.dlq, expect=2, timeout_s=20)
    reasons = Counter(dict(m.headers() or [])["stepstream.dlq.error.kind"].decode() for m in dead)
    assert len(dead) == 2 and {dict(m.headers() or [])["stepstream.dlq.origin.topic"] for m in dead} == {
        topic.encode()}, reasons
    assert system.admin.arrival_order(OP)["ok-3:reserve"] == [1, 2]
    assert system.procs.terminate(AGENT) == 0



def test_a_second_agent_joining_mid_burst_takes_partitions_over_without_losing_or_repeating_a_call(
    system: System,
) -> None:
    _prepare(system, concurrency=8, latency_ms=300)
    # 150 calls of 300 ms on 8 slots: about 6 s of calls, longer than a second agent takes to start and join.
    requests = [_request(f"rebalance-{i}") for i in range(150)]
    _send(system, requests)
    system.restart(AGENT)
    assert wait_for(lambda: system.admin.calls()["in_flight"] >= 4, timeout_s=60), system.logs_tail()
    system.procs.service("inventory-b", "agent", AGENT)  # the same group: the partitions are shared out anew
    system.procs.wait_started("inventory-b")

    answers = _all_answered(system, requests)

    assert all(results[-1].ok for results in answers.values())
    assert len(_applied(system)) == len(requests) and set(_applied(system).values()) == {1}
    assert set(system.admin.calls()["requests"][OP].values()) == {1}, (
        "the revoked partitions' calls in flight finished and were committed before the new owner started")
    # The first agent logs the revocation when the group settles, which may come after the last answer.
    assert wait_for(lambda: "partitions revoked" in system.procs.log(AGENT), timeout_s=60), system.logs_tail()
    assert f"{system.layout.agent(AGENT)}[" in system.procs.log("inventory-b"), "the new agent got partitions"
    assert system.procs.terminate("inventory-b") == 0 and system.procs.terminate(AGENT) == 0
