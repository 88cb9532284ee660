"""The share of orders undone through faults, with and without services SIGKILLed every few seconds.

Run by hand from the project folder::

    .venv/bin/python -m benchmarks.waiting_out_kills [--tasks 60] [--window-s 30] [--kills-every-s 2]

Four runs of the same load (``--tasks`` orders submitted evenly over ``--window-s`` through the order
service's faults of tests/kills.py: errors, throttling, charges answered around the call timeout, a
shipment in seven refused for good): ``orders-chaos`` (tests/workflows.py: retries at once, undoes past five
failed attempts: the behaviour before timers) and ``orders-riding`` (the same steps with back-off between
attempts and a long back-off past the threshold), each once without kills and once while, as long as orders
are submitted (and at least once each after the broker's restart), a service is SIGKILLed and restarted every
``--kills-every-s`` and the broker is SIGKILLed and restarted once (tests/kills.py's ``Kills``). Each run is
a whole system of its own (fresh topics, a fresh order service) on one broker of the benchmark's own.

Reported per run: how the orders ended, the share undone, the share that *gave up* (undone although no step
was refused for good, or an undo that stopped trying), the orders whose end disagrees with the service's
records (must be 0) and the wall time. Ratios: each workflow's share undone with kills over without. The
baseline is ``orders-chaos`` measured in the same run. Progress goes to stderr, a table to stdout; the last
line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

import orjson
from confluent_kafka.admin import AdminClient

from demo.orders_client import ServiceProcess
from eventstore.broker import LocalBroker
from eventstore.topics import TopicLayout, ensure_topics
from tests.kills import Run, run_orders
from tests.system import System, service_env
from tests.test_compensation_end_to_end import KEY

WORKFLOWS = ("orders-chaos", "orders-riding")


def one_run(broker: LocalBroker, tmp: Path, workflow: str, kills_every_s: float | None,
            args: argparse.Namespace) -> Run:
    """One whole system on ``broker`` (its own topics, order service and state store) through one run."""
    tmp.mkdir(parents=True)
    running = broker.status()
    assert running is not None, "the benchmark's broker is down"
    bootstrap = running.bootstrap_servers
    layout = TopicLayout(prefix=f"b{uuid.uuid4().hex[:10]}.", partitions=3)
    ensure_topics(AdminClient({"bootstrap.servers": bootstrap}), layout.core_specs())
    env = service_env(bootstrap, layout, tmp / "home")
    with ServiceProcess(log_path=tmp / "orders-service.log", env=env) as service:
        system = System(bootstrap, layout, env, tmp, service)
        system.env.update({"STEPSTREAM_SCHEDULER_WORKFLOWS": "tests.workflows:COMPENSATION_REGISTRY",
                           "STEPSTREAM_SCHEDULER_INSTANCE": "waiting-out-kills",
                           "STEPSTREAM_ENCRYPTION_KEYS": f"k1:{KEY}"})
        try:
            return run_orders(system, broker, workflow=workflow, tasks=args.tasks, window_s=args.window_s,
                              kills_every_s=kills_every_s, patience_s=600 + 2 * args.tasks)
        finally:
            system.stop()


def summary(run: Run) -> dict[str, Any]:
    return {"outcomes": dict(run.outcomes), "undone_share": round(run.share("compensated"), 4),
            "gave_up_share": round(len(run.gave_up) / len(run.statuses), 4), "disagreeing": len(run.wrong),
            "kills": len(run.killed), "seconds": round(run.seconds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=60)
    parser.add_argument("--window-s", type=float, default=30.0)
    parser.add_argument("--kills-every-s", type=float, default=2.0)
    args = parser.parse_args()

    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="waiting-out-kills-") as root:
        broker = LocalBroker(Path(root) / "broker-home")
        broker.start()
        try:
            for workflow in WORKFLOWS:
                for kills_every_s in (None, args.kills_every_s):
                    label = f"{workflow} {'with' if kills_every_s else 'without'} kills"
                    print(f"{label}: {args.tasks} orders over {args.window_s:g}s ...", file=sys.stderr, flush=True)
                    run = one_run(broker, Path(root) / uuid.uuid4().hex[:8], workflow, kills_every_s, args)
                    results[label] = summary(run)
                    print(f"  {results[label]}", file=sys.stderr, flush=True)
        finally:
            broker.stop()

    print(f"{'run':<34} {'completed':>9} {'undone':>7} {'gave up':>8} {'disagree':>8} {'kills':>5} {'secs':>6}")
    for label, r in results.items():
        print(f"{label:<34} {r['outcomes'].get('completed', 0):>9} {r['undone_share']:>7.1%} "
              f"{r['gave_up_share']:>8.1%} {r['disagreeing']:>8} {r['kills']:>5} {r['seconds']:>6}")
    ratios = {}
    for workflow in WORKFLOWS:
        without = results[f"{workflow} without kills"]["undone_share"]
        ratio = results[f"{workflow} with kills"]["undone_share"] / without if without else None
        ratios[workflow] = None if ratio is None else round(ratio, 2)
        shown = "n/a (none undone without kills)" if ratio is None else f"{ratio:.2f}x"
        print(f"{workflow}: share undone with kills / without: {shown}")
    print(orjson.dumps({"benchmark": "waiting_out_kills", "tasks": args.tasks, "window_s": args.window_s,
                        "kills_every_s": args.kills_every_s, "runs": results,
                        "undone_ratio_with_over_without_kills": ratios}).decode())


if __name__ == "__main__":
    main()
