"""Orders against a service that throttles: how long they take, how many calls and attempts a throttled
step costs, and how many warning lines the run writes.

Run by hand from the project folder::

    .venv/bin/python -m benchmarks.throttling [--tasks 200]

Two runs, each a whole system of its own (fresh topics, a fresh order service, every service a process)
with the agents' default fault policy, on the cluster named by ``STEPSTREAM_BOOTSTRAP_SERVERS`` or else a
local broker: ``first-two-503`` -- the first two calls of every charge answered ``503`` with
``Retry-After: 2`` (as payment rails pace a new payout), then served -- and ``429-30pct`` -- three calls in
ten to ``shipping/create`` answered ``429``, ``Retry-After: 1``. ``--tasks`` three-step orders
(tests/workflows.py ``orders`` v1) are submitted at once.

Reported per run: the seconds from the first submission to the last end, how the orders ended, the orders
whose end disagrees with the service's records (must be 0), calls and attempts per throttled step at the
service (max and mean), and the warning lines the agents logged, their stop included. Progress goes to
stderr; the last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from statistics import mean
from typing import Any

import orjson
from confluent_kafka.admin import AdminClient

from benchmarks.shared import resolve_bootstrap
from demo.orders_client import OrdersAdmin, ServiceProcess
from eventstore.settings import KafkaSettings
from eventstore.topics import TopicLayout, ensure_topics
from schemas.messages import StepStarted
from tests.agreement import disagreements
from tests.system import AGENTS, System, service_env
from tests.test_throttling_end_to_end import run_orders

SCENARIOS: dict[str, tuple[str, str, Callable[[OrdersAdmin], object]]] = {
    "first-two-503": ("charge", "payments/charge",
                      lambda admin: admin.set_faults("payments/charge", throttle_first=2, throttle_status=503,
                                                     retry_after_s=2)),
    "429-30pct": ("ship", "shipping/create",
                  lambda admin: admin.set_faults("shipping/create", throttle_rate=0.3, retry_after_s=1)),
}


def warnings_logged(system: System) -> int:
    """Warning lines in the agents' logs (JSON lines)."""
    count = 0
    for name in AGENTS:
        for line in system.procs.log(name).splitlines():
            try:
                entry = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            count += isinstance(entry, dict) and entry.get("level") == "warning"
    return count


def one_run(bootstrap: str, tmp: Path, scenario: str, tasks: int) -> dict[str, Any]:
    step, operation, faults = SCENARIOS[scenario]
    tmp.mkdir(parents=True)
    layout = TopicLayout(prefix=f"b{uuid.uuid4().hex[:10]}.", partitions=3)
    ensure_topics(AdminClient({"bootstrap.servers": bootstrap}), layout.core_specs())
    env = service_env(bootstrap, layout, tmp / "home")
    with ServiceProcess(log_path=tmp / "orders-service.log", env=env) as service:
        system = System(bootstrap, layout, env, tmp, service)
        try:
            faults(system.admin)
            seconds, statuses = run_orders(system, scenario, tasks, patience_s=600)
            calls = [system.admin.calls()["requests"][operation].get(f"{t}:{step}", 0) for t in statuses]
            attempts = Counter(e.task_id for e in system.events() if isinstance(e, StepStarted) and e.step == step)
            result = {"seconds": round(seconds, 1), "outcomes": dict(Counter(statuses.values())),
                      "disagreeing": len(disagreements(system, statuses, statuses)),
                      "calls_per_step": {"max": max(calls), "mean": round(mean(calls), 2)},
                      "attempts_per_step": {"max": max(attempts.values()),
                                            "mean": round(mean(attempts.values()), 2)}}
        finally:
            system.stop()
        return {**result, "warning_lines": warnings_logged(system)}  # after the stop: its last lines too


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=200)
    args = parser.parse_args()
    bootstrap, where, _ = resolve_bootstrap(KafkaSettings())
    print(f"cluster: {where}", file=sys.stderr, flush=True)
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="throttling-") as root:
        for scenario in SCENARIOS:
            print(f"{scenario}: {args.tasks} orders ...", file=sys.stderr, flush=True)
            results[scenario] = one_run(bootstrap, Path(root) / scenario, scenario, args.tasks)
            print(f"  {results[scenario]}", file=sys.stderr, flush=True)
    print(f"{'run':<14} {'secs':>6} {'completed':>9} {'disagree':>8} {'calls max':>9} {'attempts max':>12} "
          f"{'warnings':>8}")
    for scenario, r in results.items():
        print(f"{scenario:<14} {r['seconds']:>6} {r['outcomes'].get('completed', 0):>9} {r['disagreeing']:>8} "
              f"{r['calls_per_step']['max']:>9} {r['attempts_per_step']['max']:>12} {r['warning_lines']:>8}")
    print(orjson.dumps({"benchmark": "throttling", "tasks": args.tasks, "runs": results}).decode())


if __name__ == "__main__":
    main()
