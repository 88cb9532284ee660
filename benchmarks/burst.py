"""A burst of orders through ``stepstream up`` with its defaults, as a user runs it.

Run by hand from the project folder::

    .venv/bin/python -m benchmarks.burst [--tasks 300 2000 10000] [--latency-ms 0 50] [--timeout-s 300]
                                         [--profile SECONDS]

For each burst size and service latency: a fresh home (its own local broker, store and keys), ``stepstream
up`` started as a user starts it (every default: sealing of ``card_token``, data keys, projector,
scheduler, one process per agent, supervisor, API, the demo's order service), the order service's latency
set, then N orders of the default ``orders`` workflow (each with a ``card_token``) submitted with the Python
client as fast as it goes, and the API's ``/api/counts`` polled until every task ended or ``--timeout-s``
passed. Then ``up`` is stopped with SIGTERM and the broker with ``stepstream broker stop``.

Reported per burst: completed fraction, completed steps/s (3 per task, from the first submission to the
last task's end), the submission time, p50/p99 task latency (the store's ``created_at`` to ``updated_at``
of each completed task), and each process's CPU ms per task (from /proc, from the first submission to the
end: ``up``'s children, the broker, and this process, which submits), with the machine's load average, and
the resident memory of each process ``up`` runs (the broker too), idle before the burst and at its end.
``--profile S`` samples every stepstream process with py-spy for S seconds in the middle of the run (the
top entries of each are printed to stderr). Then one task alone, ``stepstream submit --wait`` on the idle
system of the last burst: the time from the command's start to its answer, and from the submission to the
task's end as the store records it.

The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from eventstore.broker import free_port, run_kafka_tool
from stepstream.local.up import wait_until_up

STEPS_PER_TASK = 3
TERMINAL = ("completed", "compensated", "compensation_failed", "error", "rejected", "failed")
TICKS = os.sysconf("SC_CLK_TCK")
CLIENT = "client (this process)"


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` (all its threads), 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICKS


def _rss_mb(pid: int) -> float:
    """Resident memory of ``pid`` in MB (its VmRSS), 0 once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _memory(pids: dict[int, str]) -> dict[str, Any]:
    """Each process's resident MB, and the total of what ``up`` runs (the local broker too, not this client)."""
    each = {name: round(_rss_mb(pid), 1) for pid, name in pids.items() if name != CLIENT}
    return {"total": round(sum(each.values()), 1), "each": dict(sorted(each.items()))}


def _thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds of each kind of thread of ``pid`` (names with their digits dropped): for the broker, how
    much goes to handling requests and how much to the JVM's own compiler and collector threads."""
    kinds: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kind = re.sub(r"[-#]?\d+", "", (task / "comm").read_text().strip())
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        kinds[kind] = kinds.get(kind, 0.0) + (int(fields[11]) + int(fields[12])) / TICKS
    return kinds


def _name(pid: int) -> str:
    """A short name for a process of the system: the stepstream service, the order service, the broker."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return str(pid)
    text = " ".join(argv)
    if "kafka.Kafka" in text:
        return "broker"
    if "orders_service" in text:
        return "orders-service"
    for marker in ("run", "serve"):
        if marker in argv:
            rest = [a for a in argv[argv.index(marker) + 1:] if a]
            return " ".join(rest[:2]) if rest[:1] == ["agent"] else (rest[0] if rest else text)
    return Path(argv[0]).name or str(pid)


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        for child in children.get(pid, []):
            found.append(child)
            todo.append(child)
    return found


def _broker_pid(home: Path) -> int | None:
    try:
        return int(json.loads((home / "broker" / "broker.json").read_text())["pid"])
    except (OSError, ValueError, KeyError):
        for path in home.rglob("*.json"):
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(data, dict) and "pid" in data and "port" in data and _name(int(data["pid"])) == "broker":
                return int(data["pid"])
    return None


def _broker_jmx(pid: int) -> str | None:
    """Start the broker's JMX agent on a free port (``jcmd``): its request counters tell what it spends on."""
    port = free_port()
    done = subprocess.run(["jcmd", str(pid), "ManagementAgent.start", f"jmxremote.port={port}",
                           f"jmxremote.rmi.port={port}", "jmxremote.authenticate=false", "jmxremote.ssl=false"],
                          capture_output=True, text=True, check=False)
    return f"service:jmx:rmi:///jndi/rmi://127.0.0.1:{port}/jmxrmi" if done.returncode == 0 else None


def _broker_requests(jmx_url: str | None) -> dict[str, int]:
    """Requests the broker handled so far, by type (its ``RequestsPerSec`` counters, all versions summed)."""
    if jmx_url is None:
        return {}
    try:
        out = run_kafka_tool("org.apache.kafka.tools.JmxTool", "--jmx-url", jmx_url, "--object-name",
                             "kafka.network:type=RequestMetrics,name=RequestsPerSec,request=*,version=*",
                             "--attributes", "Count", "--one-time", "true", "--report-format", "properties")
    except Exception:  # reported as missing figures, the run goes on
        return {}
    counts: dict[str, int] = {}
    for request, count in re.findall(r"request=(\w+),version=\d+:Count=(\d+)", out):
        counts[request] = counts.get(request, 0) + int(count)
    return counts


def _profile(pids: dict[int, str], seconds: int, out: Path) -> dict[str, list[str]]:
    """py-spy's top functions (own time) of each process over ``seconds``, sampled at once."""
    runs = {}
    for pid, name in pids.items():
        path = out / f"{name.replace(' ', '-')}-{pid}.txt"
        runs[name] = (path, subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--duration", str(seconds),
                                              "--format", "raw", "--output", str(path), "--nonblocking",
                                              "--rate", "50"], stdout=subprocess.DEVNULL,
                                             stderr=subprocess.DEVNULL))
    tops = {}
    for name, (path, proc) in runs.items():
        proc.wait()
        tops[name] = _top_frames(path)
    return tops


def _top_frames(path: Path, count: int = 8) -> list[str]:
    """From py-spy's collapsed stacks: the frames that are on the most samples (inclusive), leaf first
    among ties, skipping the thread roots."""
    inclusive: dict[str, int] = {}
    leaf: dict[str, int] = {}
    total = 0
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        total += int(n)
        frames = stack.split(";")
        for frame in set(frames):
            inclusive[frame] = inclusive.get(frame, 0) + int(n)
        leaf[frames[-1]] = leaf.get(frames[-1], 0) + int(n)
    if not total:
        return []
    own = sorted(leaf.items(), key=lambda kv: -kv[1])[:count]
    return [f"{100 * n / total:5.1f}% own  {frame}" for frame, n in own]


def run_burst(tasks: int, latency_ms: int, timeout_s: float, profile_s: int, work: Path,
              env: dict[str, str]) -> dict[str, Any]:
    home = work / f"home-{tasks}-{latency_ms}"
    env = {**env, "STEPSTREAM_HOME": str(home), "STEPSTREAM_API_PORT": "0"}
    home.mkdir(parents=True)
    up_log = open(home / "up.out", "wb")  # noqa: SIM115 - closed below, after up stops
    up = subprocess.Popen([str(Path(sys.executable).parent / "stepstream"), "up"], env=env, stdout=up_log,
                          stderr=subprocess.STDOUT, start_new_session=True)
    result: dict[str, Any] = {"tasks": tasks, "latency_ms": latency_ms}
    try:
        state = wait_until_up(home, up, 180)
        api = str(state["api_url"]).rstrip("/")
        services = state["services"]
        assert isinstance(services, dict)
        httpx.put(f"{services['orders']}/admin/faults", json={"latency_ms": latency_ms}, timeout=10
                  ).raise_for_status()
        os.environ.update({"STEPSTREAM_HOME": str(home), "STEPSTREAM_BOOTSTRAP_SERVERS": str(state["bootstrap"])})
        from stepstream.client import Client  # settings read from the environment just set

        pids = {pid: _name(pid) for pid in _descendants(up.pid)}
        broker = _broker_pid(home)
        if broker is not None:
            pids[broker] = "broker"
        pids[os.getpid()] = CLIENT
        memory_idle = _memory(pids)
        jmx = _broker_jmx(broker) if broker is not None else None
        requests0 = _broker_requests(jmx)
        threads0 = _thread_cpu_s(broker) if broker is not None else {}
        cpu0 = {pid: _cpu_s(pid) for pid in pids}
        run = uuid.uuid4().hex[:8]
        started = time.monotonic()
        with Client() as client:
            for i in range(tasks):
                client.submit("orders", {"order_id": f"b-{run}-{i}", "sku": "A-1", "qty": 1, "amount": 10.0,
                                         "card_token": f"tok-{i}"}, task_id=None)
        submitted = time.monotonic() - started
        print(f"  {tasks} orders at {latency_ms} ms: submitted in {submitted:.1f}s", file=sys.stderr)
        tops: dict[str, list[str]] = {}
        counts: dict[str, Any] = {}
        profiled = False
        while time.monotonic() - started < timeout_s:
            counts = httpx.get(f"{api}/api/counts", timeout=10).json()
            ended = sum(n for s, n in counts["tasks"].items() if s in TERMINAL)
            if ended >= tasks:
                break
            if profile_s and not profiled and ended >= tasks // 4:
                profiled = True
                tops = _profile({p: n for p, n in pids.items() if n not in ("broker", CLIENT)},
                                profile_s, home)
                continue
            time.sleep(0.5)
        elapsed = time.monotonic() - started
        memory_after = _memory(pids)
        cpu = {pids[pid]: _cpu_s(pid) - before for pid, before in cpu0.items()}
        requests = _broker_requests(jmx)
        threads = _thread_cpu_s(broker) if broker is not None else {}
        broker_threads = {kind: round(1000 * (s - threads0.get(kind, 0.0)) / tasks, 2) for kind, s in threads.items()
                          if s - threads0.get(kind, 0.0) >= 0.01 * tasks / 1000}
        per_task = {name: round((n - requests0.get(name, 0)) / tasks, 2) for name, n in requests.items()
                    if n - requests0.get(name, 0) >= tasks / 100}
        completed = counts.get("tasks", {}).get("completed", 0)
        latencies = _latencies(home / "state.db")
        result.update({
            "completed": completed, "completed_fraction": round(completed / tasks, 4),
            "by_state": counts.get("tasks", {}), "elapsed_s": round(elapsed, 2), "submit_s": round(submitted, 2),
            "steps_per_s": round(completed * STEPS_PER_TASK / elapsed, 1),
            "task_latency_p50_ms": _pct(latencies, 50), "task_latency_p99_ms": _pct(latencies, 99),
            "cpu_ms_per_task": {name: round(1000 * s / tasks, 2) for name, s in sorted(cpu.items())},
            "cpu_ms_per_task_total": round(1000 * sum(cpu.values()) / tasks, 2),
            "load_after": os.getloadavg()[0],
            "broker_requests_per_task": dict(sorted(per_task.items(), key=lambda kv: -kv[1])),
            "broker_cpu_ms_per_task_by_thread": dict(sorted(broker_threads.items(), key=lambda kv: -kv[1])),
            "rss_mb_idle": memory_idle, "rss_mb_after": memory_after,
        })
        if tops:
            result["profile"] = tops
        if tasks == max_tasks_of_run:
            result["single"] = _single_submit(env)
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()
        up_log.close()
        subprocess.run([str(Path(sys.executable).parent / "stepstream"), "broker", "stop"], env=env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    return result


max_tasks_of_run = 0  # the largest burst of this run: the single-task figure is taken after it


def _single_submit(env: dict[str, str]) -> dict[str, Any]:
    """One order alone with ``stepstream submit --wait`` on the idle system: the command's whole time, and
    the task's own time in the store (accepted to completed)."""
    time.sleep(2)
    order = f"single-{uuid.uuid4().hex[:8]}"
    started = time.monotonic()
    done = subprocess.run([str(Path(sys.executable).parent / "stepstream"), "submit", "orders", "--wait",
                           "--input", json.dumps({"order_id": order, "sku": "A-1", "qty": 1, "amount": 10.0,
                                                  "card_token": "tok-single"})],
                          env=env, capture_output=True, text=True, check=False)
    wall = time.monotonic() - started
    task = (done.stdout.strip().splitlines() or [""])[0]
    store = sqlite3.connect(f"file:{env['STEPSTREAM_HOME']}/state.db?mode=ro", uri=True)
    row = store.execute("select status, updated_at - created_at from tasks order by created_at desc limit 1"
                        ).fetchone()
    store.close()
    return {"exit": done.returncode, "command_s": round(wall, 3), "first_line": task[:120],
            "status": row[0] if row else None, "task_ms": row[1] if row else None}


def _latencies(db: Path) -> list[int]:
    store = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return sorted(int(r[0]) for r in store.execute(
            "select updated_at - created_at from tasks where status = 'completed'"))
    finally:
        store.close()


def _pct(values: list[int], p: int) -> int | None:
    if not values:
        return None
    return values[min(len(values) - 1, int(len(values) * p / 100))]


def main() -> None:
    global max_tasks_of_run
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, nargs="+", default=[300, 2000, 10000])
    parser.add_argument("--latency-ms", type=int, nargs="+", default=[0, 50])
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--profile", type=int, default=0, metavar="SECONDS")
    parser.add_argument("--keep", action="store_true", help="keep the homes (logs, stores) for reading")
    args = parser.parse_args()
    if args.profile and shutil.which("py-spy") is None:
        os.environ["PATH"] = f"{Path(sys.executable).parent}:{os.environ['PATH']}"
    max_tasks_of_run = max(args.tasks)
    work = Path(tempfile.mkdtemp(prefix="stepstream-burst-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPSTREAM_")}
    load_before = os.getloadavg()
    print(f"burst: homes under {work}, load before {load_before[0]:.2f}", file=sys.stderr)
    results = []
    for latency in args.latency_ms:
        for tasks in args.tasks:
            result = run_burst(tasks, latency, args.timeout_s, args.profile, work, env)
            results.append(result)
            print(json.dumps({k: v for k, v in result.items() if k != "profile"}), file=sys.stderr)
            for name, top in result.get("profile", {}).items():
                print(f"  profile {name}:", *top, sep="\n    ", file=sys.stderr)
    ratios = {}
    for tasks in args.tasks:
        rates = {r["latency_ms"]: r["steps_per_s"] for r in results if r["tasks"] == tasks}
        if 0 in rates and 50 in rates and rates[0]:
            ratios[f"{tasks}_50ms_vs_0ms"] = round(rates[50] / rates[0], 3)
    flat = {r["latency_ms"]: r for r in results if r["tasks"] == max(args.tasks)}
    for latency, big in flat.items():
        mid = [r for r in results if r["latency_ms"] == latency and r["tasks"] == 2000]
        if mid and mid[0]["steps_per_s"]:
            ratios[f"{big['tasks']}_vs_2000_at_{latency}ms"] = round(big["steps_per_s"] / mid[0]["steps_per_s"], 3)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"benchmark": "burst", "load_before": load_before[0], "load_after": os.getloadavg()[0],
                      "cpus": os.cpu_count(), "ratios": ratios,
                      "results": [{k: v for k, v in r.items() if k != "profile"} for r in results]}))


if __name__ == "__main__":
    main()
