"""The write side of the HTTP API against the real system: POST /api/tasks (201, 200, 409, 422, 429, 401)
and operator commands, each answer checked against what reached Kafka."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from eventstore.topics import TopicLayout
from projections.lag import LagReader
from projections.store import SqliteStore
from scheduler.workflow import WorkflowRegistry
from schemas.codec import default_codec
from schemas.messages import OperatorCommand, StatusUpdate, SubmitTask, TaskAccepted
from schemas.states import TERMINAL
from stepstream.http.admission import GlobalAdmission
from stepstream.http.app import create_app
from stepstream.http.settings import ApiSettings
from stepstream.http.writer import TaskWriter
from stepstream.http.writes import write_router
from tests.kafka_helpers import read_all, read_to_end, wait_for
from tests.system import System
from tests.workflows import LENIENT, REGISTRY

pytestmark = pytest.mark.kafka

SHOP = {"Authorization": "Bearer shop-secret"}
OPS = {"Authorization": "Bearer ops-secret"}
ORDER = {"order_id": "o-1", "sku": "A-1", "qty": 1, "amount": 10}


class Api:
    """The API process's parts, in this process: the app over the system's store, writing to its topics."""

    def __init__(self, system: System, registry: WorkflowRegistry = REGISTRY, **settings: Any) -> None:
        self.system = system
        self.settings = ApiSettings(tokens={"shop": "shop-secret", "ops": "ops-secret"}, retry_after_s=2,
                                    decision_timeout_s=20, admission_refresh_s=0.2, **settings)
        system.store_path.parent.mkdir(parents=True, exist_ok=True)
        self.store = SqliteStore(system.store_path)
        lag = LagReader(system.bootstrap, system.layout.prefix, cache_s=0.2)
        admission = GlobalAdmission(self.store, lag, system.layout, self.settings.max_in_flight,
                                    self.settings.admission_refresh_s)
        self.writer = TaskWriter(bootstrap=system.bootstrap, layout=system.layout, store=self.store,
                                 registry=registry, admission=admission, settings=self.settings)
        self.http = TestClient(create_app(self.store, system.layout, lag, [write_router(self.writer, self.settings)]))

    def submit(self, task_id: str, data: dict[str, Any] | None = None, headers: dict[str, str] | None = None,
               **extra: Any) -> Any:
        body = {"workflow": "orders", "version": 1, "input": data or {**ORDER, "order_id": task_id},
                "task_id": task_id, **extra}
        return self.http.post("/api/tasks", json=body, headers=SHOP if headers is None else headers)

    def close(self) -> None:
        self.http.close()
        self.writer.close()
        self.store.close()


@pytest.fixture
def api(system: System) -> Iterator[Api]:
    opened = Api(system)
    try:
        yield opened
    finally:
        opened.close()


def requests_on_inbox(bootstrap: str, layout: TopicLayout) -> list[SubmitTask | OperatorCommand]:
    """The submissions and operator commands on ``inbox`` (agents' results go there too), read to its end."""
    codec = default_codec()
    decoded = [codec.decode(m.value()) for m in read_to_end(bootstrap, layout.inbox)]
    return [m for m in decoded if isinstance(m, SubmitTask | OperatorCommand)]


def inbox(api: Api) -> list[SubmitTask | OperatorCommand]:
    """What reached ``inbox`` once the API's producer has nothing left unacknowledged: whatever a request
    produced, even one it refused, is there, with no waiting for it."""
    assert api.writer.flush() == 0
    return requests_on_inbox(api.system.bootstrap, api.system.layout)


def test_a_posted_task_gets_201_its_repeat_200_and_it_runs_once(system: System, api: Api) -> None:
    system.start()
    created = api.submit("http-1")
    assert created.status_code == 201, created.text
    assert created.headers["location"] == "/api/tasks/http-1"
    assert created.json()["status"] == "accepted"
    assert system.wait_terminal(["http-1"]) == {"http-1": "completed"}
    repeat = api.submit("http-1")
    assert repeat.status_code == 200 and repeat.json()["status"] == "completed"
    assert api.http.get("/api/tasks/http-1").json()["status"] == "completed"
    assert len([e for e in system.events("http-1") if isinstance(e, TaskAccepted)]) == 1
    assert system.admin.applied_for("payments/charge", "http-1:charge") == 1
    assert len(inbox(api)) == 1, "the repeat produced nothing"
    codec = default_codec()
    updates = [codec.decode(m.value()) for m in read_all(system.bootstrap, system.layout.status("shop"),
                                                         expect=5, timeout_s=10)]
    statuses = [u.status for u in updates if isinstance(u, StatusUpdate) and u.task_id == "http-1"]
    assert statuses[0] == "accepted" and statuses[-1] == "completed", "the token holder's reply topic"


def test_a_token_may_only_name_its_own_reply_topic(system: System, api: Api) -> None:
    refused = api.submit("someone-else", submitter="ops")
    assert refused.status_code == 403 and "own reply topic" in refused.json()["detail"]
    assert inbox(api) == []


def test_a_body_past_the_size_limit_gets_413_and_nothing_reaches_kafka(system: System, api: Api) -> None:
    refused = api.submit("too-big", {"blob": "x" * 1_100_000})
    assert refused.status_code == 413, refused.text
    assert inbox(api) == []


def test_the_same_id_with_other_data_gets_409_and_nothing_reaches_kafka(system: System, api: Api) -> None:
    system.start()
    assert api.submit("http-2").status_code == 201
    assert wait_for(lambda: api.store.task("http-2") is not None, 30)
    clash = api.submit("http-2", {**ORDER, "qty": 7})
    assert clash.status_code == 409 and "other data" in clash.json()["detail"]
    other_version = api.submit("http-2", version=2)
    assert other_version.status_code == 409
    submitted = [m for m in inbox(api) if isinstance(m, SubmitTask)]
    assert len(submitted) == 1 and submitted[0].input["qty"] == 1
    assert system.wait_terminal(["http-2"]) == {"http-2": "completed"}


@pytest.mark.parametrize(
    ("headers", "detail"),
    [({}, "missing bearer token"), ({"Authorization": "Bearer wrong"}, "invalid bearer token"),
     ({"Authorization": "Basic c2hvcDpzaG9wLXNlY3JldA=="}, "missing bearer token")],
    ids=["no token", "wrong token", "not a bearer token"],
)
def test_writes_without_a_valid_token_get_401_and_nothing_reaches_kafka(
    system: System, api: Api, headers: dict[str, str], detail: str,
) -> None:
    refused = api.submit("nope", headers=headers)
    assert refused.status_code == 401 and detail in refused.json()["detail"]
    assert refused.headers["www-authenticate"] == "Bearer"
    invalid_too = api.http.post("/api/tasks", json={"workflow": ""}, headers=headers)
    assert invalid_too.status_code == 401, "no token: refused before the body is even judged"
    command = api.http.post("/api/tasks/nope/commands", json={"action": "cancel"}, headers=headers)
    assert command.status_code == 401
    assert inbox(api) == []


def test_with_no_token_configured_writes_are_refused(system: System, api: Api) -> None:
    closed = TestClient(create_app(api.store, system.layout, None, [write_router(api.writer, ApiSettings())]))
    refused = closed.post("/api/tasks", json={"workflow": "orders", "input": ORDER}, headers=SHOP)
    assert refused.status_code == 401 and "no API token is configured" in refused.json()["detail"]
    assert inbox(api) == []


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"workflow": "no-such", "input": ORDER}, "workflow"),
        ({"workflow": "orders", "version": 9, "input": ORDER}, "version"),
        ({"workflow": "orders", "version": 0, "input": ORDER}, "version"),
        ({"workflow": "orders", "input": [1, 2]}, "input"),
        ({"workflow": "orders", "input": {"n": 2**70}}, "input"),
        ({"workflow": "orders", "input": ORDER, "task_id": ""}, "task_id"),
        ({"workflow": "orders", "input": ORDER, "submitter": "../other"}, "submitter"),
        ({"workflow": "orders", "input": ORDER, "priority": 1}, "priority"),
        ({"input": ORDER}, "workflow"),
        ({"workflow": "orders-typed", "input": {k: v for k, v in ORDER.items() if k != "amount"}}, "input.amount"),
    ],
    ids=["unknown workflow", "unknown version", "version 0", "input not an object", "integer past 64 bits",
         "empty task id", "submitter not a name", "unknown field", "workflow missing", "input without amount"],
)
def test_invalid_submissions_get_422_naming_the_field_and_nothing_reaches_kafka(
    system: System, api: Api, body: dict[str, Any], field: str,
) -> None:
    refused = api.http.post("/api/tasks", json=body, headers=SHOP)
    assert refused.status_code == 422, refused.text
    [error] = refused.json()["detail"]
    assert error["loc"] == ["body", *field.split(".")], error
    assert inbox(api) == []


def test_an_input_the_scheduler_refuses_gets_422_with_its_reason_not_429(system: System) -> None:
    system.start("projector", "scheduler")
    behind = Api(system, registry=LENIENT)  # this API's workflows file is older than the scheduler's
    try:
        answer = behind.http.post("/api/tasks", headers=SHOP, json={
            "workflow": "orders-typed", "version": 1, "input": {"order_id": "x"}, "task_id": "api-behind"})
    finally:
        behind.close()
    assert answer.status_code == 422, answer.text
    assert answer.json()["detail"].startswith("invalid input for 'orders-typed' v1: sku: Field required")
    assert "Retry-After" not in answer.headers


def test_the_openapi_of_a_submission_lists_each_workflow_and_its_input_fields(api: Api) -> None:
    described = api.http.get("/openapi.json").json()["paths"]["/api/tasks"]["post"]["description"]
    assert ("- orders-typed v1: order_id (string, required), sku (string, required), qty (integer, required), "
            "amount (number, required)") in described.splitlines()


def test_with_the_service_down_submissions_past_the_bound_get_429_until_it_returns(system: System) -> None:
    system.env["STEPSTREAM_SCHEDULER_MAX_IN_FLIGHT"] = "2"  # per inbox partition: the scheduler's own bound
    system.admin.set_faults("inventory/reserve", hang=True, hang_max_s=60)  # the remote service is down
    system.start()
    bound = 3
    api = Api(system, max_in_flight=bound)
    peak = 0
    sampling = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not sampling.is_set():
            live = sum(n for s, n in api.store.counts_by_status().items() if s not in TERMINAL)
            peak = max(peak, live)
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        answers = {f"busy-{i}": api.submit(f"busy-{i}") for i in range(10)}
        codes = {task_id: r.status_code for task_id, r in answers.items()}
        admitted = [t for t, c in codes.items() if c == 201]
        refused = [t for t, c in codes.items() if c == 429]
        assert set(codes.values()) <= {201, 429}, codes
        assert 0 < len(admitted) <= bound and refused, codes
        assert all(answers[t].headers["retry-after"] == "2" for t in refused)
        # Once the store shows every admitted task, a task let through past the bound would show too.
        assert wait_for(lambda: all(api.store.task(t) is not None for t in admitted), 30)
        live = sum(n for s, n in api.store.counts_by_status().items() if s not in TERMINAL)
        assert max(peak, live) <= bound, f"{max(peak, live)} tasks in flight, the bound is {bound}"
        system.admin.clear_faults("inventory/reserve")
        assert set(system.wait_terminal(admitted, 90).values()) == {"completed"}
        # Retried after Retry-After under the same task id, a refused task is admitted and runs.
        retried = api.submit(refused[0])
        assert retried.status_code == 201, retried.text
        # Its first submission's rejection is terminal and may still be what the store shows: wait for the run.
        assert wait_for(lambda: (system.task(refused[0]) or {}).get("status") == "completed", 60), \
            system.task(refused[0])
    finally:
        sampling.set()
        sampler.join(2)
        api.close()
    assert peak <= bound


def test_operator_commands_over_http_are_answered_with_the_schedulers_outcome(system: System, api: Api) -> None:
    system.start()
    refused_order = {**ORDER, "order_id": "bad", "qty": 0}  # the inventory service refuses it: error
    assert api.submit("op-1", refused_order).status_code == 201
    assert system.wait_terminal(["op-1"]) == {"op-1": "error"}
    missing = api.http.post("/api/tasks/no-such/commands", json={"action": "compensate"}, headers=OPS)
    assert missing.status_code == 404
    body = {"action": "compensate", "command_id": "cmd-1"}
    accepted = api.http.post("/api/tasks/op-1/commands", json=body, headers=OPS)
    assert accepted.status_code == 200, accepted.text
    assert accepted.json()["outcome"] == "accepted" and accepted.json()["command_id"] == "cmd-1"
    # The scheduler's answer comes before the store shows it: until CompensationStarted is projected, the
    # task still reads "error", which is terminal too.
    assert wait_for(lambda: any(r["event_type"] == "CompensationStarted" for r in api.store.history("op-1")), 30)
    assert system.wait_terminal(["op-1"])["op-1"] in ("compensated", "compensation_failed")
    again = api.http.post("/api/tasks/op-1/commands", json=body, headers=OPS)
    assert again.status_code == 200 and again.json()["outcome"] == "accepted", "answered from the record"
    refused = api.http.post("/api/tasks/op-1/commands", json={"action": "cancel"}, headers=OPS)
    assert refused.status_code == 409 and refused.json()["outcome"] == "refused"
    commands = [m for m in inbox(api) if isinstance(m, OperatorCommand)]
    assert [(c.command_id == "cmd-1", c.action, c.operator) for c in commands][:1] == [(True, "compensate", "ops")]
    assert len(commands) == 2, "the repeated command id was answered without sending it again"


def test_the_served_api_process_takes_submissions_over_http_and_drains_on_sigterm(system: System) -> None:
    system.env["STEPSTREAM_API_TOKENS"] = '{"shop": "shop-secret"}'
    system.env["STEPSTREAM_API_DECISION_TIMEOUT_S"] = "30"
    system.start()
    with system.start_api() as http:
        body = {"workflow": "orders", "version": 1, "input": {**ORDER, "order_id": "served"}, "task_id": "served"}
        assert http.post("/api/tasks", json=body).status_code == 401
        created = http.post("/api/tasks", json=body, headers=SHOP)
        assert created.status_code == 201, created.text
        assert system.wait_terminal(["served"]) == {"served": "completed"}
        assert http.get("/api/tasks/served").json()["status"] == "completed"
        assert 'stepstream_api_writes_total{answer="201",endpoint="submit"} 1.0' in http.get("/metrics").text
    assert system.procs.terminate("api") == 0


def test_the_api_process_stopped_by_sigterm_during_start_up_exits_0(system: System) -> None:
    system.env["STEPSTREAM_API_TOKENS"] = '{"shop": "shop-secret"}'  # so it connects to Kafka while starting
    system.procs.start("api", "stepstream", "serve", "api", "--port", "0")
    system.procs.wait_started("api")  # armed: from here a SIGTERM is a stop, even before it listens
    assert system.procs.terminate("api") == 0, system.procs.log("api")[-2000:]


def test_a_submission_retried_after_the_api_was_killed_mid_request_runs_once(system: System) -> None:
    system.env["STEPSTREAM_API_TOKENS"] = '{"shop": "shop-secret"}'
    system.env["STEPSTREAM_API_DECISION_TIMEOUT_S"] = "30"
    system.start("projector")  # no scheduler yet: the request waits for a decision nobody makes
    body = {"workflow": "orders", "version": 1, "input": {**ORDER, "order_id": "killed"}, "task_id": "killed"}
    with system.start_api() as http:
        answers: list[int] = []

        def post() -> None:
            with contextlib.suppress(httpx.HTTPError):  # the connection dies with the process
                answers.append(http.post("/api/tasks", json=body, headers=SHOP).status_code)

        posting = threading.Thread(target=post, daemon=True)
        posting.start()

        # The submission on inbox (nothing else writes there yet): the request is past the produce.
        assert read_all(system.bootstrap, system.layout.inbox, expect=1, timeout_s=30), "no submission produced"
        system.procs.kill("api")  # SIGKILL with the submission on inbox and its answer not sent
        posting.join(10)
        assert answers == [], "answered before the kill: nothing was tested"
    system.start("scheduler")  # no agents yet: the task stays in flight
    assert wait_for(lambda: system.task("killed") is not None, 60), "the scheduler never decided the submission"
    with system.start_api() as http:  # the client retries with the same task id, as Retry-After tells it
        retried = http.post("/api/tasks", json=body, headers=SHOP)
        assert retried.status_code in (200, 201), retried.text
    system.start("inventory", "payments", "shipping")
    assert system.wait_terminal(["killed"]) == {"killed": "completed"}
    assert len([e for e in system.events("killed") if isinstance(e, TaskAccepted)]) == 1
    assert system.admin.applied_for("payments/charge", "killed:charge") == 1


def test_without_tokens_the_api_serves_reads_with_no_kafka_cluster_and_refuses_writes(system: System) -> None:
    system.env["STEPSTREAM_BOOTSTRAP_SERVERS"] = "127.0.0.1:1"  # nothing listens there
    with system.start_api() as http:
        assert http.get("/api/counts").status_code == 200
        refused = http.post("/api/tasks", json={"workflow": "orders", "input": ORDER}, headers=SHOP)
        assert refused.status_code == 401 and "no API token is configured" in refused.json()["detail"]
    assert system.procs.terminate("api") == 0
