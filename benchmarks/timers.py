"""Timer precision and cost: many steps waiting at once, fired by the scheduler's timer queue.

Run by hand from the project folder::

    .venv/bin/python -m benchmarks.timers [--tasks 10000] [--wait-s 5]

Every task's only step fails once at the same moment and backs off ``--wait-s`` (no jitter), so all the
timers come due together: the worst case for a timer queue. The failures are stamped with one instant
``--lead-s`` ahead, so that deciding them all (seconds on a busy machine) ends before the first is due.

The scheduler's own parts run in this process, as they do in ``stepstream run scheduler``: the decider
records each ``StepRetryScheduled``, the ``TimerQueue`` (scheduler/timers.py) holds and fires the timers,
and a consumer thread plays the scheduler's inbox loop, deciding each ``RetryDue`` into the attempt's
``StepStarted`` and re-arming from the new state.
What is left out is Kafka: a firing goes from the queue to the consumer through an in-memory queue instead
of a produce to ``inbox`` and a consume back (a few milliseconds on a local broker, BENCHMARKS.md).

Measured: how late each attempt started after its ``not_before`` (p50 / p99 / max), the CPU the process
spent while every timer was waiting (between arming the last and the first coming due) and while firing,
and the events a retry that waits adds to the log.

Progress goes to stderr, a table to stdout; the last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import os
import queue
import sys
import threading
import time
from datetime import UTC, datetime, timedelta

import orjson

from scheduler.decider import Limits, TaskState, decide, fold, pending
from scheduler.timers import TimerQueue
from scheduler.workflow import Backoff, Step, Workflow, WorkflowRegistry
from schemas.messages import Event, RetryDue, StepResult, StepRetryScheduled, StepStarted, SubmitTask

LIMITS = Limits(max_in_flight=10**9)


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


class Scheduler:
    """The scheduler's decisions on an in-memory log: states by task, and the attempts timers started."""

    def __init__(self, registry: WorkflowRegistry) -> None:
        self.registry = registry
        self.states: dict[str, TaskState] = {}
        self.lateness_s: list[float] = []
        self.events_per_retry: list[int] = []

    def decide(self, command: SubmitTask | StepResult | RetryDue, now: datetime | None = None) -> tuple[Event, ...]:
        state = self.states.get(command.task_id)
        decision = decide(command, state, registry=self.registry, now=now or datetime.now(UTC), in_flight=0,
                          limits=LIMITS)
        after = fold(decision.events, state)
        assert after is not None
        self.states[command.task_id] = after
        return decision.events


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=10_000)
    parser.add_argument("--wait-s", type=float, default=5.0)
    parser.add_argument("--lead-s", type=float, default=10.0,
                        help="the failures are stamped this far ahead, so deciding them all ends before any is due")
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    workflow = Workflow("bench", 1, (Step("pay", "payments", attempt_budget=4, calls_per_attempt=1,
                                          backoff=Backoff(initial_s=args.wait_s, jitter=0.0)),), failure_threshold=3)
    scheduler = Scheduler(WorkflowRegistry.of([workflow]))
    ids = [f"timer-{i:05d}" for i in range(args.tasks)]
    for task_id in ids:
        scheduler.decide(SubmitTask(task_id=task_id, workflow="bench", input={}))
    print(f"{len(ids)} tasks started; failing each once", file=sys.stderr)

    inbox: queue.Queue[RetryDue] = queue.Queue()
    stop = threading.Event()
    timers = TimerQueue(lambda _partition, due: inbox.put(due), lambda: None,
                        lambda _partition, due: pending(scheduler.states[due.task_id]) is not None, stop)
    started = threading.Event()

    def consume() -> None:
        """The scheduler's inbox loop for the firings: decide each, note how late its attempt started."""
        count = 0
        while count < len(ids):
            due = inbox.get()
            events = scheduler.decide(due)
            for event in events:
                if isinstance(event, StepStarted):
                    scheduler.lateness_s.append((event.occurred_at - due.not_before).total_seconds())
                    count += 1
            timers.arm(0, pending(scheduler.states[due.task_id]), due.task_id)
        started.set()

    threading.Thread(target=timers.run, daemon=True).start()
    threading.Thread(target=consume, daemon=True).start()

    failed_at = datetime.now(UTC) + timedelta(seconds=args.lead_s)  # one instant: every step fails at once
    arm_cpu = time.process_time()
    for task_id in ids:
        state = scheduler.states[task_id]
        assert state.current_step is not None
        events = scheduler.decide(StepResult(task_id=task_id, step="pay", attempt_id=state.steps[0].lock or "",
                                             ok=False, error="503", calls=1, error_kind="server_error"), failed_at)
        scheduler.events_per_retry.append(sum(isinstance(e, StepRetryScheduled) for e in events))
        timers.arm(0, pending(scheduler.states[task_id]), task_id)
    arm_cpu = time.process_time() - arm_cpu
    if datetime.now(UTC) >= failed_at + timedelta(seconds=args.wait_s):
        print("deciding the failures outlasted --lead-s + --wait-s: raise --lead-s", file=sys.stderr)
        return 1
    first_due = min(t.not_before for t in (pending(scheduler.states[i]) for i in ids) if t is not None)
    print(f"{len(timers)} timers armed in {arm_cpu:.2f}s CPU; waiting until {first_due.isoformat()}", file=sys.stderr)

    wait_wall, wait_cpu = time.monotonic(), time.process_time()
    started.wait(timeout=max(0.0, (first_due - datetime.now(UTC)).total_seconds() - 0.05))
    wait_wall, wait_cpu = time.monotonic() - wait_wall, time.process_time() - wait_cpu
    fire_wall, fire_cpu = time.monotonic(), time.process_time()
    assert started.wait(timeout=600), "not every timer started its attempt within 10 minutes"
    fire_wall, fire_cpu = time.monotonic() - fire_wall, time.process_time() - fire_cpu
    stop.set()
    timers.wake()

    lateness = scheduler.lateness_s
    figures = {
        "tasks": len(ids),
        "wait_s": args.wait_s,
        "lateness_ms": {"p50": round(percentile(lateness, 0.50) * 1000, 1),
                        "p99": round(percentile(lateness, 0.99) * 1000, 1),
                        "max": round(max(lateness) * 1000, 1), "min": round(min(lateness) * 1000, 1)},
        "cpu_while_waiting": {"wall_s": round(wait_wall, 3), "cpu_s": round(wait_cpu, 4),
                              "share_of_a_core": round(wait_cpu / wait_wall, 5) if wait_wall else None},
        "firing": {"wall_s": round(fire_wall, 3), "cpu_s": round(fire_cpu, 3),
                   "cpu_ms_per_timer": round(fire_cpu * 1000 / len(ids), 3)},
        "arming_cpu_ms_per_timer": round(arm_cpu * 1000 / len(ids), 3),
        "events_added_per_retry": sum(scheduler.events_per_retry) / len(ids),
        "inbox_commands_per_retry": 1,
        "cpus": os.cpu_count(),
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in os.getloadavg()],
    }
    print(f"{'timers':<28}{len(ids)} due together after {args.wait_s:g}s")
    print(f"{'late (p50 / p99 / max)':<28}{figures['lateness_ms']['p50']} / {figures['lateness_ms']['p99']} / "
          f"{figures['lateness_ms']['max']} ms")
    print(f"{'CPU while waiting':<28}{wait_cpu:.4f}s in {wait_wall:.2f}s")
    print(f"{'CPU firing':<28}{fire_cpu:.2f}s ({figures['firing']['cpu_ms_per_timer']} ms a timer)")
    print(f"{'events per retry':<28}+{figures['events_added_per_retry']:g} (StepRetryScheduled), "
          "+1 inbox command (RetryDue)")
    sys.stdout.write(orjson.dumps(figures).decode() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
