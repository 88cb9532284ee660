"""What ``stepstream.toml`` may say, validated as a whole before anything starts.

Why a file of data rather than Python: most agents are "call this endpoint of that service with the step's
data", which is a name, a URL and a path; declaring them as data lets ``stepstream up`` check before it
starts anything that every agent a workflow names exists, and lets ``stepstream run agent NAME`` list the
agents it knows. An agent that is not an HTTP call names a Python handler (``module:function``) instead.

The shape::

    [project]
    workflows = "travel.workflows:REGISTRY"      # module:attribute of a WorkflowRegistry

    [services.travel]                            # a service agents call
    url = "http://127.0.0.1:8300"
    command = ["{python}", "-m", "travel.service", "--port", "{port}"]   # optional: `up` runs it
    health = "/health"                           # what `up` polls until the service answers

    [agents.flights]                             # an HTTP agent: its service (or its own url) and path
    service = "travel"
    path = "/flights/book"
    method = "POST"                              # POST (default), PUT, PATCH or DELETE
    timeout_s = 5.0                              # a cap on each call (the step's deadline caps it too)
    headers = { "X-Client" = "stepstream" }

    [agents.fraud]                               # any other agent: a handler, Call -> dict
    handler = "travel.agents:fraud"

Every table refuses keys it does not know (``extra="forbid"``): a misspelt ``timout_s`` is an error naming
it, not a setting silently ignored.
"""

from __future__ import annotations

import re
from typing import Literal, Self
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

IMPORT_PATH = r"^[\w.]+:\w+$"
NAME = r"^[A-Za-z0-9][A-Za-z0-9_-]*$"  # an agent's name is part of a topic's name
PLACEHOLDERS = ("python", "port", "home", "project")  # what a service's command may name (``up`` fills them)


class _Table(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _http_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    return url.rstrip("/")


class ProjectTable(_Table):
    """``[project]``."""

    workflows: str = Field(pattern=IMPORT_PATH, description="module:attribute of the WorkflowRegistry to run")


class ServiceDecl(_Table):
    """``[services.NAME]``: a service agents call; with a ``command``, one ``stepstream up`` runs."""

    url: str = Field(description="its base URL")
    command: tuple[str, ...] | None = Field(
        default=None, min_length=1,
        description="how `up` starts it, in the project folder; {python}, {port}, {home} and {project} are "
                    "replaced by the interpreter, the url's port, STEPSTREAM_HOME and the project folder")
    health: str = Field(default="/", description="path `up` polls until the service answers (below 500)")
    any_port: bool = Field(default=False, description="`up` starts it on any free port (the url's otherwise), "
                                                      "and tells its agents where")

    @field_validator("url")
    @classmethod
    def _url(cls, url: str) -> str:
        return _http_url(url)

    @field_validator("command")
    @classmethod
    def _placeholders(cls, command: tuple[str, ...] | None) -> tuple[str, ...] | None:
        for part in command or ():
            try:
                part.format(**dict.fromkeys(PLACEHOLDERS, ""))
            except (KeyError, IndexError, ValueError) as exc:
                raise ValueError(f"{part!r}: only {', '.join('{' + p + '}' for p in PLACEHOLDERS)} may be in braces "
                                 f"({exc!r}); a brace of its own is doubled, {{{{ or }}}}") from None
        return command

    @property
    def port(self) -> int:
        parts = urlsplit(self.url)
        return parts.port or (443 if parts.scheme == "https" else 80)


class AgentDecl(_Table):
    """``[agents.NAME]``: an HTTP call (``service`` or ``url``, and ``path``) or a Python ``handler``."""

    service: str | None = None
    url: str | None = None
    path: str = "/"
    method: Literal["POST", "PUT", "PATCH", "DELETE"] = "POST"
    timeout_s: float | None = Field(default=None, gt=0)
    headers: dict[str, str] = Field(default_factory=dict)
    handler: str | None = Field(default=None, pattern=IMPORT_PATH)

    @field_validator("url")
    @classmethod
    def _url(cls, url: str | None) -> str | None:
        return None if url is None else _http_url(url)

    @model_validator(mode="after")
    def _one_kind(self) -> Self:
        http = self.service is not None or self.url is not None
        if self.handler is not None and (http or self.model_fields_set & {"path", "method", "timeout_s", "headers"}):
            raise ValueError("a handler agent takes no service, url, path, method, timeout_s or headers")
        if self.handler is None and (self.service is None) == (self.url is None):
            raise ValueError("needs exactly one of service or url (an HTTP agent), or a handler")
        return self

    @property
    def dependency(self) -> str | None:
        """The name the central policy, breaker, retry budget and pace know this agent's callee by: its
        service, else None (the agent's own name). Agents of one service running in one process share them;
        each agent process learns on its own (``stepstream up`` runs one process per agent)."""
        return self.service


class Project(_Table):
    """The whole file."""

    project: ProjectTable
    services: dict[str, ServiceDecl] = Field(default_factory=dict)
    agents: dict[str, AgentDecl] = Field(default_factory=dict)

    @field_validator("services", "agents")
    @classmethod
    def _names(cls, tables: dict[str, object]) -> dict[str, object]:
        for name in tables:
            if not re.match(NAME, name):
                raise ValueError(f"{name!r}: a name is letters, digits, '-' and '_'")
        return tables

    @model_validator(mode="after")
    def _services_declared(self) -> Self:
        for name, agent in self.agents.items():
            if agent.service is not None and agent.service not in self.services:
                raise ValueError(f"agents.{name}.service: no [services.{agent.service}] is declared")
        return self
