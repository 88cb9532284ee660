"""The scheduler's memory does not grow with what tasks carried, and an aborted batch costs only its tasks.

A finished task is kept settled (``TaskState.settled``: no input, outputs or clocks): every command a
finished task can still receive is decided exactly as on its full state, checked here on the recorded
histories of real runs. An aborted transaction puts back the tasks of that batch from memory, without
reading the log again (no broker here: a restore would need one).
"""

from __future__ import annotations

from contextlib import closing
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from prometheus_client import REGISTRY as REGISTRY_METRICS

from demo.workflows import REGISTRY
from eventstore.errors import PoisonMessageError
from eventstore.runtime import Record
from eventstore.topics import TopicLayout
from projections.store import SqliteStore
from scheduler.decider import Command, Limits, TaskState, decide, fold
from scheduler.service import Scheduler
from scheduler.settled import PartitionTasks, UnreadableSettledState
from schemas.messages import (
    AttemptAccepted,
    Message,
    OperatorCommand,
    RecoverStep,
    StepCompensationStarted,
    StepResult,
    StepStarted,
    SubmitTask,
    TaskAccepted,
    TaskCompleted,
)
from schemas.sealed import Keyring
from schemas.states import FINAL
from tests.fakes import RecordingOutput
from tests.kafka_helpers import wait_for
from tests.recorded import load, recordings
from tests.system import System
from tests.test_compensation_end_to_end import KEY

NOW = datetime(2027, 1, 1, tzinfo=UTC)
FINISHED = [task for path in recordings() for task in load(path) if task.state["status"] in FINAL]


def late_commands(state: TaskState, accepted: TaskAccepted) -> list[Command]:
    """What a finished task can still receive: its submission again, other data under its id, answers and
    recoveries of every attempt it started, operator commands (one a repeat of an answered id)."""
    commands: list[Command] = [
        SubmitTask(task_id=state.task_id, workflow=state.workflow, workflow_version=state.workflow_version,
                   input=accepted.input),
        SubmitTask(task_id=state.task_id, workflow=state.workflow, workflow_version=None, input=accepted.input),
        SubmitTask(task_id=state.task_id, workflow=state.workflow, input={**accepted.input, "qty": 99}),
    ]
    for step in state.steps:
        for n in range(1, step.attempt + 1):
            attempt_id = f"{state.task_id}:{step.name}:{n}"
            commands += [StepResult(task_id=state.task_id, step=step.name, attempt_id=attempt_id, ok=True),
                         StepResult(task_id=state.task_id, step=step.name, attempt_id=attempt_id, ok=False,
                                    permanent=True),
                         RecoverStep(task_id=state.task_id, attempt_id=attempt_id, reason="expired"),
                         AttemptAccepted(task_id=state.task_id, step=step.name, attempt_id=attempt_id,
                                         accepted_at=NOW)]
    for action in ("resubmit", "compensate", "cancel", "retry-compensation", "release"):
        commands.append(OperatorCommand(task_id=state.task_id, command_id=f"late-{action}", action=action))
    commands += [OperatorCommand(task_id=state.task_id, command_id=command_id, action="cancel")
                 for command_id in state.commands]
    return commands


@pytest.mark.parametrize("task", FINISHED, ids=[task.task_id for task in FINISHED])
def test_every_command_to_a_finished_task_is_decided_on_its_settled_state_as_on_its_full_state(task: Any) -> None:
    events = task.decoded()
    full = fold(events)
    assert full is not None
    settled = full.settled()
    assert settled.input == {} and all(step.output is None and step.lease is None for step in settled.steps)
    for command in late_commands(full, events[0]):
        def decided(state: TaskState, command: Command = command) -> tuple[list[dict[str, Any]], str | None]:
            decision = decide(command, state, registry=REGISTRY, now=NOW, in_flight=0, limits=Limits())
            return [e.model_dump(exclude={"message_id"}) for e in decision.events], decision.dead_letter

        assert decided(settled) == decided(full), command


def test_a_repeated_and_a_contradictory_submission_of_a_finished_task_are_told_apart_on_its_settled_state() -> None:
    task = next(t for t in FINISHED if t.task_id == "v2-completed")
    events = task.decoded()
    settled = fold(events)
    assert settled is not None
    settled = settled.settled()
    accepted = events[0]
    assert isinstance(accepted, TaskAccepted)
    again = SubmitTask(task_id=task.task_id, workflow="orders", workflow_version=2, input=accepted.input)
    other = SubmitTask(task_id=task.task_id, workflow="orders", workflow_version=2, input={**accepted.input, "qty": 9})
    same = decide(again, settled, registry=REGISTRY, now=NOW, in_flight=0, limits=Limits())
    assert (same.events, same.dead_letter) == ((), None), "a repeat changes nothing"
    refused = decide(other, settled, registry=REGISTRY, now=NOW, in_flight=0, limits=Limits())
    assert [type(e).__name__ for e in refused.events] == ["OperatorAlert"] and refused.dead_letter


# ---- an aborted batch --------------------------------------------------------------------------------


def scheduler(partitions: int = 1) -> Scheduler:
    """A scheduler of ``partitions`` inbox partitions: each record given to ``handle`` must be on the partition
    that owns its task (one elsewhere is moved, not decided)."""
    layout = TopicLayout(prefix="memory.", partitions=partitions)
    # The demo's latest version marks a field: a scheduler of its registry starts only with a master key.
    made = Scheduler(bootstrap="127.0.0.1:9", layout=layout, registry=REGISTRY, limits=Limits(),
                     keyring=Keyring.parse(f"k1:{KEY}"))
    # Agent topics are created with their first request; here nothing is created anywhere.
    made._known_topics.update(layout.agent(step.agent) for w in REGISTRY.workflows() for step in w.steps)
    return made


def handle(made: Scheduler, message: Message, partition: int = 0) -> RecordingOutput:
    output = RecordingOutput()
    made.handle(Record("memory.inbox", partition, 0, message.task_id, message, []), output)  # type: ignore[arg-type]
    return output


def submit(task_id: str) -> SubmitTask:
    return SubmitTask(task_id=task_id, workflow="orders", workflow_version=2,
                      input={"order_id": task_id, "sku": "A-1", "qty": 1, "amount": 10})


def test_an_aborted_batch_puts_back_only_its_own_tasks_as_they_were_when_it_began() -> None:
    made = scheduler(partitions=2)  # kept and other own partition 0, elsewhere 1
    first = handle(made, submit("kept"))
    made.committed()
    kept = made._tasks[0]["kept"]
    started = next(m for _t, m in first.sent if isinstance(m, StepStarted))

    handle(made, AttemptAccepted(task_id="kept", step=started.step, attempt_id=started.attempt_id,
                                 accepted_at=datetime.now(UTC) + timedelta(seconds=1)))
    handle(made, submit("other"))
    handle(made, submit("elsewhere"), partition=1)
    assert made._tasks[0]["kept"] != kept and made.in_flight(0) == 2

    made.recover_batch()
    assert made._tasks[0] == {"kept": kept}, "the accepted attempt is undone, the new task forgotten"
    assert REGISTRY_METRICS.get_sample_value("stepstream_scheduler_tasks_held", {"partition": "0"}) == 1
    assert made._tasks[1] == {} and (made.in_flight(0), made.in_flight(1)) == (1, 0)
    again = handle(made, submit("other"))
    assert any(isinstance(m, TaskAccepted) for _t, m in again.sent), "the aborted submission is decided again"


# ---- finished tasks leave memory -----------------------------------------------------------------------------


def run_to_the_end(made: Scheduler, task_id: str, partition: int = 0) -> list[Message]:
    """Submit a task and answer each of its attempts with success, as its agents would; what was sent."""
    sent = [m for _t, m in handle(made, submit(task_id), partition).sent]
    while (started := next((m for m in sent[::-1] if isinstance(m, StepStarted)), None)) is not None:
        answer = StepResult(task_id=task_id, step=started.step, attempt_id=started.attempt_id, ok=True,
                            output={"ref": f"{started.step}-{task_id}"})
        sent = [m for _t, m in handle(made, answer, partition).sent]
        if any(isinstance(m, TaskCompleted) for m in sent):
            return sent
    raise AssertionError(f"task {task_id} did not complete: {sent}")


def test_finished_tasks_leave_memory_for_the_spill_and_only_live_ones_stay() -> None:
    made = scheduler()
    for n in range(30):
        run_to_the_end(made, f"done-{n}")
        made.committed()
    handle(made, submit("live"))
    made.committed()
    tasks = made._tasks[0]
    assert (tasks.in_memory, tasks.spilled, len(tasks)) == (1, 30, 31)
    assert REGISTRY_METRICS.get_sample_value("stepstream_scheduler_tasks_held", {"partition": "0"}) == 1
    assert REGISTRY_METRICS.get_sample_value("stepstream_scheduler_tasks_spilled", {"partition": "0"}) == 30
    done = tasks["done-7"]
    assert done.status == "completed" and done == done.settled(), "read back from the spill, settled"
    assert made.in_flight(0) == 1


def test_a_repeated_and_a_contradictory_submission_of_a_spilled_task_are_told_apart() -> None:
    made = scheduler()
    run_to_the_end(made, "spilled")
    made.committed()
    assert made._tasks[0].held("spilled") is None, "not in memory any more"

    assert handle(made, submit("spilled")).sent == [], "a repeat changes nothing"
    with pytest.raises(PoisonMessageError, match="contradictory duplicate submission"):
        handle(made, SubmitTask(task_id="spilled", workflow="orders", workflow_version=2,
                                input={"order_id": "spilled", "sku": "B-2", "qty": 9, "amount": 90}))
    assert made._tasks[0]["spilled"].status == "completed"


def test_a_task_waiting_for_an_operator_is_spilled_whole_and_comes_back_to_memory_when_retried() -> None:
    made = scheduler()
    made._known_topics.update(made.layout.agent(step.compensation.agent) for w in REGISTRY.workflows()
                              for step in w.steps if step.compensation is not None)
    started = next(m for _t, m in handle(made, submit("stuck")).sent if isinstance(m, StepStarted))
    undo = next(m for _t, m in handle(made, StepResult(task_id="stuck", step=started.step, ok=False, permanent=True,
                                                      attempt_id=started.attempt_id)).sent
                if isinstance(m, StepCompensationStarted))
    handle(made, StepResult(task_id="stuck", step=undo.step, attempt_id=undo.attempt_id, ok=False, permanent=True))
    made.committed()
    tasks = made._tasks[0]
    assert (tasks["stuck"].status, tasks.in_memory, tasks.spilled) == ("compensation_failed", 0, 1)
    assert tasks["stuck"].steps[0].error, "kept whole, not settled: the operator's retry needs it"

    retried = handle(made, OperatorCommand(task_id="stuck", command_id="c1", action="retry-compensation"))
    assert any(isinstance(m, StepCompensationStarted) for _t, m in retried.sent)
    assert (tasks["stuck"].status, tasks.in_memory, tasks.spilled) == ("compensating", 1, 0)


def test_a_task_finished_by_an_aborted_batch_is_put_back_live_and_out_of_the_spill() -> None:
    made = scheduler()
    sent = [m for _t, m in handle(made, submit("undone")).sent]
    made.committed()
    before = made._tasks[0]["undone"]
    for _ in range(3):  # the orders workflow's steps, answered in one batch that then aborts
        started = next(m for m in sent[::-1] if isinstance(m, StepStarted))
        sent = [m for _t, m in handle(made, StepResult(task_id="undone", step=started.step,
                                                       attempt_id=started.attempt_id, ok=True)).sent]
    assert any(isinstance(m, TaskCompleted) for m in sent) and made._tasks[0].spilled == 1

    made.recover_batch()
    tasks = made._tasks[0]
    assert (tasks.in_memory, tasks.spilled) == (1, 0)
    assert tasks["undone"] == before and made.in_flight(0) == 1


def test_the_spill_is_a_mapping_that_keeps_only_finished_tasks_out_of_memory() -> None:
    made = scheduler()
    finished = run_to_the_end(made, "t")
    state = made._tasks[0]["t"]
    tasks = PartitionTasks()
    with closing(tasks):
        tasks["t"] = state
        tasks.forget_fresh()
        assert tasks["t"] == state and "t" in tasks and list(tasks) == ["t"] and tasks.held("t") is None
        tasks.spill_record("r", b'{"not": "a state"}', 3, 5)
        tasks.loaded()
        assert tasks.reflected("r") == (3, 5) and len(tasks) == 2
        with pytest.raises(UnreadableSettledState, match="task r"):
            tasks["r"]
        del tasks["r"]
        assert "r" not in tasks and tasks.get("r") is None and tasks.spilled == 1
        assert isinstance(finished[-1], TaskCompleted)


# ---- the whole system ------------------------------------------------------------------------------------


@pytest.mark.kafka
def test_a_task_finished_before_a_restart_takes_its_submission_again_as_a_repeat_and_refuses_other_data(
    system: System,
) -> None:
    system.start()
    system.submit("long-done", version=1)
    assert system.wait_terminal(["long-done"], timeout_s=90) == {"long-done": "completed"}
    assert system.procs.terminate("scheduler") == 0
    system.restart("scheduler")  # restores the finished task settled
    before = system.events("long-done")

    system.submit("long-done", version=1)
    system.submit("long-done", {"order_id": "long-done", "sku": "B-2", "qty": 5, "amount": 50}, version=1)
    with closing(SqliteStore(system.store_path)) as store:
        assert wait_for(lambda: any(d["message_key"] == "long-done" for d in store.dlq_entries()), timeout_s=60)
        (dead,) = [d for d in store.dlq_entries() if d["message_key"] == "long-done"]
        assert dead["reason"].startswith("contradictory duplicate submission"), dead["reason"]
        assert (store.task("long-done") or {})["status"] == "completed"
    after = system.events("long-done")
    assert after[: len(before)] == before
    assert [type(e).__name__ for e in after[len(before):]] == ["OperatorAlert"], \
        "the repeat changed nothing; the contradiction only raised an alert"
