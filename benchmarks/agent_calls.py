"""Many calls in flight from one agent process: threads (the runtime's choice) against asyncio.

Run by hand from the project folder::

    .venv/bin/python -m benchmarks.agent_calls [--calls N] [--concurrency N] [--latency-ms MS]

It starts the order service (a process of its own, ``--latency-ms`` per answer) and makes ``--calls``
POSTs to it with at most ``--concurrency`` in flight, three ways, one after the other:

1. ``threads+agent``: ``Agent.execute`` (retry policy, breaker, budget, metrics, logs) on a
   ``ThreadPoolExecutor``, one pooled keep-alive ``httpx.Client`` shared by every thread: what an agent
   process runs (without Kafka);
2. ``threads``: the same POSTs on the same pool and client, without the agent around them;
3. ``asyncio``: the same POSTs from one event loop, ``httpx.AsyncClient`` with the same pool limits, at
   most ``--concurrency`` at once (a semaphore).

Reported per way: calls/s and CPU time of this process per call (``time.process_time``: every thread),
no Kafka involved. The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import orjson

from agents.http import http_handler, pooled_client, request_body
from agents.runtime import Agent
from demo.orders_client import ServiceProcess
from eventstore.logs import configure_logging
from schemas.messages import AgentRequest

PATH = "inventory/reserve"


def requests(n: int) -> list[AgentRequest]:
    run = uuid.uuid4().hex[:6]
    deadline = datetime.now(UTC) + timedelta(hours=1)
    return [AgentRequest(task_id=f"{run}-{i}", step="reserve", attempt=1, attempt_id=f"{run}-{i}:reserve:1",
                         idempotency_key=f"{run}-{i}:reserve", complete_by=deadline, calls_allowed=3,
                         input={"task": {"order_id": f"{run}-{i}", "sku": "A-1", "qty": 1}}) for i in range(n)]


def measured(work: Callable[[], int]) -> dict[str, float]:
    cpu, wall = time.process_time(), time.perf_counter()
    calls = work()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return {"calls": calls, "seconds": round(wall, 3), "calls_per_s": round(calls / wall, 1),
            "cpu_us_per_call": round(1e6 * cpu / calls, 1), "cores": round(cpu / wall, 3)}


def with_threads(url: str, batch: list[AgentRequest], concurrency: int, agent: bool) -> int:
    client = pooled_client(concurrency)
    handler = http_handler(url, PATH, client)
    worker = Agent("inventory", handler, dependency=f"bench-{uuid.uuid4().hex[:6]}")

    def raw(request: AgentRequest) -> bool:
        response = client.post(f"{url}/{PATH}", json=request_body(request.input),
                               headers={"Idempotency-Key": request.idempotency_key, "X-Attempt": "1"})
        return response.status_code == 200

    def call(request: AgentRequest) -> bool:
        return worker.execute(request).ok if agent else raw(request)

    with client, ThreadPoolExecutor(concurrency) as pool:
        return sum(pool.map(call, batch))


def with_asyncio(url: str, batch: list[AgentRequest], concurrency: int) -> int:
    async def run() -> int:
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        gate = asyncio.Semaphore(concurrency)
        async with httpx.AsyncClient(limits=limits) as client:
            async def call(request: AgentRequest) -> bool:
                async with gate:
                    response = await client.post(f"{url}/{PATH}", json=request_body(request.input),
                                                 headers={"Idempotency-Key": request.idempotency_key,
                                                          "X-Attempt": "1"})
                    return response.status_code == 200

            return sum(await asyncio.gather(*(call(r) for r in batch)))

    return asyncio.run(run())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--latency-ms", type=int, default=50)
    args = parser.parse_args(argv)
    configure_logging("WARNING")
    figures: dict[str, Any] = {"benchmark": "agent_calls", "date": datetime.now(UTC).isoformat(timespec="seconds"),
                               "calls": args.calls, "concurrency": args.concurrency, "latency_ms": args.latency_ms}
    with ServiceProcess() as service, service.admin() as admin:
        admin.set_faults(latency_ms=args.latency_ms)
        url, n, c = service.base_url, args.calls, args.concurrency
        batches = [requests(n) for _ in range(3)]  # fresh idempotency keys each: every call applies an effect
        ways: dict[str, Callable[[], int]] = {
            "threads+agent": lambda: with_threads(url, batches[0], c, agent=True),
            "threads": lambda: with_threads(url, batches[1], c, agent=False),
            "asyncio": lambda: with_asyncio(url, batches[2], c),
        }
        for name, work in ways.items():
            figures[name] = measured(work)
            print(f"{name:>14}: {figures[name]['calls_per_s']:>8,.0f} calls/s, "
                  f"{figures[name]['cpu_us_per_call']:>6,.0f} CPU µs/call, {figures[name]['cores']:.2f} cores",
                  file=sys.stderr)
    sys.stdout.write(orjson.dumps(figures).decode() + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
