"""``stepstream up``: a whole local system in one command, stopped cleanly by SIGTERM or Ctrl-C.

It starts the local broker if no cluster is configured, the demo's order service, and every service as
its own process (projector, scheduler, one agent per agent the workflows name, supervisor, and the API
with the dashboard on STEPSTREAM_API_PORT, or a free port when that one is taken), then watches them: one
that dies is started again after a back-off, one that keeps dying stops everything with exit 1
(``stepstream.local.restarts``). On SIGTERM it drains them newest first and reports each exit code.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

from confluent_kafka.admin import AdminClient
from rich.console import Console

from demo.order_agents import ORDER_OPERATIONS
from demo.orders_client import ServiceProcess
from eventstore.broker import LocalBroker
from eventstore.console import command_console
from eventstore.errors import StepstreamError
from eventstore.kafka_config import connection_config
from eventstore.settings import ConsumerSettings, KafkaSettings, ObservabilitySettings
from eventstore.shutdown import GracefulShutdown
from eventstore.topics import TopicLayout, ensure_topics
from scheduler.settings import SchedulerSettings
from schemas.sealed import configured_keys
from stepstream.http.settings import ApiSettings
from stepstream.local.processes import ServiceProcesses, child_env
from stepstream.local.restarts import RestartPolicy, RestartSettings

READY_MARKER = "stepstream is up"
API_MARKER = "api listening on"


def up_state_file(home: Path) -> Path:
    return home / "up.json"


class PortTaken(StepstreamError):
    """A port a service of ``stepstream up`` must listen on is in use."""


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
    stop = GracefulShutdown(ConsumerSettings().drain_timeout_s * 2).install().event
    kafka = KafkaSettings()
    agents = sorted(SchedulerSettings().load_registry().agents & ORDER_OPERATIONS.keys())
    services = ["projector", "scheduler", *agents, "supervisor"]
    metrics = metrics_ports(services, ObservabilitySettings().metrics_port)
    home = kafka.home.resolve()
    refuse_if_up(home)
    logs = home / "logs"
    logs.mkdir(parents=True, exist_ok=True)  # a fresh clone has no home yet; every process logs there
    bootstrap = kafka.reachable_bootstrap() if kafka.bootstrap_servers else LocalBroker(home).start().bootstrap_servers
    layout = TopicLayout.from_settings(kafka)
    ensure_topics(AdminClient(connection_config(bootstrap)), layout.core_specs(), kafka.replication_factor)

    service = ServiceProcess(port=service_port, state_file=home / "orders-service.json",
                             log_path=logs / "orders-service.log").start()
    procs = ServiceProcesses(child_env(STEPSTREAM_BOOTSTRAP_SERVERS=bootstrap, STEPSTREAM_HOME=str(home),
                                       STEPSTREAM_AGENT_SERVICE_URL=service.base_url,
                                       STEPSTREAM_ENCRYPTION_KEYS=configured_keys(home, create=True) or ""), logs)
    names = [*services, "api"]
    gave_up: str | None = None
    try:
        for name in services:
            procs.service(name, *(("agent", name) if name in agents else (name,)),
                          env={"STEPSTREAM_METRICS_PORT": str(metrics[name])} if name in metrics else None)
        procs.start("api", "stepstream", "serve", "api", "--port", str(_api_port()))
        for name in services:
            procs.wait_started(name)
        procs.wait_started("api", API_MARKER)
        api_url = re.findall(API_MARKER + r" (http://\S+)", procs.log("api"))[0]
        state = {"pid": os.getpid(), "bootstrap": bootstrap, "service_url": service.base_url,
                 "topic_prefix": layout.prefix, "api_url": api_url, "metrics_ports": metrics}
        _write_state(home, state, procs, service)
        console.print(f"{READY_MARKER}: kafka {bootstrap}, order service {service.base_url}, "
                      f"dashboard and API {api_url}, services {', '.join(names)}; logs in {logs}",
                      highlight=False)
        if metrics:
            console.print("metrics (STEPSTREAM_METRICS_PORT, one port each): " + ", ".join(
                f"{name} http://127.0.0.1:{port}/metrics" for name, port in metrics.items()), highlight=False)
        gave_up = _supervise(stop, procs, service, RestartPolicy(RestartSettings()),
                             lambda: _write_state(home, state, procs, service), console)
    finally:
        codes = procs.terminate_all()
        codes[ORDER_SERVICE] = service.stop() or 0
        up_state_file(home).unlink(missing_ok=True)
    console.print("stopped: " + ", ".join(f"{name} exit {code}" for name, code in codes.items()), highlight=False)
    return 0 if gave_up is None and all(code == 0 for code in codes.values()) else 1


ORDER_SERVICE = "orders-service"


def _supervise(stop: threading.Event, procs: ServiceProcesses, service: ServiceProcess, policy: RestartPolicy,
               on_restart: Callable[[], None], console: Console) -> str | None:
    """Until SIGTERM: start every service that died again, after the policy's back-off; the name of one
    that keeps dying (then everything stops), or None once asked to stop."""
    due: dict[str, float] = {}  # service -> when it starts again

    def alive(name: str) -> bool:
        return service.running if name == ORDER_SERVICE else procs.alive(name)

    while not stop.wait(0.2):
        now = time.monotonic()
        for name in [n for n in (ORDER_SERVICE, *procs.procs) if n not in due and not alive(n)]:
            delay = policy.on_death(name)
            if delay is None:
                console.print(f"[red]{name} died {policy.recent_deaths(name)} times within "
                              f"{policy.settings.restart_window_s:g}s: it keeps crashing, so up stops everything; "
                              f"see its log {procs.log_dir / (name + '.log')}[/red]")
                return name
            console.print(f"[yellow]{name} exited unexpectedly; starting it again in {delay:.1f}s[/yellow]")
            due[name] = now + delay
        for name in [n for n, at in due.items() if at <= now]:
            del due[name]
            if name == ORDER_SERVICE:
                service.start()
            else:
                procs.start_again(name)
            console.print(f"{name} started again", highlight=False)
            on_restart()
    return None


def _write_state(home: Path, state: dict[str, object], procs: ServiceProcesses, service: ServiceProcess) -> None:
    """``up.json``: how to reach the running system, with every process's current pid (renamed into place,
    so a reader never sees half a file)."""
    pids = {name: proc.pid for name, proc in procs.procs.items()} | {ORDER_SERVICE: service.pid}
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
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", wanted))
            except OSError as exc:
                raise PortTaken(f"STEPSTREAM_METRICS_PORT={base}: port {wanted} for {name} (ports {base}-"
                                f"{base + len(services) - 1}, one per service) cannot be used: {exc.strerror}; "
                                "choose another base, or 0 for any free ports") from None
            ports[name] = probe.getsockname()[1]
    return ports


def _api_port() -> int:
    """The configured API port, or any free one when it is taken (a second system on this machine)."""
    settings = ApiSettings()
    port = settings.port
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((settings.host, port))
        except OSError:
            return 0
    return port


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
