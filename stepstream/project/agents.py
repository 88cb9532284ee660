"""An agent built from its declaration: an HTTP call to its service, or the Python handler it names."""

from __future__ import annotations

import difflib
import importlib
import threading
from collections.abc import Iterable, Mapping

from agents.dependencies import process_registry
from agents.http import http_handler, pooled_client
from agents.policy import PolicyProvider
from agents.runtime import Agent, AgentHandler
from eventstore.errors import StepstreamError
from stepstream.project.files import LoadedProject


class AgentUnbuildable(StepstreamError):
    """A declared agent cannot be built: its handler does not import, or its service has no URL to call."""


def agent_url(project: LoadedProject, name: str) -> str | None:
    """The base URL the HTTP agent ``name`` calls (None: a handler agent)."""
    decl = project.agent(name)
    if decl.url is not None:
        return decl.url
    return None if decl.service is None else project.spec.services[decl.service].url


def declared_agent(project: LoadedProject, name: str, policy: PolicyProvider, stopping: threading.Event, *,
                   connections: int, url_override: str | None = None) -> Agent:
    """The agent ``name`` as ``project`` declares it; ``url_override`` (STEPSTREAM_AGENT_SERVICE_URL(S), which
    ``up`` sets to where it started the service) replaces an HTTP agent's base URL. Every agent built here in
    one process shares the process's dependency registry: agents of one service share its breaker, retry
    budget and pace."""
    decl = project.agent(name)
    handler: AgentHandler
    if decl.handler is not None:
        handler = imported_handler(name, decl.handler)
    else:
        base = url_override or agent_url(project, name)
        assert base is not None  # an HTTP agent has a service or a url (model validation)
        handler = http_handler(base, decl.path, pooled_client(connections), method=decl.method,
                               headers=decl.headers, max_timeout_s=decl.timeout_s)
    return Agent(name, handler, policy, stopping, dependency=decl.dependency, dependencies=process_registry())


def declared_agents(project: LoadedProject, names: Iterable[str], policy: PolicyProvider, stopping: threading.Event,
                    *, connections: int, urls: Mapping[str, str | None]) -> dict[str, Agent]:
    """The agents ``names`` for one process (an agent host), each calling ``urls[name]`` if given.

    Each HTTP agent keeps a connection pool of its own (``connections``, one per call in flight), even
    beside agents of the same service: one pool for three agents' 96 calls in flight spent most of the
    host's CPU waiting on httpcore's pool lock (its every request and release scans the pool's connections
    and queued requests under that lock), doubling the agents' CPU per order in ``benchmarks.burst``."""
    return {name: declared_agent(project, name, policy, stopping, connections=connections,
                                 url_override=urls.get(name)) for name in names}


def imported_handler(name: str, target: str) -> AgentHandler:
    """The function ``target`` (``module:function``) names; AgentUnbuildable saying why not, in one line (with
    the module's nearest name when the function's is misspelt)."""
    module_name, _, attribute = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise AgentUnbuildable(f"agent {name}: handler {target} cannot be loaded ({exc}); its module must be "
                               "importable from the project folder or PYTHONPATH") from None
    except Exception as exc:  # the module's own code failed: the child would crash on it the same way
        raise AgentUnbuildable(f"agent {name}: handler {target}: importing {module_name} raised "
                               f"{type(exc).__name__}: {exc}") from None
    handler = getattr(module, attribute, None)
    if handler is None:
        near = difflib.get_close_matches(attribute, [n for n in dir(module) if not n.startswith("_")], n=1)
        hint = f"; did you mean {module_name}:{near[0]}?" if near else ""
        raise AgentUnbuildable(f"agent {name}: handler {target}: {module_name} has no {attribute!r}{hint}")
    if not callable(handler):
        raise AgentUnbuildable(f"agent {name}: handler {target} is a {type(handler).__name__}, not a function")
    checked: AgentHandler = handler
    return checked
