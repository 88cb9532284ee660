"""The services a project declares with a ``command`` (``[services.NAME]``), as ``stepstream up`` runs them:
on their URL's port (or any free one), in the project folder, answering before any agent calls them."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx

from eventstore.errors import StepstreamError
from stepstream.local.ports import bindable_port
from stepstream.local.processes import ServiceProcesses
from stepstream.project.model import ServiceDecl


class ServiceRefused(StepstreamError):
    """A project service cannot start: its port is taken, or it exited or never answered (see its log)."""


@dataclass(frozen=True)
class StartedService:
    """A project service ``up`` runs: its process name (``<name>-service``, its log's name) and its URL."""

    name: str
    process: str
    url: str


def plan(name: str, decl: ServiceDecl, port: int | None) -> StartedService:
    """Where ``name`` will listen: ``port`` (``up --service-port``), any free port (``any_port``), or its URL's,
    which must be free: something else answering there would pass for the service."""
    wanted = port if port is not None else (0 if decl.any_port else decl.port)
    host = urlsplit(decl.url).hostname or "127.0.0.1"
    try:
        chosen = bindable_port(host, wanted)
    except OSError as exc:
        raise ServiceRefused(f"service {name}: port {wanted} ({decl.url}) cannot be used: {exc.strerror}; stop "
                             f"what listens there, or give [services.{name}] another url") from None
    parts = urlsplit(decl.url)
    url = urlunsplit((parts.scheme, f"{host}:{chosen}", parts.path, "", "")).rstrip("/")
    return StartedService(name, f"{name}-service", url)


def start(procs: ServiceProcesses, service: StartedService, decl: ServiceDecl, home: Path,
          project: Path | None, timeout_s: float = 30.0) -> None:
    """Start the service's command and return once it answers its health path (any status below 500)."""
    assert decl.command is not None
    port = str(urlsplit(service.url).port)
    values = {"python": sys.executable, "port": port, "home": str(home), "project": str(project or Path.cwd())}
    procs.launch(service.process, tuple(part.format(**values) for part in decl.command))
    health = f"{service.url}/{decl.health.lstrip('/')}"
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=0.5) as client:
        while True:
            if not procs.alive(service.process):
                raise ServiceRefused(f"service {service.name} exited ({procs.exit_status(service.process)}) before "
                                     f"it answered at {health}{procs.log_tail(service.process)}")
            try:
                if client.get(health).status_code < 500:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise ServiceRefused(f"service {service.name} did not answer at {health} within {timeout_s:g}s; see "
                                     f"its log {procs.log_dir / (service.process + '.log')}")
            time.sleep(0.05)
