"""The README as a newcomer reads it: every command of its shell blocks is one the CLI accepts (or a make
target, or a request the API takes), its Python and TOML blocks are valid against the code, every file
of the repository it names is there (the design page included, so a clone is self-contained), and
``stepstream`` alone shows the commands it describes. A README edit that breaks any of them fails here.
What each command does against a live system is tested where that behaviour is (tests/test_up.py,
test_submission*.py, test_kafka_unreachable.py, ...)."""

from __future__ import annotations

import ast
import json
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from agents.policy import parse_policy
from stepstream.cli import build_parser
from stepstream.client import Client
from stepstream.http.bodies import SubmissionRequest

ROOT = Path(__file__).parent.parent
PACKAGES = "docs|examples|schemas|eventstore|projections|scheduler|agents|supervisor|stepstream|demo|tests|benchmarks"
README = (ROOT / "README.md").read_text()


def _blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README, re.MULTILINE | re.DOTALL)


def _shell_lines() -> list[str]:
    """Each command of the shell blocks: continuations joined, comments dropped, ``[--option N]`` given
    (N as 1), so an option the README shows is checked too."""
    lines = []
    for block in _blocks("sh"):
        for line in block.replace("\\\n", " ").splitlines():
            command = re.sub(r"\[([^]]*)\]", r"\1", re.sub(r"\s+#\s.*$", "", line))
            lines.append(re.sub(r"(?<=\s)N(?=\s|$)", "1", command).strip())
    return [line for line in lines if line]


def test_the_readme_has_shell_python_and_toml_blocks() -> None:
    assert len(_shell_lines()) >= 20 and _blocks("python") and _blocks("toml")


@pytest.mark.parametrize("line", _shell_lines())
def test_every_readme_shell_command_is_one_the_project_accepts(line: str) -> None:
    program, *args = shlex.split(line)
    if program == ".venv/bin/stepstream":
        build_parser().parse_args(args)  # argparse exits 2 on anything it does not accept
    elif program == "make":
        targets = re.search(r"^\.PHONY:(.*)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
        assert targets is not None and set(args) <= set(targets.group(1).split())
    elif program == "curl":
        body = args[args.index("-d") + 1]
        SubmissionRequest.model_validate(json.loads(body))
        assert "Content-Type: application/json" in args
    else:
        pytest.fail(f"a README command this test does not know how to check: {line}")


def test_the_readme_python_compiles_and_calls_only_what_the_client_has() -> None:
    for block in _blocks("python"):
        tree = ast.parse(block)
        called = {node.attr for node in ast.walk(tree)
                  if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "client"}
        assert called and all(hasattr(Client, name) for name in called), called


def test_the_readme_agent_policy_is_a_valid_policy() -> None:
    for block in _blocks("toml"):
        parse_policy(tomllib.loads(block))


def test_every_repository_file_the_readme_names_exists() -> None:
    readme = (ROOT / "README.md").read_text()
    named = set(re.findall(rf"[`(]((?:{PACKAGES})/[\w./*-]+)[`)]", readme))
    assert "docs/design.md" in named
    missing = sorted(path for path in named if not any(ROOT.glob(path.rstrip("/"))))
    assert missing == []
    assert "../" not in readme, "no reference outside the repository"


def test_stepstream_without_a_command_lists_every_command_and_exits_2() -> None:
    done = subprocess.run([sys.executable, "-m", "stepstream"], capture_output=True, text=True, timeout=60,
                          check=False, cwd=ROOT)
    commands = next(a for a in build_parser()._actions if a.dest == "command").choices
    assert done.returncode == 2 and commands
    for name in commands:
        assert re.search(rf"^\s+{name}\s+\S", done.stderr, re.MULTILINE), name
