"""``stepstream up`` checks everything the project file names before it starts anything: a newcomer's
misspelt handler, misspelt agent table, missing service program or broken policy file is refused at once,
every problem in one line naming it (with the name it probably meant), instead of an "up" line followed by
a crash loop whose reason is only in a log file. A service whose command exits while ``up`` starts is
named with its exit code and the end of its log, and nothing is left running."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from agents.settings import AgentSettings
from scheduler.settings import SchedulerSettings
from stepstream.local.preflight import preflight
from stepstream.project.files import LoadedProject, load_project

ROOT = Path(__file__).parent.parent
TRAVEL = ROOT / "examples" / "travel"
LOANS = """
from scheduler.workflow import Compensation, Step, Workflow, WorkflowRegistry

REGISTRY = WorkflowRegistry.of([Workflow(name="loan", version=1, steps=(
    Step("hold", agent="credit-hold", compensation=Compensation("credit-release")),
    Step("contract", agent="contract-sign"),
))])


def contract_sign(call):
    return {"signed": True}
"""
HTTP_AGENTS = """
[services.credit]
url = "http://127.0.0.1:9"
SERVICE

[agents.credit-hold]
service = "credit"
path = "/hold"

[agents.credit-release]
service = "credit"
path = "/release"
"""


def _project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, agents: str,
             service: str = "") -> tuple[LoadedProject, SchedulerSettings]:
    """A loan project in ``tmp_path`` whose workflows module has a name no other test imported."""
    module = f"loans_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(LOANS)
    (tmp_path / "stepstream.toml").write_text(f'[project]\nworkflows = "{module}:REGISTRY"\n'
                                              + HTTP_AGENTS.replace("SERVICE", service)
                                              + agents.replace("MODULE", module))
    monkeypatch.syspath_prepend(str(tmp_path))
    return load_project(tmp_path / "stepstream.toml"), SchedulerSettings(workflows=f"{module}:REGISTRY")


def _problems(project: LoadedProject, workflows: SchedulerSettings, tmp_path: Path,
              agents: AgentSettings | None = None) -> list[str]:
    return preflight(project, workflows, agents or AgentSettings(policy_file=None), tmp_path / "home")


def test_a_project_that_holds_together_has_no_problem(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    project, workflows = _project(tmp_path, monkeypatch, '[agents.contract-sign]\nhandler = "MODULE:contract_sign"\n')
    assert _problems(project, workflows, tmp_path) == []
    monkeypatch.syspath_prepend(str(TRAVEL))
    travel = load_project(TRAVEL / "stepstream.toml")
    assert _problems(travel, SchedulerSettings(workflows=travel.spec.project.workflows), tmp_path) == []


def test_a_misspelt_handler_is_named_with_the_function_it_probably_meant(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    project, workflows = _project(tmp_path, monkeypatch, '[agents.contract-sign]\nhandler = "MODULE:contract_sgin"\n')
    [problem] = _problems(project, workflows, tmp_path)
    module = workflows.workflows.partition(":")[0]
    assert problem == (f"agent contract-sign: handler {module}:contract_sgin: {module} has no 'contract_sgin'; "
                       f"did you mean {module}:contract_sign?")


def test_a_misspelt_agent_table_is_named_with_the_agent_it_probably_meant(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    project, workflows = _project(tmp_path, monkeypatch, '[agents.contract-sgin]\nhandler = "MODULE:contract_sign"\n')
    assert _problems(project, workflows, tmp_path) == [
        f"workflows {workflows.workflows} name agents that {tmp_path / 'stepstream.toml'} does not declare: "
        "contract-sign (did you mean [agents.contract-sgin], which no workflow names?); declare each as "
        "[agents.NAME] (service and path, or handler)"]


def test_a_table_no_workflow_names_is_refused_with_the_names_they_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    project, workflows = _project(tmp_path, monkeypatch, '[agents.contract-sign]\nhandler = "MODULE:contract_sign"\n'
                                  '[agents.payout]\nservice = "credit"\n')
    assert _problems(project, workflows, tmp_path) == [
        f"[agents.payout] in {tmp_path / 'stepstream.toml'}: no workflow of {workflows.workflows} names agent "
        "payout (they name contract-sign, credit-hold, credit-release); remove the table or name the agent in a step"]


def test_every_problem_is_collected_a_missing_program_a_script_that_cannot_run_and_a_broken_policy_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    (tmp_path / "serve.sh").write_text("#!/bin/sh\n")  # not executable
    project, workflows = _project(tmp_path, monkeypatch, '[agents.contract-sign]\nhandler = "MODULE:contract_sgin"\n'
                                  '[services.ledger]\nurl = "http://127.0.0.1:9"\ncommand = ["ledgerd"]\n'
                                  '[services.payouts]\nurl = "http://127.0.0.1:9"\ncommand = ["./serve.sh"]\n')
    policy = tmp_path / "policy.toml"
    policy.write_text("[defaults.breaker]\nfailure_treshold = 3\n")
    problems = _problems(project, workflows, tmp_path, AgentSettings(policy_file=policy))
    assert len(problems) == 4, problems
    assert "has no 'contract_sgin'" in problems[0]
    assert problems[1] == "services.ledger.command: 'ledgerd' is not found on PATH"
    assert problems[2] == f"services.payouts.command: {tmp_path / 'serve.sh'} is not executable"
    assert problems[3].startswith(f"STEPSTREAM_AGENT_POLICY_FILE: policy file {policy}: ")
    assert "failure_treshold" in problems[3]


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPSTREAM_")}
    return {**env, "STEPSTREAM_HOME": str(tmp_path / "home")}


def test_up_with_a_misspelt_handler_starts_nothing_and_says_so_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, workflows = _project(tmp_path, monkeypatch, '[agents.contract-sign]\nhandler = "MODULE:contract_sgin"\n')
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "stepstream", "up"], cwd=tmp_path, env=_env(tmp_path),
                          capture_output=True, text=True, timeout=60, check=False)
    assert time.monotonic() - began < 60
    module = workflows.workflows.partition(":")[0]
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr.splitlines() == [
        f"stepstream: not started: agent contract-sign: handler {module}:contract_sgin: {module} has no "
        f"'contract_sgin'; did you mean {module}:contract_sign?"]
    assert not (tmp_path / "home").exists(), "nothing started, nothing written"


@pytest.mark.kafka
def test_up_with_a_service_that_exits_names_it_with_its_exit_code_and_its_last_words_and_stops(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, test_env: dict[str, str],
) -> None:
    exits = '["{python}", "-c", "import sys; print(\'ledger unreachable\'); sys.exit(3)"]'
    _project(tmp_path, monkeypatch, '[agents.contract-sign]\nhandler = "MODULE:contract_sign"\n',
             service=f"any_port = true\nhealth = \"/health\"\ncommand = {exits}\n")
    env = {k: v for k, v in test_env.items() if k not in ("STEPSTREAM_SCHEDULER_WORKFLOWS", "STEPSTREAM_PROJECT")}
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "stepstream", "up"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert time.monotonic() - began < 60
    assert done.returncode == 1, done.stderr
    lines = done.stderr.splitlines()
    cause = next(line for line in lines if line.startswith("not up:"))
    assert re.fullmatch(r"not up: service credit exited \(exit code 3\) before it answered at "
                        r"http://127\.0\.0\.1:\d+/health", cause), cause
    assert lines[lines.index(cause) + 2] == "    ledger unreachable", "the end of its log follows"
    assert "stopped: credit-service exit 3" in done.stderr and "Traceback" not in done.stderr
    assert not (Path(env["STEPSTREAM_HOME"]) / "up.json").exists()
