"""docs/your-own-system.md as a newcomer follows it: every shell command is one that exists (a make target,
a folder, a stepstream command the CLI accepts, the example's module, a route of the example's service),
and its stepstream.toml is a valid project. What the commands do is tested in tests/test_your_own_system.py."""

from __future__ import annotations

import ast
import re
import shlex
from pathlib import Path

import pytest

from stepstream.cli import build_parser
from stepstream.project.files import parse

ROOT = Path(__file__).parent.parent
DOC = (ROOT / "docs" / "your-own-system.md").read_text()
TRAVEL = ROOT / "examples" / "travel"


def _blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", DOC, re.MULTILINE | re.DOTALL)


def _commands() -> list[str]:
    return [line.strip() for block in _blocks("sh") for line in block.splitlines() if line.strip()]


def test_the_page_has_commands_a_project_file_and_the_workflow() -> None:
    assert len(_commands()) >= 8 and _blocks("toml") and _blocks("python")


@pytest.mark.parametrize("line", _commands())
def test_every_shell_command_of_the_page_is_real(line: str) -> None:
    program, *args = shlex.split(line)
    if program == "make":
        targets = re.search(r"^\.PHONY:(.*)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
        assert targets is not None and set(args) <= set(targets.group(1).split())
    elif program == "cd":
        assert (ROOT / args[0]).is_dir()
    elif program == "../../.venv/bin/stepstream":
        build_parser().parse_args(args)  # argparse exits 2 on anything it does not accept
    elif program == "../../.venv/bin/python":
        assert args[0] == "-m" and (TRAVEL / (args[1].replace(".", "/") + ".py")).is_file()
    elif program == "curl":
        from travel.service import create_app  # the example's folder is on the path (below)

        path = re.sub(r"^http://127\.0\.0\.1:8300|\?.*$", "", args[-1])
        assert path in {route.path for route in create_app().routes}
    else:
        pytest.fail(f"a command the page should not need: {line}")


def test_the_page_s_project_file_and_workflow_are_valid() -> None:
    for block in _blocks("toml"):
        parse(block, "docs/your-own-system.md")
    for block in _blocks("python"):
        ast.parse(block)


@pytest.fixture(autouse=True)
def _travel_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(TRAVEL))
