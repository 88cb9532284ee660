"""Where the project file is, reading it, and how it becomes the settings every command reads.

``stepstream.toml`` in the working folder or the nearest of its parents (as git finds ``.git``, so a command
run in a subfolder of the project reads it too), or the file (or folder) ``STEPSTREAM_PROJECT`` names; with
neither, the built-in configuration: the demo's project file (``stepstream.toml`` of the installed ``demo``
package, found without importing it: the front does not depend on the demo), so ``stepstream up`` runs the
demo with nothing configured.

Every entry point reads it the same way (``configure``): the command line, the Python client and the outbox
writer, so that a script run in the project folder submits to the project's workflows as ``stepstream
submit`` does. Its local state (broker, logs, state store) is kept in the project folder's ``.stepstream``
unless ``STEPSTREAM_HOME`` says otherwise.

Why the file feeds the environment rather than every settings class: each service reads its own settings
from ``STEPSTREAM_*`` variables (pydantic-settings), in this process and in the children ``up`` starts. So
the front reads the file once, at the command line's entry, and sets what it says as *defaults* of those
variables (``os.environ.setdefault``): a variable already set still wins, children inherit the result, and
``STEPSTREAM_PROJECT`` is set to the file found so a child started in another folder reads the same one.
The project folder goes on ``sys.path`` (and ``PYTHONPATH``, for the children), so the workflows module
beside the file imports without the user setting anything.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from eventstore.errors import StepstreamError
from eventstore.settings import HOME_NAME
from stepstream.project.model import AgentDecl, Project

PROJECT_FILE = "stepstream.toml"
BUILT_IN_PACKAGE = "demo"  # whose project file is the configuration where no project file is found


class ProjectRefused(StepstreamError):
    """The project file is missing where STEPSTREAM_PROJECT points, is not TOML, or says something invalid:
    one line naming the file and the field."""


class UnknownAgent(StepstreamError):
    """An agent name the project does not declare; the message lists those it does."""


class ProjectLocation(BaseSettings):
    """``STEPSTREAM_PROJECT``: the project file, or the folder holding ``stepstream.toml``."""

    model_config = SettingsConfigDict(env_prefix="STEPSTREAM_", frozen=True, extra="ignore")

    project: Path | None = Field(default=None, description="the project file or its folder")


@dataclass(frozen=True)
class LoadedProject:
    spec: Project
    file: Path | None  # None: the built-in configuration (the demo)

    @property
    def folder(self) -> Path | None:
        return None if self.file is None else self.file.parent

    def where(self) -> str:
        if self.file is None:
            return (f"the built-in demo configuration (no {PROJECT_FILE} in {Path.cwd()} or its parents, "
                    "and STEPSTREAM_PROJECT is not set)")
        return str(self.file)

    def agent(self, name: str) -> AgentDecl:
        try:
            return self.spec.agents[name]
        except KeyError:
            raise UnknownAgent(f"no agent {name!r} is declared in {self.where()}; declared agents: "
                               f"{', '.join(sorted(self.spec.agents)) or 'none'}") from None

    def undeclared(self, names: Iterable[str]) -> list[str]:
        """The agents of ``names`` this project does not declare, sorted."""
        return sorted(set(names) - self.spec.agents.keys())


def find_project(cwd: Path | None = None) -> LoadedProject:
    """The project this command runs in (see the module doc for where it looks)."""
    pointed = ProjectLocation().project
    if pointed is not None:
        path = pointed / PROJECT_FILE if pointed.is_dir() else pointed
        if not path.is_file():
            raise ProjectRefused(f"STEPSTREAM_PROJECT={pointed}: no project file there ({path})")
        return load_project(path)
    here = (cwd or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / PROJECT_FILE).is_file():
            return load_project(folder / PROJECT_FILE)
    built_in = built_in_file()
    return LoadedProject(parse(built_in.read_text(), str(built_in)), None)


def built_in_file() -> Path:
    """The demo's project file, where the ``demo`` package is installed (located, not imported)."""
    spec = importlib.util.find_spec(BUILT_IN_PACKAGE)
    if spec is None or spec.origin is None:
        raise ProjectRefused(f"no {PROJECT_FILE} in {Path.cwd()} or its parents, STEPSTREAM_PROJECT is not set, and "
                             f"the built-in demo ({BUILT_IN_PACKAGE}) is not installed")
    return Path(spec.origin).parent / PROJECT_FILE


def load_project(path: Path) -> LoadedProject:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ProjectRefused(f"{path}: cannot read: {exc.strerror or exc}") from None
    return LoadedProject(parse(text, str(path)), path.resolve())


def parse(text: str, where: str) -> Project:
    """The project ``text`` says; ProjectRefused naming ``where`` and the first wrong field otherwise."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ProjectRefused(f"{where}: not valid TOML: {exc}") from None
    try:
        return Project.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(part) for part in first["loc"])
        field = f"{loc}: " if loc else ""  # a check across fields names them in its message
        message = first["msg"].removeprefix("Value error, ")
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise ProjectRefused(f"{where}: {field}{message}{more}") from None


def configure() -> LoadedProject:
    """Find the project this process runs in and make it its configuration: what every entry point does
    before it reads a setting."""
    project = find_project()
    activate(project)
    return project


def activate(project: LoadedProject) -> None:
    """Make ``project`` the configuration of this process and of the children it starts (module doc)."""
    os.environ.setdefault("STEPSTREAM_SCHEDULER_WORKFLOWS", project.spec.project.workflows)
    folder = project.folder
    if folder is None or project.file is None:
        return
    os.environ["STEPSTREAM_PROJECT"] = str(project.file)
    os.environ.setdefault("STEPSTREAM_HOME", str(folder / HOME_NAME))
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(folder) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(folder), *paths])
