"""The project file (``stepstream.toml``) as a newcomer writes it: found where stepstream runs, validated as
a whole with one line naming the wrong field, its agents built, and the mistakes a newcomer meets first
(an unknown agent, an undeclared one, a workflows module that does not import) told in one line with the
fix, never a traceback. Nothing here needs a broker but the client's submission: each refusal comes before
anything connects."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest

from agents.policy import StaticPolicy
from agents.retry import RetryPolicy
from agents.runtime import Agent, Call, TransientError
from eventstore.settings import HOME_NAME, KafkaSettings
from eventstore.topics import TopicLayout
from scheduler.settings import SchedulerSettings
from schemas.codec import default_codec
from schemas.messages import AgentRequest, SubmitTask
from stepstream.client import Client
from stepstream.project.agents import AgentUnbuildable, declared_agent
from stepstream.project.files import (
    LoadedProject,
    ProjectRefused,
    UnknownAgent,
    configure,
    find_project,
    load_project,
    parse,
)
from stepstream.project.model import AgentDecl
from tests.kafka_helpers import read_all

ROOT = Path(__file__).parent.parent
TRAVEL = ROOT / "examples" / "travel"
WORKFLOWS = """
from scheduler.workflow import Compensation, Step, Workflow, WorkflowRegistry

REGISTRY = WorkflowRegistry.of([Workflow(name="trip", version=1, steps=(
    Step("flight", agent="flights", compensation=Compensation("flights-cancel")),
    Step("hotel", agent="hotels"),
))])
"""


def stepstream(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stepstream", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=60, check=False, env=env)


def test_the_travel_example_declares_an_agent_for_every_agent_its_workflows_name() -> None:
    project = load_project(TRAVEL / "stepstream.toml")
    assert project.spec.project.workflows == "travel.workflows:REGISTRY"
    assert set(project.spec.agents) == {"flights", "hotels", "payments", "flights-cancel", "hotels-cancel",
                                        "payments-refund"}
    flights = project.agent("flights")
    assert (flights.service, flights.path, flights.method) == ("travel", "/flights/book", "POST")
    assert flights.timeout_s == 3.0


def test_without_a_project_file_the_built_in_configuration_is_the_demo_with_every_agent_it_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("STEPSTREAM_PROJECT", raising=False)
    project = find_project(tmp_path)
    assert project.file is None and "built-in demo configuration" in project.where()
    assert project.spec.project.workflows == SchedulerSettings.model_fields["workflows"].default
    assert project.undeclared(SchedulerSettings().load_registry().agents) == []
    assert project.spec.services["orders"].command is not None, "up runs the demo's order service"


def test_the_project_file_is_found_in_the_working_folder_or_where_stepstream_project_points(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("STEPSTREAM_PROJECT", raising=False)
    assert find_project(TRAVEL).file == (TRAVEL / "stepstream.toml").resolve()
    monkeypatch.setenv("STEPSTREAM_PROJECT", str(TRAVEL))
    assert find_project(tmp_path).file == (TRAVEL / "stepstream.toml").resolve()
    monkeypatch.setenv("STEPSTREAM_PROJECT", str(tmp_path / "missing.toml"))
    with pytest.raises(ProjectRefused, match=r"STEPSTREAM_PROJECT=.*missing.toml: no project file there"):
        find_project(tmp_path)


@pytest.mark.parametrize(("toml", "says"), [
    ('[project]\nworkflows = "w:R"\n[agents.a]\nurl = "http://x"\ntimeout_s = 0\n',
     "f.toml: agents.a.timeout_s: Input should be greater than 0"),
    ('[project]\nworkflows = "w:R"\n[agents.a]\nurl = "http://x"\ntimout_s = 1\n',
     "f.toml: agents.a.timout_s: Extra inputs are not permitted"),
    ('[project]\nworkflows = "w:R"\n[agents.a]\nservice = "travel"\n',
     "f.toml: agents.a.service: no [services.travel] is declared"),
    ('[project]\nworkflows = "w:R"\n[agents.a]\nhandler = "m:f"\npath = "/x"\n',
     "f.toml: agents.a: a handler agent takes no service, url, path, method, timeout_s or headers"),
    ('[project]\nworkflows = "w:R"\n[agents.a]\npath = "/x"\n',
     "f.toml: agents.a: needs exactly one of service or url (an HTTP agent), or a handler"),
    ('[project]\nworkflows = "w:R"\n[services.s]\nurl = "localhost:80"\n',
     "f.toml: services.s.url: not an http(s) URL: 'localhost:80'"),
    ('[project]\nworkflows = "w:R"\n[agents.a]\nurl = "http://x"\nmethod = "GET"\n',
     "f.toml: agents.a.method: Input should be 'POST', 'PUT', 'PATCH' or 'DELETE'"),
    ('[agents.a]\nurl = "http://x"\n', "f.toml: project: Field required"),
    ('[project]\nworkflows = "w:R"\n[services.s]\nurl = "http://x"\ncommand = ["run", "{prot}"]\n',
     "f.toml: services.s.command: '{prot}': only {python}, {port}, {home}, {project} may be in braces"),
    ('[project\n', "f.toml: not valid TOML: "),
])
def test_a_wrong_project_file_is_refused_in_one_line_naming_the_field(toml: str, says: str) -> None:
    with pytest.raises(ProjectRefused) as refused:
        parse(toml, "f.toml")
    assert str(refused.value).startswith(says) and "\n" not in str(refused.value)


def test_an_undeclared_agent_name_lists_the_declared_ones() -> None:
    with pytest.raises(UnknownAgent) as unknown:
        load_project(TRAVEL / "stepstream.toml").agent("flightz")
    assert str(unknown.value) == (f"no agent 'flightz' is declared in {(TRAVEL / 'stepstream.toml').resolve()}; "
                                  "declared agents: flights, flights-cancel, hotels, hotels-cancel, payments, "
                                  "payments-refund")


def test_a_handler_agent_calls_the_function_it_names_and_an_unimportable_one_says_where_to_put_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    (tmp_path / "fraud_checks.py").write_text("def fraud(call):\n    return {'score': 0}\n")
    (tmp_path / "stepstream.toml").write_text('[project]\nworkflows = "w:R"\n[agents.fraud]\n'
                                              'handler = "fraud_checks:fraud"\n[agents.lost]\nhandler = "gone:f"\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    project = load_project(tmp_path / "stepstream.toml")
    policy = StaticPolicy(RetryPolicy())
    agent = declared_agent(project, "fraud", policy, threading.Event(), connections=1)
    assert isinstance(agent, Agent) and agent.name == "fraud" and agent.dependency == "fraud"
    assert agent.handler.__name__ == "fraud"
    with pytest.raises(AgentUnbuildable, match=r"agent lost: handler gone:f cannot be loaded \(No module named "
                                               r"'gone'\); its module must be importable from the project folder"):
        declared_agent(project, "lost", policy, threading.Event(), connections=1)


def test_an_agent_of_a_service_shares_its_dependency_and_one_with_its_own_url_has_its_own() -> None:
    assert AgentDecl(service="travel").dependency == "travel"
    assert AgentDecl(url="http://127.0.0.1:1").dependency is None


def test_run_agent_with_an_unknown_name_exits_non_zero_with_one_line_listing_the_declared_agents() -> None:
    done = stepstream("run", "agent", "flightz", cwd=TRAVEL)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.splitlines() == [
        f"stepstream: no agent 'flightz' is declared in {(TRAVEL / 'stepstream.toml').resolve()}; declared agents: "
        "flights, flights-cancel, hotels, hotels-cancel, payments, payments-refund"]


def test_up_refuses_to_start_naming_the_agents_a_workflow_names_and_nothing_declares(tmp_path: Path) -> None:
    (tmp_path / "trips.py").write_text(WORKFLOWS)
    (tmp_path / "stepstream.toml").write_text('[project]\nworkflows = "trips:REGISTRY"\n'
                                              '[agents.flights]\nurl = "http://127.0.0.1:9"\n')
    done = stepstream("up", cwd=tmp_path, env=_env(tmp_path))
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.splitlines() == [
        f"stepstream: not started: workflows trips:REGISTRY name agents that {tmp_path / 'stepstream.toml'} does not "
        "declare: flights-cancel, hotels; declare each as [agents.NAME] (service and path, or handler)"]
    assert not (tmp_path / "home").exists(), "nothing started, nothing written"


def test_an_unimportable_workflows_module_is_one_line_saying_where_it_must_be(tmp_path: Path) -> None:
    (tmp_path / "stepstream.toml").write_text('[project]\nworkflows = "travel_plans.workflows:REGISTRY"\n')
    done = stepstream("submit", "trip", "--input", "{}", cwd=tmp_path, env=_env(tmp_path))
    assert done.returncode == 1 and done.stderr.splitlines() == [
        "stepstream: workflows travel_plans.workflows:REGISTRY: cannot import travel_plans.workflows (No module "
        "named 'travel_plans'); it must be importable from the project folder (the one holding stepstream.toml, "
        "where stepstream runs) or from PYTHONPATH"]


def _env(tmp_path: Path) -> dict[str, str]:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPSTREAM_")}
    return {**env, "STEPSTREAM_HOME": str(tmp_path / "home")}


class _Recorder(BaseHTTPRequestHandler):
    """A real HTTP endpoint that records what it was sent; ``/slow`` answers after a second."""

    seen: ClassVar[list[dict[str, Any]]] = []

    def _answer(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.seen.append({"method": self.command, "path": self.path, "headers": dict(self.headers),
                          "body": json.loads(body or b"null")})
        if self.path.endswith("/slow"):
            time.sleep(1.0)
            return  # the caller gave up already
        answer = b'{"booked": "yes"}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    do_PUT = do_POST = _answer

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def recorder() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Recorder.seen.clear()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_an_http_agent_sends_its_method_and_headers_with_the_key_and_attempt_and_caps_each_call(recorder: str) -> None:
    project = LoadedProject(parse(
        f'[project]\nworkflows = "w:R"\n[services.rooms]\nurl = "{recorder}/v1"\n'
        '[agents.rooms]\nservice = "rooms"\npath = "/book"\nmethod = "PUT"\nheaders = { "X-Client" = "travel" }\n'
        '[agents.slow]\nservice = "rooms"\npath = "/slow"\ntimeout_s = 0.3\n', "f.toml"), None)
    policy = StaticPolicy(RetryPolicy())
    request = AgentRequest(task_id="t-1", step="hotel", attempt=2, attempt_id="t-1:hotel:2",
                           idempotency_key="t-1:hotel", complete_by=datetime.now(UTC) + timedelta(seconds=30),
                           calls_allowed=3, input={"task": {"trip_id": "t-1"}})
    rooms = declared_agent(project, "rooms", policy, threading.Event(), connections=1)
    assert rooms.dependency == "rooms" and rooms.handler(Call(request, timeout_s=10.0)) == {"booked": "yes"}
    sent = _Recorder.seen[0]
    assert (sent["method"], sent["path"], sent["body"]) == ("PUT", "/v1/book", {"trip_id": "t-1"})
    assert {k: sent["headers"][k] for k in ("X-Client", "Idempotency-Key", "X-Attempt")} == {
        "X-Client": "travel", "Idempotency-Key": "t-1:hotel", "X-Attempt": "2"}
    slow = declared_agent(project, "slow", policy, threading.Event(), connections=1)
    with pytest.raises(TransientError, match=r"/slow: timed out after 0\.3s"):
        slow.handler(Call(request, timeout_s=10.0))


@pytest.mark.kafka
def test_the_python_client_in_a_project_subfolder_submits_to_the_projects_workflows_with_no_variable_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bootstrap: str, layout: TopicLayout,
) -> None:
    module = f"trips_{uuid.uuid4().hex[:8]}"  # a name no earlier test imported
    (tmp_path / f"{module}.py").write_text(WORKFLOWS)
    (tmp_path / "stepstream.toml").write_text(f'[project]\nworkflows = "{module}:REGISTRY"\n')
    (tmp_path / "scripts").mkdir()
    for name in [name for name in os.environ if name.startswith("STEPSTREAM_")]:
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path / "scripts")
    # Only where the shared test broker is, and this test's topics: nothing of the workflows.
    kafka = {"bootstrap_servers": bootstrap, "topic_prefix": layout.prefix, "partitions": layout.partitions}
    with Client(kafka=KafkaSettings(**kafka)) as client:
        task_id = client.submit("trip", {"destination": "Lisbon"})
    assert KafkaSettings(**kafka).home == tmp_path / HOME_NAME, "the project folder keeps its local state"
    [message] = read_all(bootstrap, layout.inbox, expect=1)
    submitted = default_codec().decode(message.value())
    assert isinstance(submitted, SubmitTask)
    assert (submitted.task_id, submitted.workflow, submitted.workflow_version) == (task_id, "trip", None)


def test_without_stepstream_home_a_projects_state_is_kept_in_its_own_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    (tmp_path / "stepstream.toml").write_text('[project]\nworkflows = "trips:REGISTRY"\n')
    monkeypatch.delenv("STEPSTREAM_HOME", raising=False)
    monkeypatch.delenv("STEPSTREAM_PROJECT", raising=False)
    monkeypatch.chdir(tmp_path)
    configure()
    assert KafkaSettings().home == tmp_path / HOME_NAME
    monkeypatch.setenv("STEPSTREAM_HOME", str(tmp_path / "elsewhere"))
    configure()
    assert KafkaSettings().home == tmp_path / "elsewhere", "the variable still wins"


def test_submit_help_marks_the_input_fields_a_workflow_seals(tmp_path: Path) -> None:
    (tmp_path / "loans.py").write_text(
        "from pydantic import BaseModel\nfrom scheduler.workflow import Step, Workflow, WorkflowRegistry\n\n"
        "class Loan(BaseModel):\n    amount: int\n    iban: str\n\n"
        "REGISTRY = WorkflowRegistry.of([Workflow(name='loan', version=1, input_model=Loan, "
        "sensitive_input=frozenset({'iban'}), steps=(Step('payout', agent='payout', opens=frozenset({'iban'})),))])\n")
    (tmp_path / "stepstream.toml").write_text('[project]\nworkflows = "loans:REGISTRY"\n')
    done = stepstream("submit", "--help", cwd=tmp_path, env=_env(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "  loan v1: amount (integer, required), iban (string, required, sealed)" in done.stdout.splitlines()
