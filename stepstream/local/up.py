"""``stepstream up``: a whole local system in one command, stopped cleanly by SIGTERM or Ctrl-C.

It runs the project's system (``stepstream.project``: a ``stepstream.toml``, or the built-in demo): the local
broker if no cluster is configured, the project's services that have a ``command`` (the demo's order
service), and every service as its own process (projector, scheduler, one agent host running every agent the
workflows name, forward and compensation alike (``stepstream run agents``, :mod:`agents.host`), supervisor, and
the API with the dashboard on STEPSTREAM_API_PORT, or a free port when that one is taken), then watches them:
one that dies is started again after a back-off, one that keeps dying stops everything with exit 1
(``stepstream.local.restarts``). On SIGTERM it drains them newest first (the project's services last, so
agents finish their calls) and reports each exit code.

Before anything starts, ``preflight`` checks everything the project file names (workflows, agent tables,
handlers, service commands, the policy file): a mistake is refused in one line naming it, with nothing to
stop. A process that ends while the system starts is said on the console with its exit code and the end of
its log, and everything ``up`` started stops (the local broker too, when this ``up`` started it).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

from confluent_kafka.admin import AdminClient
from rich.console import Console
from rich.markup import escape

from agents.settings import AgentSettings
from eventstore.broker import LocalBroker
from eventstore.console import command_console
from eventstore.errors import StepstreamError
from eventstore.kafka_config import connection_config
from eventstore.settings import ConsumerSettings, KafkaSettings, ObservabilitySettings
from eventstore.shutdown import GracefulShutdown
from eventstore.topics import TopicLayout, ensure_topics
from scheduler.settings import SchedulerSettings
from schemas.sealed import configured_keys
from stepstream.errors import UsageError
from stepstream.http.settings import ApiSettings
from stepstream.local import project_services
from stepstream.local.ports import bindable_port
from stepstream.local.preflight import preflight
from stepstream.local.processes import ServiceProcesses, child_env
from stepstream.local.restarts import RestartPolicy, RestartSettings
from stepstream.project.agents import agent_url
from stepstream.project.files import LoadedProject, find_project
from stepstream.project.model import ServiceDecl

READY_MARKER = "stepstream is up"
AGENT_HOST = "agents"
"""The name of the process running every agent of the project (``stepstream run agents``)."""
API_MARKER = "api listening on"


def up_state_file(home: Path) -> Path:
    return home / "up.json"


class PortTaken(StepstreamError):
    """A port a service of ``stepstream up`` must listen on is in use."""


class ProjectNotRunnable(StepstreamError):
    """What the project file names does not hold together (``stepstream.local.preflight``): ``up`` starts
    nothing, and says every problem."""


class AlreadyUp(StepstreamError):
    """A ``stepstream up`` runs with this home already: a second would start a second set of services on
    the same topics and store, and remove the first one's state file when it stops."""


def refuse_if_up(home: Path) -> None:
    """Raise AlreadyUp naming the running system (its process, its dashboard) and how to stop it."""
    try:
        state = json.loads(up_state_file(home).read_text())
    except (OSError, ValueError):
        return
    pid = state.get("pid")
    if isinstance(pid, int) and _alive(pid):
        raise AlreadyUp(f"a system is already up in {home} (stepstream up, pid {pid}, dashboard "
                        f"{state.get('api_url')}): stop it first (Ctrl-C where it runs, or kill -TERM {pid}), "
                        "or use another STEPSTREAM_HOME")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def run_up(service_port: int | None = None) -> int:
    console = command_console(stderr=True)  # whole lines, also in a log: the demo and tests read them
    kafka = KafkaSettings()
    home = kafka.home.resolve()
    project = find_project()
    workflows = SchedulerSettings()
    problems = preflight(project, workflows, AgentSettings(), home)
    if problems:  # before any signal handler, port, broker or process: nothing to stop
        raise ProjectNotRunnable("not started: " + (problems[0] if len(problems) == 1 else
                                 f"{len(problems)} problems:" + "".join(f"\n  {problem}" for problem in problems)))
    agents = sorted(workflows.load_registry().agents)
    own = {name: decl for name, decl in project.spec.services.items() if decl.command is not None}
    if service_port is not None and len(own) != 1:
        raise UsageError(f"--service-port: the project runs {len(own)} services of its own, not one")
    services = ["projector", "scheduler", *([AGENT_HOST] if agents else []), "supervisor"]
    metrics = metrics_ports(services, ObservabilitySettings().metrics_port)
    refuse_if_up(home)
    planned = [project_services.plan(name, decl, service_port) for name, decl in own.items()]
    stop = GracefulShutdown(ConsumerSettings().drain_timeout_s * 2).install().event
    logs = home / "logs"
    logs.mkdir(parents=True, exist_ok=True)  # a fresh clone has no home yet; every process logs there
    broker = None if kafka.bootstrap_servers else LocalBroker(home)
    started_broker = broker is not None and broker.status() is None  # this up starts it (else it reuses it)
    bootstrap = kafka.reachable_bootstrap() if broker is None else broker.start().bootstrap_servers
    layout = TopicLayout.from_settings(kafka)
    ensure_topics(AdminClient(connection_config(bootstrap)), layout.core_specs(), kafka.replication_factor)

    procs = ServiceProcesses(child_env(STEPSTREAM_BOOTSTRAP_SERVERS=bootstrap, STEPSTREAM_HOME=str(home),
                                       STEPSTREAM_ENCRYPTION_KEYS=configured_keys(home, create=True) or ""), logs,
                             cwd=project.folder)
    urls = {started.name: started.url for started in planned}
    names = [*(started.process for started in planned), *services, "api"]
    gave_up: str | None = None
    failed: Exception | None = None
    try:
        try:
            _start(procs, planned, own, services, agents, project, home, urls, metrics)
        except (StepstreamError, TimeoutError) as exc:  # one ended or never started: said first, then all stop
            failed = exc
            console.print(f"[red]not up: {escape(str(exc))}[/red]", highlight=False)
        else:
            api_url = re.findall(API_MARKER + r" (http://\S+)", procs.log("api"))[0]
            state = {"pid": os.getpid(), "bootstrap": bootstrap, "services": urls, "topic_prefix": layout.prefix,
                     "api_url": api_url, "metrics_ports": metrics}
            console.print(f"{READY_MARKER}: kafka {bootstrap}, "
                          + "".join(f"service {name} {url}, " for name, url in urls.items())
                          + f"dashboard and API {api_url}, services {', '.join(names)}; logs in {logs}",
                          highlight=False)
            if metrics:
                console.print("metrics (STEPSTREAM_METRICS_PORT, one port each): " + ", ".join(
                    f"{name} http://127.0.0.1:{port}/metrics" for name, port in metrics.items()), highlight=False)
            # The state file says "up" to whoever waits for it (wait_until_up): written after the lines saying
            # so, a caller that finds it also finds them in up's output.
            _write_state(home, state, procs)
            gave_up = _supervise(stop, procs, RestartPolicy(RestartSettings()),
                                 lambda: _write_state(home, state, procs), console)
    finally:
        own_processes = [started.process for started in planned]
        codes = procs.terminate_all(last=own_processes)
        # A project's own service that ends by the SIGTERM up sent stopped as asked: a plain `uvicorn.run`
        # re-raises the signal after its graceful shutdown, which is not a failure to report.
        codes |= {name: 0 for name in own_processes if codes.get(name) == -signal.SIGTERM}
        up_state_file(home).unlink(missing_ok=True)
    console.print("stopped: " + ", ".join(f"{name} exit {code}" for name, code in codes.items()), highlight=False)
    if failed is not None or gave_up is not None:
        _after_failure(console, broker, home, started_broker and failed is not None)
    return 0 if failed is None and gave_up is None and all(code == 0 for code in codes.values()) else 1


def _start(procs: ServiceProcesses, planned: list[project_services.StartedService], own: dict[str, ServiceDecl],
           services: list[str], agents: list[str], project: LoadedProject, home: Path, urls: dict[str, str],
           metrics: dict[str, int]) -> None:
    """Start the project's services (answering before the agents that call them start), then every service
    and the API, and return once each said it started."""
    for started in planned:
        project_services.start(procs, started, own[started.name], home, project.folder)
    for name in services:
        env = {"STEPSTREAM_METRICS_PORT": str(metrics[name])} if name in metrics else {}
        if name == AGENT_HOST:
            env["STEPSTREAM_AGENT_SERVICE_URLS"] = json.dumps(_agent_urls(project, agents, urls))
        procs.service(name, name, env=env or None)
    procs.start("api", "stepstream", "serve", "api", "--port", str(_api_port()))
    for name in services:
        procs.wait_started(name)
    procs.wait_started("api", API_MARKER)


def _after_failure(console: Console, broker: LocalBroker | None, home: Path, stop_broker: bool) -> None:
    """A start-up that failed stops the local broker it started too, leaving nothing behind; a broker that
    was already running, or a system that ran and then gave up, keeps it (its topics hold the tasks), said
    with how to stop it."""
    if broker is None:
        return
    if stop_broker:
        broker.stop()
        console.print(f"the local broker of {home} stopped", highlight=False)
    else:
        console.print(f"the local broker of {home} keeps running (`stepstream broker stop` stops it)",
                      highlight=False)


def _agent_urls(project: LoadedProject, agents: list[str], started: dict[str, str]) -> dict[str, str]:
    """Each HTTP agent's service URL, for the agent host: where ``up`` started it (any free port), or as
    declared."""
    urls = {}
    for name in agents:
        decl = project.agent(name)
        url = (started.get(decl.service) if decl.service is not None else None) or agent_url(project, name)
        if url is not None:
            urls[name] = url
    return urls


def _supervise(stop: threading.Event, procs: ServiceProcesses, policy: RestartPolicy,
               on_restart: Callable[[], None], console: Console) -> str | None:
    """Until SIGTERM: start every service that died again, after the policy's back-off; the name of one
    that keeps dying (then everything stops), or None once asked to stop."""
    due: dict[str, float] = {}  # service -> when it starts again
    while not stop.wait(0.2):
        now = time.monotonic()
        for name in [n for n in procs.procs if n not in due and not procs.alive(n)]:
            delay = policy.on_death(name)
            status, tail = procs.exit_status(name), escape(procs.log_tail(name))
            if delay is None:
                console.print(f"[red]{name} died {policy.recent_deaths(name)} times within "
                              f"{policy.settings.restart_window_s:g}s: it keeps crashing, so up stops everything "
                              f"(the last time: {status}){tail}[/red]", highlight=False)
                return name
            console.print(f"[yellow]{name} exited unexpectedly ({status}); starting it again in {delay:.1f}s"
                          f"{tail}[/yellow]", highlight=False)
            due[name] = now + delay
        for name in [n for n, at in due.items() if at <= now]:
            del due[name]
            procs.start_again(name)
            console.print(f"{name} started again", highlight=False)
            on_restart()
    return None


def _write_state(home: Path, state: dict[str, object], procs: ServiceProcesses) -> None:
    """``up.json``: how to reach the running system, with every process's current pid (renamed into place,
    so a reader never sees half a file)."""
    pids = {name: proc.pid for name, proc in procs.procs.items()}
    written = up_state_file(home).with_suffix(".tmp")
    written.write_text(json.dumps({**state, "pids": pids}))
    written.replace(up_state_file(home))


def metrics_ports(services: list[str], base: int | None) -> dict[str, int]:
    """With STEPSTREAM_METRICS_PORT=N, each service its own port, N, N+1, ... in start order (0: any free
    ones); every child would otherwise bind N and all but the first would crash. Refused before anything
    starts when one of them is taken. The API serves its metrics on its own port (``/metrics``)."""
    if base is None:
        return {}
    ports: dict[str, int] = {}
    for offset, name in enumerate(services):
        wanted = 0 if base == 0 else base + offset
        try:
            ports[name] = bindable_port("127.0.0.1", wanted)
        except OSError as exc:
            raise PortTaken(f"STEPSTREAM_METRICS_PORT={base}: port {wanted} for {name} (ports {base}-"
                            f"{base + len(services) - 1}, one per service) cannot be used: {exc.strerror}; "
                            "choose another base, or 0 for any free ports") from None
    return ports


def _api_port() -> int:
    """The configured API port, or any free one when it is taken (a second system on this machine)."""
    settings = ApiSettings()
    try:
        return bindable_port(settings.host, settings.port)
    except OSError:
        return 0


def wait_until_up(home: Path, up: subprocess.Popen[bytes], timeout_s: float = 120.0) -> dict[str, object]:
    """For callers that started ``stepstream up`` (``up``) in the background: its state once every service
    runs (its own state, not a file an earlier ``up`` left behind). An ``up`` that exits first is reported at
    once, not after the timeout."""
    deadline = time.monotonic() + timeout_s
    path = up_state_file(home.resolve())
    while time.monotonic() < deadline:
        if path.exists():
            state: dict[str, object] = json.loads(path.read_text())
            if state.get("pid") == up.pid:
                return state
        if up.poll() is not None:
            raise RuntimeError(f"stepstream up exited with {up.returncode} before it was up")
        time.sleep(0.2)
    raise TimeoutError(f"stepstream up did not come up within {timeout_s}s")
