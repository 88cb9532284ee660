"""``python -m tests.record_histories [--out FILE]``: record task histories of a real run into the repository.

Starts a broker of its own (in a temporary folder), the order service and every service as a process, on
the demo's workflows (``orders`` v1, which leaves a failed task in error, v2, which compensates, v3, which waits
between attempts, and v4, paid with a sealed card token), and
drives tasks through what a live system meets: the forward path of each version, a repeated and a
contradictory submission, compensation after a permanent refusal, an operator's compensate, resubmit,
cancel (with the abandoned attempt's late answer), a refused command and a retried compensation, and an
attempt timed out by the supervisor whose agent answers after the fact. Then it writes every task's events
as they stand on ``events`` with the state today's decider folds from them (``tests/recorded.py``).

``tests/test_recorded_histories.py`` replays the recordings with the decider of the day, as Temporal's
replayer replays workflow histories: a change to ``evolve`` that would no longer fold the history of a
task already running in production fails there. Record again (a new file, keep the old ones) when a
release adds an event or changes what the scheduler writes, so each release's histories stay replayed.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path

from confluent_kafka.admin import AdminClient

from demo.orders_client import ServiceProcess
from eventstore.broker import LocalBroker
from eventstore.replay import ReplayReader
from eventstore.topics import TopicLayout, ensure_topics
from scheduler.decider import fold
from schemas.messages import Event, LateResultRecorded, MessageIgnored, OperatorAlert, StepFailed
from tests.kafka_helpers import wait_for
from tests.recorded import HISTORIES, RecordedTask, dump, state_document
from tests.system import ROOT, System
from tests.test_compensation_end_to_end import KEY

COMPENSATION_AGENTS = ("inventory-release", "payments-refund", "shipping-cancel")
V1, V2, V3, V4 = 1, 2, 3, 4


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.record_histories", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=HISTORIES / "orders.jsonl", help="the recording to write")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="record-histories-") as folder:
        tmp = Path(folder)
        broker = LocalBroker(tmp / "kafka-home")
        bootstrap = broker.start().bootstrap_servers
        try:
            with ServiceProcess(log_path=tmp / "orders-service.log") as service:
                system = _system(bootstrap, tmp, service)
                try:
                    written = record(system, args.out)
                finally:
                    system.stop()
        finally:
            broker.stop()
    print(f"{written} task histories written to {args.out}")
    return 0


def _system(bootstrap: str, tmp: Path, service: ServiceProcess) -> System:
    layout = TopicLayout(prefix=f"rec{uuid.uuid4().hex[:8]}.", partitions=3)
    ensure_topics(AdminClient({"bootstrap.servers": bootstrap}), layout.core_specs())
    system = System(bootstrap, layout, {
        **os.environ,
        "STEPSTREAM_BOOTSTRAP_SERVERS": bootstrap,
        "STEPSTREAM_TOPIC_PREFIX": layout.prefix,
        "STEPSTREAM_PARTITIONS": str(layout.partitions),
        "STEPSTREAM_HOME": str(tmp / "home"),
        "STEPSTREAM_CONSUMER_POLL_TIMEOUT_S": "0.1",
        "STEPSTREAM_CONSUMER_COMMIT_INTERVAL_MS": "100",
        "STEPSTREAM_CONSUMER_SESSION_TIMEOUT_MS": "6000",
        "PYTHONUNBUFFERED": "1",
    }, tmp, service)
    system.env["STEPSTREAM_SCHEDULER_WORKFLOWS"] = "demo.workflows:REGISTRY"
    system.env["STEPSTREAM_ENCRYPTION_KEYS"] = f"k1:{KEY}"  # the latest version marks a field
    return system


def record(system: System, out: Path) -> int:
    for name in COMPENSATION_AGENTS:
        system.procs.service(name, "agent", name)
    system.start()
    for name in COMPENSATION_AGENTS:
        system.procs.wait_started(name)
    for scenario in (forward, compensation, operators, timeout_and_late_answer, waiting, paid_and_erased):
        scenario(system)
    events: dict[str, list[Event]] = {}
    values: dict[str, list[bytes]] = {}
    reader = ReplayReader(system.bootstrap, system.layout.events)
    for _partition, _offset, _key, value in reader.raw():
        event = reader.codec.decode(value)
        if isinstance(event, Event) and value is not None:
            events.setdefault(event.task_id, []).append(event)
            values.setdefault(event.task_id, []).append(value)
    tasks = []
    for task_id, history in sorted(events.items()):
        state = fold(history)
        assert state is not None
        stored = system.task(task_id)
        assert stored is not None and stored["status"] == state.status, (task_id, stored, state.status)
        tasks.append(RecordedTask(task_id, state.workflow, state.workflow_version, tuple(values[task_id]),
                                  state_document(state)))
    return dump(tasks, out)


def forward(system: System) -> None:
    """Both versions complete; the same submission again changes nothing, other data under its id is refused."""
    system.submit("v1-completed", version=V1)
    system.submit("v2-completed", version=V2)
    system.wait_terminal(["v1-completed", "v2-completed"], timeout_s=120)
    system.submit("v2-completed", version=V2)
    system.submit("v2-completed", {"order_id": "other", "sku": "B-2", "qty": 2, "amount": 20}, version=V2)
    _until(lambda: any(isinstance(e, OperatorAlert) for e in system.events("v2-completed")), system)


def compensation(system: System) -> None:
    """Shipping refuses for good: v2 undoes charge and reservation; a refund refused too fails the compensation,
    which an operator retries once the refunds work again."""
    system.admin.set_faults("shipping/create", permanent_error_rate=1.0)
    system.submit("v2-compensated", version=V2)
    system.wait_terminal(["v2-compensated"], timeout_s=120)
    system.admin.set_faults("payments/refund", permanent_error_rate=1.0)
    system.submit("v2-compensation-retried", version=V2)
    system.wait_terminal(["v2-compensation-retried"], timeout_s=120)
    system.admin.clear_faults("payments/refund")
    _operator(system, "retry-compensation", "v2-compensation-retried")
    system.wait_terminal(["v2-compensation-retried"], timeout_s=120)
    system.admin.clear_faults()


def operators(system: System) -> None:
    """v1 leaves a refused task in error: one is compensated by an operator (nothing declared to undo, each
    step skipped), one resubmitted once shipping works; a cancel of a hung charge, with commands refused."""
    system.admin.set_faults("shipping/create", permanent_error_rate=1.0)
    system.submit("v1-compensated", version=V1)
    system.submit("v1-resubmitted", version=V1)
    system.wait_terminal(["v1-compensated", "v1-resubmitted"], timeout_s=120)
    _operator(system, "compensate", "v1-compensated")
    system.admin.clear_faults()
    _operator(system, "resubmit", "v1-resubmitted")
    system.wait_terminal(["v1-compensated", "v1-resubmitted"], timeout_s=120)

    system.admin.set_faults("payments/charge", hang=True, hang_max_s=60)
    system.submit("v2-cancelled", version=V2)
    _until(lambda: _step_status(system, "v2-cancelled", "charge") == "processing", system)
    _operator(system, "resubmit", "v2-cancelled", refused=True)
    _operator(system, "cancel", "v2-cancelled")
    system.wait_terminal(["v2-cancelled"], timeout_s=120)
    system.admin.clear_faults()
    abandoned = next(e.attempt_id for e in system.events("v2-cancelled")
                     if isinstance(e, StepFailed) and "abandoned" in e.error)
    _until(lambda: any(isinstance(e, MessageIgnored | LateResultRecorded) and e.attempt_id == abandoned
                       for e in system.events("v2-cancelled")), system)
    _operator(system, "compensate", "v2-cancelled", refused=True)


def timeout_and_late_answer(system: System) -> None:
    """The shipping agent stops mid-call: the supervisor times the attempt out at its complete-by, the next
    attempt completes the task, and the stopped agent, resumed, answers for an attempt no longer current."""
    system.admin.set_faults("shipping/create", hang=True, hang_max_s=60)
    system.submit("v2-timed-out", version=V2)
    _until(lambda: _step_status(system, "v2-timed-out", "ship") == "processing", system)
    system.procs.signal("shipping", signal.SIGSTOP)
    try:
        _until(lambda: any(isinstance(e, StepFailed) and e.timed_out for e in system.events("v2-timed-out")),
               system)
        system.admin.clear_faults()
    finally:
        system.procs.signal("shipping", signal.SIGCONT)
    system.wait_terminal(["v2-timed-out"], timeout_s=120)


def waiting(system: System) -> None:
    """v3 waits between attempts: a charge throttled with a Retry-After longer than the attempt waits for its
    timer (StepRetryScheduled, then RetryDue fires the next attempt); a second waits longer still, until an
    operator's try-now brings its timer forward (RetryBroughtForward)."""
    system.admin.set_faults("payments/charge", throttle_rate=1.0, retry_after_s=8)
    system.submit("v3-waited", version=V3)
    _until(lambda: _step_status(system, "v3-waited", "charge") == "waiting", system)
    system.admin.clear_faults()
    system.wait_terminal(["v3-waited"], timeout_s=120)
    system.admin.set_faults("payments/charge", throttle_rate=1.0, retry_after_s=600)
    system.submit("v3-tried-now", version=V3)
    _until(lambda: _step_status(system, "v3-tried-now", "charge") == "waiting", system)
    system.admin.clear_faults()
    _operator(system, "try-now", "v3-tried-now")
    system.wait_terminal(["v3-tried-now"], timeout_s=120)


def paid_and_erased(system: System) -> None:
    """v4 is paid with a card: its token sealed from submission on (the scheduler seals one sent in clear);
    once the task completed, an operator erases its data (TaskDataErased, the data key tombstoned)."""
    system.submit("v4-erased", {"order_id": "v4-erased", "sku": "A-1", "qty": 1, "amount": 10,
                                "card_token": "tok_recorded_4242"}, version=V4)
    system.wait_terminal(["v4-erased"], timeout_s=120)
    _operator(system, "erase", "v4-erased")


def _step_status(system: System, task_id: str, step: str) -> str | None:
    return next((row["status"] for row in system.steps(task_id) if row["step"] == step), None)


def _operator(system: System, action: str, task_id: str, *, refused: bool = False) -> None:
    done = system.cli("task", action, task_id, "--wait", cwd=ROOT)
    assert done.returncode == (6 if refused else 0), done.stdout + done.stderr


def _until(condition: Callable[[], bool], system: System) -> None:
    assert wait_for(condition, timeout_s=120, interval_s=0.3), system.logs_tail()


if __name__ == "__main__":
    sys.exit(main())
