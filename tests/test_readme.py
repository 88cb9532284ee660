"""The README and every page of ``docs/`` as a reader uses them: every command of their shell blocks is one
the project accepts (the CLI parses it, a make target, a request the API takes, a module that exists), an
input given to a workflow of the demo's registry is valid for that workflow's version (on the command line,
in an HTTP body or in a Python ``submit``), their Python blocks compile and import only what exists, their
TOML policies are valid, every repository file and relative link they name exists, and ``stepstream`` alone
shows the commands they describe. A page edit that breaks any of them fails here, without Kafka.

A workflow the demo's registry does not have (a page about another project's workflows) has its input left
unchecked, and ``cd`` or a ``curl`` read pass as they are; a ``stepstream`` command is always parsed.
What each command does against a live system is tested where that behaviour is (tests/test_up.py,
test_submission*.py, test_kafka_unreachable.py, ...)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from agents.policy import parse_policy
from demo.workflows import REGISTRY
from stepstream.cli import build_parser
from stepstream.client import Client
from stepstream.http.bodies import CommandRequest, SubmissionRequest
from stepstream.project.files import parse as parse_project
from tests.test_compose import SETTINGS, services

ROOT = Path(__file__).parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PACKAGES = "docs|examples|schemas|eventstore|projections|scheduler|agents|supervisor|stepstream|demo|tests|benchmarks"
# Named by the README before they land: the page on one's own system and its example are written on
# another branch (once merged, they exist and these names change nothing).
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
CHECKED_LANGUAGES = {"sh", "bash", "python", "toml", "properties"}
SHOWN_OUTPUT = "text"  # what a command prints, shown to the reader: nothing to run or parse
TRAVEL = ROOT / "examples" / "travel"
TRAVEL_PORT = 8300
sys.path.insert(0, str(TRAVEL))  # the travel example's folder, as its stepstream.toml puts it on the path
TRAVEL_APP: Any = importlib.import_module("travel.service").create_app()
TRAVEL_REGISTRY: Any = importlib.import_module("travel.workflows").REGISTRY

KNOWN_VARIABLES = {f"{settings.model_config.get('env_prefix', '')}{name}".upper()
                   for settings in SETTINGS for name in settings.model_fields} | {
    name for path in [ROOT / "Makefile", *(ROOT / "tests").glob("*.py"), *(ROOT / "benchmarks").glob("*.py")]
    for name in re.findall(r"STEPSTREAM_\w+", path.read_text())}


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def _blocks(page: Path, language: str) -> list[str]:
    return [body for found, body in FENCE.findall(page.read_text()) if found == language]


def _shell_lines(page: Path) -> list[str]:
    """Each command of the page's shell blocks: continuations joined, comments dropped, ``[--option N]``
    given (N as 1), so an option the page shows is checked too."""
    lines = []
    for block in _blocks(page, "sh"):
        for line in block.replace("\\\n", " ").splitlines():
            command = re.sub(r"\[([^]]*)\]", r"\1", re.sub(r"(^|\s)#\s.*$", "", line))
            lines.append(re.sub(r"(?<=\s)N(?=\s|$)", "1", command).strip())
    return [line for line in lines if line]


def _check_input(workflow: str, version: int | None, data: Any) -> None:
    """``data`` is valid input for that version of a workflow of the demo's or the travel example's registry
    (the latest without one); another project's workflow is not known here and is left unchecked."""
    registry = next((r for r in (REGISTRY, TRAVEL_REGISTRY) if workflow in {w.name for w in r.workflows()}), None)
    if registry is not None:
        errors = registry.get(workflow, version).input_errors(data)
        assert errors == [], f"{workflow} v{version or 'latest'}: {errors}"


def _check_variable(name: str) -> None:
    assert name in KNOWN_VARIABLES, f"{name}: no setting, test or benchmark reads it"


def _check_stepstream(args: list[str]) -> None:
    try:
        parsed = build_parser().parse_args(args)  # argparse exits 2 on anything it does not accept
    except SystemExit as exit:
        if exit.code != 0:
            raise
        return  # --help
    if parsed.command == "submit":
        raw: str = parsed.input
        source = ROOT / raw[1:] if raw.startswith("@") else None
        if source is None:
            _check_input(parsed.workflow, parsed.version, json.loads(raw))
        elif source.is_file():  # a file the page names from the repository; one the reader writes is not here
            _check_input(parsed.workflow, parsed.version, json.loads(source.read_text()))


def _check_request(args: list[str]) -> None:
    url = urlsplit(next(arg for arg in args if arg.startswith("http")))
    path = url.path
    if url.port == TRAVEL_PORT:  # the travel example's own service: one of its routes
        assert path in {route.path for route in TRAVEL_APP.routes}, path
        return
    if "-d" not in args:
        return  # a read: nothing to validate but the URL's shape
    body = json.loads(args[args.index("-d") + 1])
    assert "Content-Type: application/json" in args, "a body without it is not read as JSON (422)"
    if path == "/api/tasks":
        submission = SubmissionRequest.model_validate(body)
        _check_input(submission.workflow, submission.version, submission.input)
    elif re.fullmatch(r"/api/tasks/[^/]+/commands", path):
        CommandRequest.model_validate(body)
    else:
        pytest.fail(f"no write endpoint at {path}")


def _check_python_run(args: list[str]) -> None:
    if args[0] == "-c":
        _check_python(args[1])
        return
    assert args[0] == "-m", args
    assert importlib.util.find_spec(args[1]) is not None or (TRAVEL / (args[1].replace(".", "/") + ".py")).is_file(), \
        f"no module {args[1]}"
    if args[1] == "pytest":
        named = [arg.split("::")[0] for arg in args[2:] if arg.startswith("tests/")]
        assert all((ROOT / path).exists() for path in named), named


def _check_command(line: str) -> None:
    """One shell command a page shows, checked against the project; a program it cannot check fails."""
    words = shlex.split(line)
    while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):  # VAR=value before the command
        _check_variable(words.pop(0).split("=")[0])
    program, *args = words
    program = re.sub(r"^(\.\./)+", "", program)  # run from an example's folder, e.g. examples/travel
    if program in {".venv/bin/stepstream", "stepstream"}:
        _check_stepstream(args)
    elif program == "make":
        targets = re.search(r"^\.PHONY:(.*)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
        assert targets is not None and set(args) <= set(targets.group(1).split())
    elif program == "curl":
        _check_request(args)
    elif program == ".venv/bin/python":
        _check_python_run(args)
    elif program == "export":
        for assignment in args:
            _check_variable(assignment.split("=")[0])
    elif program == "docker":
        assert args[:2] == ["compose", "up"] and {arg for arg in args[2:] if not arg.startswith("-")} <= set(services())
    elif program == "kafka-configs.sh":
        assert "--bootstrap-server" in args and "--entity-name" in args
    elif program != "cd":  # a page may change into a folder of its own
        pytest.fail(f"a command this test does not know how to check: {line}")


def _literal(node: ast.expr) -> Any:
    try:
        return ast.literal_eval(node)
    except ValueError:
        return None  # not written out in the block (a variable, a call): nothing to check


def _check_python(source: str) -> None:
    """Compiles; every import names a module (and attribute) that exists; ``client.<name>`` is the
    client's; a ``submit``/``build_submission`` of a literal input is valid for its workflow."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                importlib.import_module(alias.name)
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name) or importlib.util.find_spec(f"{node.module}.{alias.name}"), \
                    f"{node.module} has no {alias.name}"
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "client":
            assert hasattr(Client, node.attr), f"Client has no {node.attr}"
        elif isinstance(node, ast.Call) and len(node.args) >= 2 and _submits(node.func):
            workflow, data = _literal(node.args[0]), _literal(node.args[1])
            versions = [_literal(k.value) for k in node.keywords if k.arg == "version"]
            if isinstance(workflow, str) and isinstance(data, dict):
                _check_input(workflow, versions[0] if versions else None, data)


def _submits(func: ast.expr) -> bool:
    return (isinstance(func, ast.Attribute) and func.attr == "submit") or \
        (isinstance(func, ast.Name) and func.id == "build_submission")


def _check_toml(block: str) -> None:
    loaded = tomllib.loads(block)
    if set(loaded) <= {"defaults", "dependencies"}:
        parse_policy(loaded)
    elif "project" in loaded:
        parse_project(block, "a page's stepstream.toml")


COMMANDS = [pytest.param(line, id=f"{_name(page)}: {line}") for page in PAGES for line in _shell_lines(page)]
PAGE_PARAMS = [pytest.param(page, id=_name(page)) for page in PAGES]


def test_the_readme_opens_with_make_demo_and_make_test_and_stays_short() -> None:
    readme = (ROOT / "README.md").read_text().splitlines()
    assert len(readme) <= 300
    opening = "\n".join(readme[:40])
    assert "make demo" in opening and "make test" in opening


def test_the_readme_links_every_page_of_docs() -> None:
    linked = set(re.findall(r"\]\((docs/[\w-]+\.md)\)", (ROOT / "README.md").read_text()))
    assert {_name(page) for page in PAGES[1:]} <= linked and "docs/design.md" in linked


def test_the_pages_hold_every_kind_of_block_this_test_checks() -> None:
    languages = {found for page in PAGES for found, _ in FENCE.findall(page.read_text())}
    assert languages - {SHOWN_OUTPUT} == CHECKED_LANGUAGES
    assert len(_shell_lines(ROOT / "README.md")) >= 10 and _blocks(ROOT / "README.md", "python")


@pytest.mark.parametrize("page", PAGE_PARAMS)
def test_every_block_of_a_page_is_of_a_language_this_test_checks(page: Path) -> None:
    allowed = CHECKED_LANGUAGES | {SHOWN_OUTPUT}
    unchecked = [found or "(none)" for found, _ in FENCE.findall(page.read_text()) if found not in allowed]
    assert unchecked == []


@pytest.mark.parametrize("line", COMMANDS)
def test_every_shell_command_of_a_page_is_one_the_project_accepts(line: str) -> None:
    _check_command(line)


@pytest.mark.parametrize("page", PAGE_PARAMS)
def test_every_shell_script_of_a_page_is_valid_bash(page: Path) -> None:
    for block in _blocks(page, "bash"):
        done = subprocess.run(["bash", "-n"], input=block, capture_output=True, text=True, timeout=30, check=False)
        assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("page", PAGE_PARAMS)
def test_the_python_of_a_page_compiles_and_uses_only_what_exists(page: Path) -> None:
    for block in _blocks(page, "python"):
        _check_python(block)


@pytest.mark.parametrize("page", PAGE_PARAMS)
def test_the_toml_and_properties_of_a_page_are_valid(page: Path) -> None:
    for block in _blocks(page, "toml"):
        _check_toml(block)
    for block in _blocks(page, "properties"):
        for line in block.splitlines():
            assert line.startswith("#") or re.fullmatch(r"[a-z][\w.]*=.*", line), line


@pytest.mark.parametrize("page", PAGE_PARAMS)
def test_every_setting_in_a_configuration_table_of_a_page_is_one_a_service_reads(page: Path) -> None:
    for row in re.findall(r"^\| (`STEPSTREAM_[^|]*)\|", page.read_text(), re.MULTILINE):
        for name in re.findall(r"`(STEPSTREAM_\w+)`", row):
            assert name in KNOWN_VARIABLES and not name.endswith("_"), name


@pytest.mark.parametrize("page", PAGE_PARAMS)
def test_every_repository_file_and_link_of_a_page_exists(page: Path) -> None:
    text = page.read_text()
    named = {path.rstrip("/") for path in re.findall(rf"[`(]((?:{PACKAGES})/[\w./*-]+)[`)]", text)}
    missing = sorted(path for path in named if not any(ROOT.glob(path)))
    assert missing == []
    for target in re.findall(r"\]\(([^)#]*)(?:#[^)]*)?\)", text):
        if target and not re.match(r"\w+:", target):
            linked = (page.parent / target).resolve()
            assert linked.is_relative_to(ROOT), f"{target}: outside the repository"
            assert linked.exists(), target


@pytest.mark.parametrize("page", PAGE_PARAMS)
def test_every_anchor_a_page_links_to_is_a_heading_of_its_target(page: Path) -> None:
    for target, anchor in re.findall(r"\]\(([^)#:]*)#([^)]+)\)", page.read_text()):
        linked = (page.parent / target).resolve() if target else page
        if linked.exists():
            assert anchor in _anchors(linked), f"{target}#{anchor}"


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: the heading's text, lowercased, without punctuation, spaces as hyphens."""
    headings = re.findall(r"^#+ (.*)$", FENCE.sub("", page.read_text()), re.MULTILINE)
    texts = (re.sub(r"\[([^]]*)\]\([^)]*\)", r"\1", heading).lower() for heading in headings)
    return {re.sub(r"[^\w\- ]", "", text).replace(" ", "-") for text in texts}


def test_a_stale_input_for_a_demo_workflow_fails_the_check() -> None:
    stale = """{"order_id": "o-1", "sku": "A-1", "qty": 1, "amount": 10}"""
    with pytest.raises(AssertionError, match="card_token"):
        _check_command(f".venv/bin/stepstream submit orders --input '{stale}'")
    with pytest.raises(AssertionError, match="card_token"):
        _check_python(f'client.submit("orders", {stale}, task_id="order-o-1")')
    with pytest.raises(AssertionError, match="card_token"):
        _check_command("curl -X POST http://127.0.0.1:8780/api/tasks -H 'Content-Type: application/json' "
                       f"""-d '{{"workflow": "orders", "input": {stale}}}'""")
    _check_command(f".venv/bin/stepstream submit orders --version 2 --input '{stale}'")


def test_another_projects_workflow_and_a_read_pass_but_a_bad_stepstream_command_does_not() -> None:
    _check_command("""stepstream submit booking --input '{"city": "Lisbon"}'""")
    _check_command("curl -sS http://127.0.0.1:8780/api/tasks?state=waiting")
    _check_command("cd examples/anywhere")
    with pytest.raises(SystemExit):
        _check_command("stepstream submit booking --no-such-option")
    with pytest.raises(pytest.fail.Exception):
        _check_command("rm -rf .stepstream")


def test_the_submission_example_of_the_openapi_description_is_valid_input() -> None:
    examples = SubmissionRequest.model_json_schema()["examples"]
    for example in examples:
        submission = SubmissionRequest.model_validate(example)
        _check_input(submission.workflow, submission.version, submission.input)
    assert examples


def test_stepstream_without_a_command_lists_every_command_and_exits_2() -> None:
    done = subprocess.run([sys.executable, "-m", "stepstream"], capture_output=True, text=True, timeout=60,
                          check=False, cwd=ROOT)
    commands = next(a for a in build_parser()._actions if a.dest == "command").choices
    assert done.returncode == 2 and commands
    for name in commands:
        assert re.search(rf"^\s+{name}\s+\S", done.stderr, re.MULTILINE), name


def test_a_stale_input_of_the_travel_example_fails_like_one_of_the_demo() -> None:
    with pytest.raises(AssertionError, match="card"):
        _check_command("""../../.venv/bin/stepstream submit trip --input '{"trip_id": "t", "flight": "LH 1", """
                       """"hotel": "Adlon", "nights": 2, "amount": 480}'""")
