"""A whole stepstream system for end-to-end tests: real broker, real order service, real processes."""

from __future__ import annotations

import os
import re
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import httpx
import psycopg
from psycopg import sql

from demo.orders_client import OrdersAdmin, ServiceProcess
from eventstore.producer import EventProducer
from eventstore.replay import ReplayReader
from eventstore.stall import EXIT_STALLED
from eventstore.topics import TopicLayout
from projections.settings import StoreSpec
from schemas.messages import Event, SubmitTask
from schemas.states import TERMINAL
from stepstream.local.processes import ServiceProcesses
from tests.kafka_helpers import wait_for

AGENTS = ("inventory", "payments", "shipping")
ROOT = Path(__file__).parent.parent


def service_env(bootstrap: str, layout: TopicLayout, home: Path) -> dict[str, str]:
    """Environment for service subprocesses: same cluster, same prefix, short cadences."""
    return {
        **os.environ,
        "STEPSTREAM_BOOTSTRAP_SERVERS": bootstrap,
        "STEPSTREAM_TOPIC_PREFIX": layout.prefix,
        "STEPSTREAM_PARTITIONS": str(layout.partitions),
        "STEPSTREAM_HOME": str(home),
        "STEPSTREAM_CONSUMER_POLL_TIMEOUT_S": "0.1",
        "STEPSTREAM_CONSUMER_COMMIT_INTERVAL_MS": "100",
        "STEPSTREAM_CONSUMER_SESSION_TIMEOUT_MS": "6000",
        "STEPSTREAM_CONSUMER_DRAIN_TIMEOUT_S": "20",
        "STEPSTREAM_CONSUMER_RETRY_INITIAL_BACKOFF_S": "0.05",
        "STEPSTREAM_CONSUMER_RETRY_MAX_BACKOFF_S": "0.5",
        "PYTHONUNBUFFERED": "1",
    }


class System:
    def __init__(self, bootstrap: str, layout: TopicLayout, env: dict[str, str], tmp: Path,
                 service: ServiceProcess) -> None:
        self.bootstrap = bootstrap
        self.layout = layout
        self.service = service
        self.admin: OrdersAdmin = service.admin()
        self.store_path = tmp / "state.db"
        self.env = {
            **env,
            "STEPSTREAM_AGENT_SERVICE_URL": service.base_url,
            "STEPSTREAM_AGENT_INITIAL_BACKOFF_S": "0.05",
            "STEPSTREAM_AGENT_MAX_BACKOFF_S": "0.3",
            "STEPSTREAM_AGENT_CALL_TIMEOUT_S": "1.5",
            "STEPSTREAM_SCHEDULER_WORKFLOWS": "tests.workflows:REGISTRY",
            "STEPSTREAM_STORE_PATH": str(self.store_path),
            "STEPSTREAM_SUPERVISOR_CADENCE_S": "0.3",
            "STEPSTREAM_SUPERVISOR_RESEND_AFTER_S": "2",
            "STEPSTREAM_SUPERVISOR_SESSION_TIMEOUT_MS": "6000",
            "STEPSTREAM_LOG_JSON": "true",
        }
        self.procs = ServiceProcesses(self.env, tmp / "logs", cwd=ROOT)
        self.producer = EventProducer(bootstrap)
        self.stall_restarts: list[tuple[str, str]] = []
        """Each service started again after it ended itself for a restart (exit 75: a stalled commit,
        ``eventstore.stall``, or a transaction it could not finish, ``RestartRequired``), in order, with the line
        it logged saying why."""
        self._procs_lock = threading.Lock()
        self._stopping = threading.Event()
        self._watcher = threading.Thread(target=self._restart_stalled, name="restart-stalled", daemon=True)
        self._watcher.start()

    def _restart_stalled(self) -> None:
        """Start again every service that exited ``EXIT_STALLED``, as ``stepstream up``, compose and an
        orchestrator do; the recovery from a stalled or failed transaction relies on that restart. Any other
        exit is left for the test to see: a crash must not pass unnoticed."""
        while not self._stopping.wait(0.2):
            with self._procs_lock:
                for name, proc in list(self.procs.procs.items()):
                    if proc.poll() == EXIT_STALLED:
                        said = [line for line in self.procs.log(name).splitlines() if "for a restart" in line]
                        self.stall_restarts.append((name, said[-1] if said else "(nothing logged)"))
                        self.procs.start_again(name)

    def start(self, *names: str, timeout_s: float = 60.0) -> None:
        """Start services by name: scheduler, projector, supervisor, or an agent's name; each must be up within
        ``timeout_s`` of the last one (many processes importing at once on a busy machine need longer)."""
        chosen = names or ("projector", "scheduler", *AGENTS, "supervisor")
        for name in chosen:
            self.restart(name, wait=False)
        for name in chosen:
            self.procs.wait_started(name, timeout_s=timeout_s)

    def restart(self, name: str, *, wait: bool = True) -> None:
        """(Re)start one service by its name (an agent's, e.g. ``payments-refund``, or scheduler, projector,
        supervisor, with an optional ``-suffix``); with ``wait``, return once it handles SIGTERM.

        ``#N`` names a further instance of the same service (``scheduler#2``, ``payments-refund#3``): it joins
        the first one's consumer group. A scheduler with a stable instance name gets one of its own
        (``<name>-N``): two schedulers sharing a transactional id would fence each other in turn.
        """
        service, _, copy = name.partition("#")
        kind = service.split("-")[0]
        own = self.env.get("STEPSTREAM_SCHEDULER_INSTANCE")
        env = {"STEPSTREAM_SCHEDULER_INSTANCE": f"{own}-{copy}"} if kind == "scheduler" and own and copy else None
        with self._procs_lock:
            self.procs.service(name, *(("agent", service) if kind in AGENTS else (kind,)), env=env)
        if wait:
            self.procs.wait_started(name)

    def start_api(self) -> httpx.Client:
        """``stepstream serve api`` as a process of its own, on a free port; a client for it."""
        self.procs.start("api", "stepstream", "serve", "api", "--port", "0")
        found: list[str] = []

        def listening() -> bool:
            found[:] = re.findall(r"api listening on (http://\S+)", self.procs.log("api"))
            return bool(found) or not self.procs.alive("api")

        assert wait_for(listening, timeout_s=60) and found, self.procs.log("api")
        return httpx.Client(base_url=found[0], timeout=30)

    def submit(self, task_id: str, input: dict[str, Any] | None = None, *, version: int | None = None,
               workflow: str = "orders", submitter: str | None = None) -> SubmitTask:
        command = SubmitTask(task_id=task_id, workflow=workflow, workflow_version=version,
                             input=input or {"order_id": task_id, "sku": "A-1", "qty": 1, "amount": 10},
                             submitter=submitter)
        self.producer.send(self.layout.inbox, command)
        self.producer.flush()
        return command

    def cli(self, *args: str, cwd: Path = ROOT, timeout_s: float = 180) -> subprocess.CompletedProcess[str]:
        """``stepstream ARGS`` as a user runs it, in this system's environment."""
        return subprocess.run([sys.executable, "-m", "stepstream", *args], env=self.env, capture_output=True,
                              text=True, timeout=timeout_s, check=False, cwd=cwd)

    def task(self, task_id: str) -> dict[str, Any] | None:
        if not self.store_path.exists():
            return None
        with sqlite3.connect(self.store_path, timeout=10) as db:
            db.row_factory = sqlite3.Row
            try:
                row = db.execute("select * from tasks where task_id = ?", (task_id,)).fetchone()
            except sqlite3.OperationalError:
                return None
            return dict(row) if row else None

    def statuses(self) -> dict[str, str]:
        """Every task's status in the state store, in one query (the PostgreSQL one, with STEPSTREAM_STORE_URL)."""
        if url := self.env.get("STEPSTREAM_STORE_URL"):
            return postgres_statuses(StoreSpec.parse(url))
        if not self.store_path.exists():
            return {}
        with sqlite3.connect(self.store_path, timeout=10) as db:
            try:
                return dict(db.execute("select task_id, status from tasks").fetchall())
            except sqlite3.OperationalError:
                return {}

    def steps(self, task_id: str) -> list[dict[str, Any]]:
        """The task's step rows in the state store, in workflow order."""
        with sqlite3.connect(self.store_path, timeout=10) as db:
            db.row_factory = sqlite3.Row
            return [dict(row) for row in db.execute("select * from steps where task_id = ? order by step_index",
                                                    (task_id,))]

    def wait_terminal(self, task_ids: Iterable[str], timeout_s: float = 60.0) -> dict[str, str]:
        ids = list(task_ids)
        deadline = time.monotonic() + timeout_s
        statuses: dict[str, str] = {}
        while time.monotonic() < deadline:
            known = self.statuses()
            statuses = {t: known.get(t, "unknown") for t in ids}
            if all(s in TERMINAL for s in statuses.values()):
                return statuses
            time.sleep(0.2)
        raise AssertionError(f"not terminal after {timeout_s}s: "
                             f"{ {t: s for t, s in statuses.items() if s not in TERMINAL} }\n{self.logs_tail()}")

    def events(self, task_id: str | None = None) -> list[Event]:
        out = []
        for record in ReplayReader(self.bootstrap, self.layout.events):
            if isinstance(record.message, Event) and (task_id is None or record.message.task_id == task_id):
                out.append(record.message)
        return out

    def logs_tail(self, chars: int = 3000) -> str:
        return "\n".join(f"--- {name} ---\n{self.procs.log(name)[-chars:]}" for name in self.procs.procs)

    def stop(self) -> dict[str, int]:
        self._stopping.set()
        self._watcher.join()
        codes = self.procs.terminate_all()
        self.admin.close()
        return codes


def postgres_statuses(spec: StoreSpec) -> dict[str, str]:
    """Every task's status in a PostgreSQL store; nothing while its projector has not created the table yet."""
    try:
        with psycopg.connect(spec.location, connect_timeout=10) as db:
            rows = db.execute(sql.SQL("select task_id, status from {}.tasks").format(sql.Identifier(spec.schema)))
            return {task_id: status for task_id, status in rows.fetchall()}
    except psycopg.errors.UndefinedTable:
        return {}
