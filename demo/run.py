"""The README's main job: a whole local system runs a batch of orders with faults switched on.

It starts ``stepstream up`` on the demo's project file (broker, order service, every service as a process,
the API), makes the order service flaky (errors, throttling, latency), submits orders (half with the Python
client, half over HTTP with a token made for this run, and one of them twice), one of them invalid, waits
for every task to end, prints how each ended and what it took, then stops the system with SIGTERM and
checks each service drained and exited 0.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import orjson
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from demo.orders_client import OrdersAdmin
from eventstore.console import command_console
from eventstore.settings import KafkaSettings
from projections.settings import StoreSettings
from schemas.messages import SubmitTask
from schemas.states import TERMINAL, TaskStatus
from stepstream.client import Client
from stepstream.local.up import refuse_if_up, wait_until_up
from stepstream.project.files import activate, load_project

PROJECT_FILE = Path(__file__).with_name("stepstream.toml")  # the demo's project: its workflows and its service


def _orders(run_id: str, count: int) -> list[SubmitTask]:
    """Orders of the latest ``orders`` version, each paid with a card token (sealed before it is sent)."""
    orders = [
        SubmitTask(task_id=f"order-{run_id}-{i:03d}", workflow="orders", submitter="demo",
                   input={"order_id": f"{run_id}-{i:03d}", "sku": f"SKU-{i % 5}", "qty": 1 + i % 3,
                          "amount": 10 + i, "card_token": f"tok_{secrets.token_hex(8)}"})
        for i in range(count - 1)
    ]
    # One order the service refuses for good (qty 0) at the first step: nothing to undo, no retries.
    orders.append(SubmitTask(task_id=f"order-{run_id}-bad", workflow="orders", submitter="demo",
                             input={"order_id": f"{run_id}-bad", "sku": "SKU-0", "qty": 0, "amount": 5,
                                    "card_token": f"tok_{secrets.token_hex(8)}"}))
    return orders


def run_demo(tasks: int = 20, timeout_s: float = 180.0) -> int:
    console = command_console()
    home = KafkaSettings().home.resolve()  # where a command run here looks: the demo keeps its state there
    _run_the_demos_project(home)
    kafka = KafkaSettings()
    refuse_if_up(home)  # attaching to it would run without its token, and switch its faults on
    log_path = home / "logs" / "up.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    console.print("starting the system (broker, order service, projector, scheduler, agents, supervisor)...")
    token = secrets.token_urlsafe(24)  # the API's write token for this run only
    with open(log_path, "ab") as log:
        up = subprocess.Popen([sys.executable, "-m", "stepstream", "up"], stdout=log, stderr=subprocess.STDOUT,
                              env={**os.environ, "PYTHONUNBUFFERED": "1",
                                   "STEPSTREAM_API_TOKENS": orjson.dumps({"demo": token}).decode()})
    try:
        state = wait_until_up(home, up)
        return _run(console, kafka, home, state, tasks, timeout_s, token)
    finally:
        up.send_signal(signal.SIGTERM)
        code = up.wait(timeout=120)
        stopped = [line for line in log_path.read_text().splitlines() if line.startswith("stopped:")]
        console.print(f"system stopped with SIGTERM (exit {code}); {stopped[-1] if stopped else ''}",
                      highlight=False)


def _run_the_demos_project(home: Path) -> None:
    """Make the demo's project file the configuration of this process and of the ``up`` it starts, whatever
    project the command was run in: its workflows, its agents and its order service."""
    project = load_project(PROJECT_FILE)
    os.environ["STEPSTREAM_SCHEDULER_WORKFLOWS"] = project.spec.project.workflows
    os.environ["STEPSTREAM_HOME"] = str(home)
    activate(project)


def _orders_url(state: dict[str, object]) -> str:
    """Where ``up`` started the order service (the built-in configuration's service ``orders``)."""
    services = state["services"]
    assert isinstance(services, dict)
    return str(services["orders"])


def _submit(console: Console, kafka: KafkaSettings, orders: list[SubmitTask], api_url: str, token: str) -> None:
    """Half the orders with the Python client, half over HTTP (each answered with the scheduler's decision),
    and the first HTTP one again: a repeat, answered 200, that runs once. The client seals each card token
    with the system's master key (the one ``up`` gave its services), the API seals the others."""
    half = len(orders) // 2
    with Client(kafka=kafka, submitter="demo") as client:  # the key ``up`` gave its services
        for order in orders[:half]:
            client.submit(order.workflow, order.input, task_id=order.task_id)
    answers: dict[int, int] = {}
    with httpx.Client(base_url=api_url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as http:
        for order in [*orders[half:], orders[half]]:
            body = {"workflow": order.workflow, "input": order.input, "task_id": order.task_id}
            status = http.post("/api/tasks", json=body).status_code
            answers[status] = answers.get(status, 0) + 1
    console.print(f"submitted {half} orders with stepstream.client.Client and {len(orders) - half} with POST "
                  f"/api/tasks, the first of those twice; HTTP answers: "
                  + ", ".join(f"{n} x {code}" for code, n in sorted(answers.items())), highlight=False)


def _run(console: Console, kafka: KafkaSettings, home: Path, state: dict[str, object], tasks: int,
         timeout_s: float, token: str) -> int:
    bootstrap, service_url, api_url = str(state["bootstrap"]), _orders_url(state), str(state["api_url"])
    console.print(f"up: kafka {bootstrap}, order service {service_url}, API and dashboard {api_url}",
                  highlight=False)
    with OrdersAdmin(service_url) as admin:
        admin.set_faults(latency_ms=20, error_rate=0.2, throttle_rate=0.1, retry_after_s=1)
        admin.set_faults("shipping/create", latency_ms=20, error_rate=0.2, permanent_error_rate=0.15)
        console.print("faults on: 20% server errors, 10% throttling (429, Retry-After 1s), 20 ms latency; "
                      "shipping refuses 15% of orders for good (those are compensated: refund, release)")
        orders = _orders(uuid.uuid4().hex[:6], tasks)
        started = time.monotonic()  # from the first submission: small batches end while the last is answered
        _submit(console, kafka, orders, api_url, token)

        store = StoreSettings().open(home)
        ids = [o.task_id for o in orders]
        with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                      TimeElapsedColumn(), console=console) as progress:
            bar = progress.add_task("tasks finished", total=len(ids))
            rows: dict[str, dict[str, Any] | None] = {}
            while time.monotonic() - started < timeout_s:
                rows = {t: store.task(t) for t in ids}
                done = sum(1 for r in rows.values() if r and r["status"] in TERMINAL)
                progress.update(bar, completed=done)
                if done == len(ids):
                    break
                time.sleep(0.3)
        elapsed = time.monotonic() - started
        calls = admin.calls()
        _print_table(console, ids, rows)
        store.close()

    counts: dict[str, int] = {}
    for row in rows.values():
        status = row["status"] if row else "unknown"
        counts[status] = counts.get(status, 0) + 1
    ours = tuple(f"{task_id}:" for task_id in ids)  # idempotency keys are "<task id>:<step>"
    requests = sum(n for keys in calls["requests"].values() for key, n in keys.items() if key.startswith(ours))
    applied = sum(n for keys in calls["applied"].values() for key, n in keys.items() if key.startswith(ours))
    duplicates = sum(1 for keys in calls["applied"].values() for key, n in keys.items()
                     if key.startswith(ours) and n > 1)
    console.print(f"{len(ids)} tasks in {elapsed:.1f}s: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
    console.print(f"order service: {requests} requests, {applied} side effects applied, "
                  f"{duplicates} applied twice (idempotency keys hold)")
    finished = sum(n for s, n in counts.items() if s in TERMINAL)
    return 0 if finished == len(ids) and duplicates == 0 else 1


def _print_table(console: Console, ids: list[str], rows: dict[str, dict[str, Any] | None]) -> None:
    table = Table(title="how each order ended")
    for column in ("task", "status", "attempts per step", "failures"):
        table.add_column(column)
    table.add_column("error", overflow="fold")  # whole: the reason is at its end
    for task_id in ids:
        row = rows.get(task_id)
        if row is None:
            table.add_row(task_id, "not seen", "", "", "")
            continue
        attempts = " ".join(f"{s['step']}:{s['attempt']}" for s in row.get("steps") or [])
        style = {TaskStatus.COMPLETED: "green", TaskStatus.COMPENSATED: "cyan", TaskStatus.ERROR: "red"}.get(
            row["status"], "yellow")
        table.add_row(task_id, f"[{style}]{row['status']}[/{style}]", attempts, str(row["failure_count"]),
                      Text(str(row["error"] or "")))
    console.print(table)
