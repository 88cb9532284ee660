"""Everything a project file names, checked before ``stepstream up`` starts anything.

Why before: a mistake found by a child process (a handler that does not import, a policy file that does not
parse) shows only as a service crash-looping behind an "up" line, its reason in that service's log file,
while the broker and the other services have already started. ``preflight`` is pure of side effects
on the system (it imports the project's modules, as the children would, and looks at files), collects every
problem rather than the first, and says each in one line with its fix, so ``up`` can refuse at once.
"""

from __future__ import annotations

import difflib
import os
import shutil
import sys
from collections.abc import Iterable
from pathlib import Path

from agents.policy import PolicyError, read_policy_file
from agents.settings import AgentSettings
from eventstore.errors import StepstreamError
from scheduler.settings import SchedulerSettings
from stepstream.project.agents import imported_handler
from stepstream.project.files import LoadedProject


def preflight(project: LoadedProject, workflows: SchedulerSettings, agents: AgentSettings, home: Path) -> list[str]:
    """Every problem that would stop ``project`` from running, one line each; empty when it can start."""
    problems: list[str] = []
    try:
        named = workflows.load_registry().agents
    except StepstreamError as exc:
        problems.append(str(exc))
    else:
        problems += _agent_tables(project, workflows.workflows, named)
    for name, decl in sorted(project.spec.agents.items()):
        if decl.handler is not None:
            try:
                imported_handler(name, decl.handler)
            except StepstreamError as exc:
                problems.append(str(exc))
    problems += _service_commands(project, home)
    if agents.policy_file is not None:
        try:
            read_policy_file(agents.policy_file, agents.base_policy())
        except PolicyError as exc:
            problems.append(f"STEPSTREAM_AGENT_POLICY_FILE: {exc}")
    return problems


def _agent_tables(project: LoadedProject, workflows: str, named: frozenset[str]) -> list[str]:
    """The agents the workflows name and the ``[agents.NAME]`` tables must be the same names: a name without
    a table is a step nobody takes (it would wait ``queued`` for good), a table no workflow names is most
    often that name misspelt, so each missing name is told with the unused table it probably is."""
    missing = project.undeclared(named)
    unused = sorted(project.spec.agents.keys() - named)
    problems: list[str] = []
    if missing:
        told = []
        for name in missing:
            near = _near(name, unused)
            told.append(name if near is None else f"{name} (did you mean [agents.{near}], which no workflow names?)")
            if near is not None:
                unused.remove(near)
        problems.append(f"workflows {workflows} name agents that {project.where()} does not declare: "
                        f"{', '.join(told)}; declare each as [agents.NAME] (service and path, or handler)")
    for name in unused:
        near = _near(name, sorted(named))
        hint = f"did you mean {near}?" if near is not None else f"they name {', '.join(sorted(named))}"
        problems.append(f"[agents.{name}] in {project.where()}: no workflow of {workflows} names agent {name} "
                        f"({hint}); remove the table or name the agent in a step")
    return problems


def _near(name: str, candidates: Iterable[str]) -> str | None:
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return close[0] if close else None


def _service_commands(project: LoadedProject, home: Path) -> list[str]:
    """Each service ``up`` would run names a program that exists and may be executed, looked for as its
    process will look for it: in the project folder for a path, on PATH for a bare name."""
    folder = project.folder or Path.cwd()
    values = {"python": sys.executable, "port": "0", "home": str(home), "project": str(folder)}
    problems = []
    for name, decl in sorted(project.spec.services.items()):
        if decl.command is None:
            continue
        program = decl.command[0].format(**values)
        if os.sep in program:
            path = folder / program
            if not (path.is_file() and os.access(path, os.X_OK)):
                state = "is not executable" if path.is_file() else "does not exist"
                problems.append(f"services.{name}.command: {path} {state}")
        elif shutil.which(program) is None:
            problems.append(f"services.{name}.command: {program!r} is not found on PATH")
    return problems
