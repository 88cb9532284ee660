"""Property tests of the decider: random command sequences against a small registry keep every invariant.

Timers are part of it: a workflow version with back-off on its steps and its undo, results that carry an
error kind and a suggested delay (``Retry-After``) or that were refused without a call (deferred), and
timers fired on time, early, twice or stale. No attempt ever starts before its timer's ``not_before``,
and a deferral charges nothing against the budget or the failure threshold.

Hypothesis drives a scheduler of three tasks with submissions (repeats and contradictions included),
successes and transient or permanent failures for current, stale and made-up attempt ids (forward and
compensating), agents' acknowledgements (taken early, late, twice, for stale attempts), recoveries at times
around each deadline, operator commands (every action, on any step,
with command ids that repeat), and a clock that moves on. After every command the decision and the
states it leads to are checked, and at the end every history is replayed through the Avro codec.

Compensation undoes every step that may have been applied: every step any attempt of which started,
whether it succeeded or failed (timed out, abandoned, refused), last started first. A definite answer
(success or permanent failure) for an attempt that was started but is no longer current is recorded
(``LateResultRecorded``); any other answer that is not for the current attempt is ignored.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import replace
from datetime import UTC, datetime, timedelta

from hypothesis import event as note
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from scheduler.decider import (
    Command,
    Decision,
    Limits,
    StepState,
    TaskState,
    decide,
    fold,
)
from scheduler.decider.timers import defer_s, not_before
from scheduler.workflow import Backoff, Compensation, Step, Workflow, WorkflowRegistry
from schemas.codec import default_codec
from schemas.messages import (
    AttemptAccepted,
    CompensationRetried,
    CompensationStarted,
    ErrorKind,
    Event,
    LateResultRecorded,
    MessageIgnored,
    OperatorAction,
    OperatorAlert,
    OperatorCommand,
    OperatorCommandRefused,
    RecoverStep,
    RetryBroughtForward,
    RetryDue,
    StepAccepted,
    StepCompensated,
    StepCompensationSkipped,
    StepCompensationStarted,
    StepFailed,
    StepResubmitted,
    StepResult,
    StepRetryScheduled,
    StepStarted,
    SubmitTask,
    TaskAccepted,
    TaskCompensationFailed,
    TaskRejected,
)
from schemas.states import FINAL, TERMINAL

UNDO = Compensation("undo", timeout_s=3, attempt_budget=3, calls_per_attempt=2)
REGISTRY = WorkflowRegistry.of([
    Workflow(
        "flow",
        1,
        (
            Step("a", "agent-a", timeout_s=10, attempt_budget=4, calls_per_attempt=2, compensation=UNDO),
            Step("b", "agent-b", timeout_s=5, attempt_budget=3, calls_per_attempt=3),
        ),
        failure_threshold=3,
    ),
    Workflow("flow", 2, (Step("c", "agent-c", timeout_s=1, attempt_budget=2, calls_per_attempt=1, compensation=UNDO),),
             failure_threshold=1, escalation="compensate"),
    Workflow(
        "flow",
        3,
        (
            Step("d", "agent-d", timeout_s=4, compensation=UNDO),
            Step("e", "agent-e", timeout_s=4),
            Step("f", "agent-f", timeout_s=4, compensation=Compensation("undo-f", timeout_s=2, attempt_budget=2,
                                                                        calls_per_attempt=1)),
            Step("g", "agent-g", timeout_s=4, attempt_budget=2, calls_per_attempt=1),
        ),
        failure_threshold=2,
        escalation="compensate",
    ),
    Workflow(
        "flow",
        4,
        (
            Step("h", "agent-h", timeout_s=4, attempt_budget=4, calls_per_attempt=2,
                 backoff=Backoff(initial_s=5, multiplier=2, max_s=20),
                 compensation=Compensation("undo-h", timeout_s=2, attempt_budget=5, calls_per_attempt=1,
                                           backoff=Backoff(initial_s=3, max_s=10), long_backoff_s=30,
                                           backoff_rounds=1)),
            Step("i", "agent-i", timeout_s=4, attempt_budget=3, calls_per_attempt=2, backoff=Backoff(initial_s=1)),
        ),
        failure_threshold=3,
        escalation="backoff",
        long_backoff_s=60,
        backoff_rounds=1,
        after_backoff="compensate",
    ),
    # Rounds enough for minutes, but a step may be retried for 45 s from its first attempt only.
    Workflow("flow", 5, (Step("j", "agent-j", timeout_s=4, attempt_budget=20, calls_per_attempt=1,
                              backoff=Backoff(initial_s=2, max_s=8)),),
             failure_threshold=2, escalation="backoff", long_backoff_s=20, backoff_rounds=5, step_total_s=45),
])
LIMITS = Limits(max_in_flight=2)
TASKS = ("t1", "t2", "t3")
START = datetime(2025, 1, 1, tzinfo=UTC)
ACTIONS: tuple[OperatorAction, ...] = ("resubmit", "compensate", "cancel", "retry-compensation", "try-now")

tasks = st.sampled_from(TASKS)
# Weighted towards the attempt in progress and towards success, so runs get past their first step.
attempt_choices = st.sampled_from(["current", "current", "current", "stale", "made-up"])
outcomes = st.sampled_from(["ok", "ok", "ok", "transient", "permanent"])
kinds = st.sampled_from([None, "server_error", "throttled", "timeout", "breaker_open", "budget_spent"])


class DeciderMachine(RuleBasedStateMachine):
    """Plays the scheduler service: decides each command on the task's state, then folds the events in."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = START
        self.states: dict[str, TaskState | None] = dict.fromkeys(TASKS)
        self.histories: dict[str, list[Event]] = {task: [] for task in TASKS}
        self.attempts: dict[str, list[str]] = {task: [] for task in TASKS}
        self.timers: dict[str, list[RetryDue]] = {task: [] for task in TASKS}

    # ---- commands -------------------------------------------------------------------------------

    @rule(task=tasks, workflow=st.sampled_from([("flow", None), ("flow", 1), ("flow", 2), ("flow", 3),
                                                ("flow", 4), ("flow", 5), ("nope", None)]),
          data=st.sampled_from([{"n": 1}, {"n": 2}]))
    def submit(self, task: str, workflow: tuple[str, int | None], data: dict[str, int]) -> None:
        name, version = workflow
        self.run(SubmitTask(task_id=task, workflow=name, workflow_version=version, input=data), self.clock)

    @rule(task=tasks, which=attempt_choices, pick=st.integers(0, 20),
          outcome=outcomes, calls=st.integers(0, 4), kind=kinds, retry_after_s=st.sampled_from([None, 0, 2.5, 10, 40]))
    def result(self, task: str, which: str, pick: int, outcome: str, calls: int, kind: ErrorKind | None,
               retry_after_s: float | None) -> None:
        attempt = self.attempt(task, which, pick)
        failed = outcome != "ok"
        self.run(
            StepResult(task_id=task, step=attempt.split(":")[1], attempt_id=attempt, ok=not failed,
                       output=None if failed else {"by": attempt},
                       error=outcome if failed else None, permanent=outcome == "permanent",
                       calls=calls, error_kind=kind if failed else None,
                       retry_after_s=retry_after_s if failed else None),
            self.clock,
        )

    @rule(task=tasks, which=st.sampled_from(["current", "current", "stale", "made-up"]),
          offset_ms=st.sampled_from([-1000, -1, 0, 0, 1, 700]))
    def fire(self, task: str, which: str, offset_ms: int) -> None:
        """A timer fires: the current one (on time, a little early or late), a stale one, or one never set."""
        timers = self.timers[task]
        current = self.waiting(task)
        if which == "current" and current is not None:
            due = current
        elif which == "stale" and timers:
            due = timers[offset_ms % len(timers)]
        else:
            due = RetryDue(task_id=task, step="h", attempt=7, not_before=self.clock)
        now = max(self.clock, due.not_before + timedelta(milliseconds=offset_ms))
        self.run(RetryDue(task_id=task, step=due.step, attempt=due.attempt, not_before=due.not_before,
                          compensation=due.compensation), now)

    @rule(task=tasks, which=attempt_choices, pick=st.integers(0, 20), taken_after=st.integers(-5, 400))
    def acknowledge(self, task: str, which: str, pick: int, taken_after: int) -> None:
        """An agent took a request, at a time on its own clock (before or after the start-by of 300 s)."""
        attempt = self.attempt(task, which, pick)
        self.run(AttemptAccepted(task_id=task, step=attempt.split(":")[1], attempt_id=attempt,
                                 compensation=":undo:" in attempt,
                                 accepted_at=self.clock + timedelta(seconds=taken_after)), self.clock)

    @rule(task=tasks, which=attempt_choices, pick=st.integers(0, 20), offset=st.integers(-15, 15))
    def recover(self, task: str, which: str, pick: int, offset: int) -> None:
        """A recovery some seconds before or after the current deadline: the supervisor's clock varies."""
        attempt = self.attempt(task, which, pick)
        step = self.in_progress(task)
        around = step.deadline if step is not None and step.deadline is not None else self.clock
        now = max(self.clock, around + timedelta(seconds=offset))
        self.run(RecoverStep(task_id=task, attempt_id=attempt, reason="expired"), now)

    @rule(task=tasks, action=st.sampled_from(ACTIONS), step=st.sampled_from([None, None, "a", "b", "c", "d", "f", "x"]),
          command_id=st.integers(1, 25).map(lambda n: f"op-{n}"))
    def operator(self, task: str, action: OperatorAction, step: str | None, command_id: str) -> None:
        """Any action on any step, with command ids from a pool small enough that repeats happen."""
        self.run(OperatorCommand(task_id=task, command_id=command_id, action=action, step=step, operator="op"),
                 self.clock)

    @rule(task=tasks, undo=st.booleans(), command_id=st.integers(1, 25).map(lambda n: f"op-{n}"))
    def operator_as_the_state_invites(self, task: str, undo: bool, command_id: str) -> None:
        """The command an operator would give: resubmit or compensate a task in error, retry a failed
        compensation, cancel a running task (or, without ``undo``, try to resubmit it: refused)."""
        state = self.states[task]
        status = state.status if state is not None else "running"
        actions: dict[str, OperatorAction] = {
            "error": "compensate" if undo else "resubmit",
            "compensation_failed": "retry-compensation",
            "running": "cancel" if undo else "resubmit",
        }
        if self.waiting(task) is not None:
            actions = {"running": "cancel" if undo else "try-now", "compensating": "try-now"}
        self.run(OperatorCommand(task_id=task, command_id=command_id, action=actions.get(status, "compensate")),
                 self.clock)

    @rule(seconds=st.integers(0, 30))
    def tick(self, seconds: int) -> None:
        self.clock += timedelta(seconds=seconds)

    def attempt(self, task: str, which: str, pick: int) -> str:
        step = self.in_progress(task)
        if which == "current" and step is not None and step.lock is not None:
            return step.lock
        if which == "stale" and self.attempts[task]:
            return self.attempts[task][pick % len(self.attempts[task])]
        return f"{task}:a:{pick + 1}" if pick % 2 else f"{task}:d:undo:{pick + 1}"

    def waiting(self, task: str) -> RetryDue | None:
        """The firing of the task's current timer, if a step of it waits."""
        state = self.states[task]
        for step in state.steps if state is not None else ():
            if step.status == "waiting" and step.timer is not None:
                return RetryDue(task_id=task, step=step.name, attempt=step.timer.attempt,
                                not_before=step.timer.not_before, compensation=step.timer.compensation)
        return None

    def in_progress(self, task: str) -> StepState | None:
        state = self.states[task]
        if state is None or state.current_step is None:
            return None
        return state.steps[state.current_step]

    def run(self, command: Command, now: datetime) -> None:
        before = self.states[command.task_id]
        in_flight = sum(1 for state in self.states.values() if state is not None and not state.is_terminal)
        decision = decide(command, before, registry=REGISTRY, now=now, in_flight=in_flight, limits=LIMITS)
        assert decide(command, before, registry=REGISTRY, now=now, in_flight=in_flight,
                      limits=LIMITS) == decision, "decide is not deterministic"
        after = fold(decision.events, before)
        self.check_decision(command, before, decision, after, now)
        self.states[command.task_id] = after
        self.histories[command.task_id].extend(decision.events)
        self.attempts[command.task_id].extend(
            e.attempt_id for e in decision.events if isinstance(e, StepStarted | StepCompensationStarted))
        self.timers[command.task_id].extend(
            RetryDue(task_id=e.task_id, step=e.step, attempt=e.attempt, not_before=e.not_before,
                     compensation=e.compensation) for e in decision.events if isinstance(e, StepRetryScheduled))

    # ---- checks on each decision ----------------------------------------------------------------

    def check_decision(self, command: Command, before: TaskState | None, decision: Decision,
                       after: TaskState | None, now: datetime) -> None:
        events = decision.events
        first = before.sequence + 1 if before is not None else 1
        assert [e.sequence for e in events] == list(range(first, first + len(events)))
        for event in events:
            assert event.task_id == command.task_id
            assert event.causation_id == command.message_id
            assert event.occurred_at == now
            assert after is not None and (event.workflow, event.workflow_version) == (
                after.workflow, after.workflow_version)
        if decision.dead_letter is not None:
            contradiction = isinstance(command, SubmitTask) and before is not None
            refused = isinstance(command, SubmitTask) and (before is None or before.status == "rejected")
            # A contradiction alerts on the task; a submission wrong in itself is rejected, saying why.
            assert [type(e) for e in events] in ([[OperatorAlert]] if contradiction else []) + (
                [[TaskRejected]] if refused else []) + ([] if contradiction or refused else [[]])
            if [type(e) for e in events] == [TaskRejected]:
                assert after is not None and after.status == "rejected" and after.rejection == decision.dead_letter
        readmission = (before is not None and before.status == "rejected" and isinstance(command, SubmitTask)
                       and bool(events) and not isinstance(events[0], OperatorAlert))
        if readmission:
            # A rejected submission repeated asks for admission again: rejected once more, or admitted.
            assert after is not None and [type(e) for e in events][:1] in ([TaskRejected], [TaskAccepted])
            assert after.status == ("rejected" if isinstance(events[0], TaskRejected) else "running")
        elif before is not None and (before.status in FINAL or (before.is_terminal
                                                                and not isinstance(command, OperatorCommand))):
            # Terminal states are terminal: only an operator's command leaves error or compensation_failed.
            assert all(isinstance(e, MessageIgnored | LateResultRecorded | OperatorAlert | OperatorCommandRefused)
                       for e in events)
            assert after is not None and after.status == before.status
        if before is not None and after is not None:
            self.check_monotonic(before, after, events)
        if isinstance(command, StepResult | RecoverStep | AttemptAccepted) and before is not None:
            current = before.steps[before.current_step] if before.current_step is not None else None
            if current is None or current.lock != command.attempt_id or before.is_terminal:
                self.check_not_current(command, before, events, after)
            elif isinstance(command, AttemptAccepted):
                self.check_accepted(command, current, events, after)
            if isinstance(command, RecoverStep) and current is not None and current.deadline is not None \
                    and now < current.deadline:
                assert [type(e) for e in events] == [MessageIgnored]
        if isinstance(command, OperatorCommand) and before is not None:
            self.check_operator(command, before, events, after)
        if isinstance(command, RetryDue) and before is not None:
            self.check_fired(command, before, events, now)
        suggested = timedelta(seconds=command.retry_after_s or 0) if isinstance(command, StepResult) else timedelta()
        for timer in (e for e in events if isinstance(e, StepRetryScheduled)):
            note("timer set" + (" (deferral)" if timer.deferred_attempt_id else " (new round)" if timer.new_round
                                else "") + (" of an undo" if timer.compensation else ""))
            assert timer.not_before >= now + suggested, "the next attempt waits at least what the agent asked"
        if isinstance(command, StepResult) and command.deferred and before is not None \
                and before.current_step is not None and before.steps[before.current_step].lock == command.attempt_id \
                and not before.is_terminal:
            self.check_deferred(command, before, events, after, now)

    @staticmethod
    def check_fired(command: RetryDue, before: TaskState, events: tuple[Event, ...], now: datetime) -> None:
        """A timer starts its attempt only if it is the step's current timer and due; anything else is silent."""
        step = next((s for s in before.steps if s.name == command.step), None)
        timer = step.timer if step is not None else None
        current = (step is not None and step.status == "waiting" and timer is not None and not before.is_terminal
                   and (timer.attempt, timer.not_before, timer.compensation)
                   == (command.attempt, command.not_before, command.compensation))
        if not current or now < command.not_before:
            assert events == (), "a stale or early timer changes nothing and records nothing"
            return
        assert events, "a current, due timer starts its attempt (or escalates, with no budget left)"
        started = [e for e in events if isinstance(e, StepStarted | StepCompensationStarted)]
        assert all(e.attempt == command.attempt for e in started)
        note("timer fired")

    @staticmethod
    def check_deferred(command: StepResult, before: TaskState, events: tuple[Event, ...], after: TaskState | None,
                       now: datetime) -> None:
        """An attempt refused without a call ends in a timer, not a failure: nothing charged, nothing counted;
        unless a forward attempt's deferral could start only past the step's total time, when the step gives up
        (its attempt failed, charging no call) and escalates."""
        assert before.current_step is not None and after is not None
        old, new = before.steps[before.current_step], after.steps[before.current_step]
        workflow = REGISTRY.get(before.workflow, before.workflow_version)
        delay = defer_s(workflow.steps[before.current_step].backoff, old.failure_count,
                        f"{command.attempt_id}/deferred", command)
        if old.status == "processing" and workflow.step_total_s is not None and old.first_started_at is not None \
                and not_before(now, delay) > old.first_started_at + timedelta(seconds=workflow.step_total_s):
            failed = events[0]
            assert isinstance(failed, StepFailed) and failed.calls == 0 and "total time spent" in failed.error
            assert len(events) > 1, "the step escalates"
            note("deferral past the step's total time: escalated")
            return
        assert [type(e) for e in events] == [StepRetryScheduled]
        assert new.status == "waiting" and after.current_step is None
        assert (new.failure_count, new.calls_used) == (old.failure_count, old.calls_used)
        assert (new.compensation.failure_count, new.compensation.calls_used) == (
            old.compensation.failure_count, old.compensation.calls_used)

    @staticmethod
    def check_accepted(command: AttemptAccepted, current: StepState, events: tuple[Event, ...],
                       after: TaskState | None) -> None:
        """A queued attempt's first acknowledgement starts its work deadline, never past its latest end;
        any later one changes nothing but the sequence."""
        lease = current.current_lease
        assert lease is not None and after is not None and after.current_step is not None
        if not lease.queued:
            assert [type(e) for e in events] == [MessageIgnored]
            assert after.steps[after.current_step] == current
            return
        assert [type(e) for e in events] == [StepAccepted]
        accepted = events[0]
        assert isinstance(accepted, StepAccepted) and lease.timeout is not None
        assert accepted.complete_by == min(command.accepted_at + lease.timeout, lease.complete_by)
        now_running = after.steps[after.current_step]
        assert now_running.deadline == accepted.complete_by and now_running.status == current.status
        assert replace(now_running, lease=None, compensation=replace(now_running.compensation, lease=None)) == replace(
            current, lease=None, compensation=replace(current.compensation, lease=None)), "only the clock changes"

    def check_not_current(self, command: StepResult | RecoverStep | AttemptAccepted, before: TaskState,
                          events: tuple[Event, ...], after: TaskState | None) -> None:
        """An answer for an attempt that is not in progress changes nothing but the sequence. A definite one
        (success or permanent failure) for an attempt this task started is recorded as a late result; a
        transient failure, a recovery, or an answer naming an attempt never started is ignored."""
        started = command.attempt_id in self.attempts[command.task_id]
        definite = isinstance(command, StepResult) and (command.ok or command.permanent)
        if started and definite:
            assert isinstance(command, StepResult)
            assert [type(e) for e in events] == [LateResultRecorded]
            late = events[0]
            assert isinstance(late, LateResultRecorded)
            assert (late.step, late.attempt_id, late.ok, late.permanent) == (
                command.step, command.attempt_id, command.ok, command.permanent)
            assert late.compensation == (":undo:" in command.attempt_id)
            assert late.consequence
        else:
            assert [type(e) for e in events] == [MessageIgnored]
        assert after == replace(before, sequence=before.sequence + 1)

    @staticmethod
    def check_operator(command: OperatorCommand, before: TaskState, events: tuple[Event, ...],
                       after: TaskState | None) -> None:
        """A command id is answered once: by a refusal that changes nothing, or by the transition it caused."""
        if command.command_id in before.commands:
            assert events == ()
            return
        answers = [e for e in events if getattr(e, "command_id", None) == command.command_id]
        assert len(answers) == 1
        if isinstance(answers[0], OperatorCommandRefused):
            assert after is not None
            assert after.steps == before.steps and after.status == before.status
            assert after.commands == before.commands | {command.command_id}

    @staticmethod
    def check_monotonic(before: TaskState, after: TaskState, events: tuple[Event, ...]) -> None:
        """Steps are never forgotten; attempt numbers only grow; failure counts and calls used only grow,
        except that an operator's resubmit or retry opens a new round for the step it names (and a long
        back-off's new round, of the step or of its undo, starts the failure count again, never the calls used)."""
        resubmitted = {e.step for e in events if isinstance(e, StepResubmitted)
                       or (isinstance(e, StepRetryScheduled) and e.new_round and not e.compensation)}
        retried = {e.step for e in events if isinstance(e, CompensationRetried)}
        undo_rounds = {e.step for e in events if isinstance(e, StepRetryScheduled) and e.new_round and e.compensation}
        assert len(after.steps) >= len(before.steps)
        for old, new in zip(before.steps, after.steps, strict=False):
            assert new.name == old.name
            assert new.attempt >= old.attempt
            assert new.compensation.attempt >= old.compensation.attempt
            if old.name not in resubmitted:
                assert new.failure_count >= old.failure_count
            if old.name not in {e.step for e in events if isinstance(e, StepResubmitted)}:
                assert new.calls_used >= old.calls_used
            if old.name not in retried | undo_rounds:
                assert new.compensation.failure_count >= old.compensation.failure_count
            if old.name not in retried:
                assert new.compensation.calls_used >= old.compensation.calls_used

    # ---- invariants over every task -------------------------------------------------------------

    @invariant()
    def at_most_one_attempt_in_progress_and_a_live_task_always_has_one(self) -> None:
        for state in self.states.values():
            if state is None:
                continue
            busy = [i for i, step in enumerate(state.steps) if step.status in ("processing", "compensating")]
            assert len(busy) <= 1
            assert state.current_step == (busy[0] if busy else None)
            # Between commands a live task always has an attempt out, or exactly one step waiting for its timer.
            waiting = [step for step in state.steps if step.status == "waiting"]
            assert len(busy) + len(waiting) <= 1
            assert all(step.timer is not None for step in waiting)
            if state.status == "running":
                assert waiting or (busy and state.steps[busy[0]].status == "processing")
                assert all(step.timer is not None and not step.timer.compensation for step in waiting)
            elif state.status == "compensating":
                assert waiting or (busy and state.steps[busy[0]].status == "compensating")
                assert all(step.timer is not None and step.timer.compensation for step in waiting)
            else:
                assert state.status in TERMINAL and not busy and not waiting

    @invariant()
    def an_attempts_deadline_is_its_start_by_while_queued_and_never_past_start_by_plus_its_timeout(self) -> None:
        for state in self.states.values():
            if state is None or state.current_step is None:
                continue
            lease = state.steps[state.current_step].current_lease
            assert lease is not None and lease.start_by is not None
            assert lease.deadline == (lease.start_by if lease.accepted_at is None else lease.complete_by)
            workflow = REGISTRY.get(state.workflow, state.workflow_version)
            spec = workflow.steps[state.current_step]
            undoing = state.steps[state.current_step].status == "compensating"
            timeout = spec.compensation.timeout_s if undoing and spec.compensation else spec.timeout_s
            assert lease.complete_by <= lease.start_by + timedelta(seconds=timeout)

    @invariant()
    def sequence_numbers_start_at_one_without_gaps(self) -> None:
        for task, history in self.histories.items():
            assert [e.sequence for e in history] == list(range(1, len(history) + 1))
            state = self.states[task]
            assert (state.sequence if state is not None else 0) == len(history)

    @invariant()
    def the_state_held_is_the_fold_of_the_whole_history(self) -> None:
        for task, history in self.histories.items():
            assert fold(history) == self.states[task]

    @invariant()
    def compensations_undo_every_started_step_in_reverse_start_order_and_each_at_most_once(self) -> None:
        for history in self.histories.values():
            started = _started_steps(history)
            undone: list[str] = []
            for e in history:
                if isinstance(e, StepCompensationStarted | StepCompensationSkipped) and e.step not in undone:
                    undone.append(e.step)
            assert undone == started[::-1][: len(undone)], "undone last started first, failed steps included"
            plans = [(i, e.steps) for i, e in enumerate(history) if isinstance(e, CompensationStarted)]
            assert len(plans) <= 1
            for i, plan in plans:
                earlier = history[:i]
                already_undone = {e.step for e in earlier if isinstance(e, StepCompensated | StepCompensationSkipped)}
                assert plan == [s for s in _started_steps(earlier)[::-1] if s not in already_undone], \
                    "the plan is every started step not yet undone, last started first"
            compensated = Counter(e.step for e in history if isinstance(e, StepCompensated))
            assert all(n == 1 for n in compensated.values()) and set(compensated) <= set(started)
            forward = [e for e in history if isinstance(e, StepStarted)]
            first_undo = next((e.sequence for e in history if isinstance(e, CompensationStarted)), None)
            assert first_undo is None or all(e.sequence < first_undo for e in forward), "no step runs once undoing"

    @invariant()
    def a_compensated_task_has_undone_every_step_it_ever_started(self) -> None:
        for task, state in self.states.items():
            if state is None:
                continue
            assert [s.name for s in state.steps] == _started_steps(self.histories[task]), \
                "a step appears in the state exactly when an attempt of it started"
            if state.status != "compensated":
                continue
            workflow = REGISTRY.get(state.workflow, state.workflow_version)
            for step in state.steps:
                has_undo = workflow.step(step.name).compensation is not None
                assert step.status == ("compensated" if has_undo else "compensation_skipped"), \
                    f"step {step.name!r} of compensated task {task!r} is {step.status}"

    @invariant()
    def a_failed_compensation_names_exactly_the_started_steps_not_undone(self) -> None:
        for task, state in self.states.items():
            if state is None or state.status != "compensation_failed":
                continue
            history = self.histories[task]
            undone = {e.step for e in history if isinstance(e, StepCompensated | StepCompensationSkipped)}
            failed = [e for e in history if isinstance(e, TaskCompensationFailed)][-1]
            workflow = REGISTRY.get(state.workflow, state.workflow_version)
            expected = [step for step in reversed(_started_steps(history))
                        if step not in undone and workflow.step(step).compensation is not None]
            assert failed.not_undone == expected, f"{task}: the alert names what may still be held"

    @invariant()
    def late_results_name_attempts_started_earlier_in_the_history(self) -> None:
        for history in self.histories.values():
            seen: set[str] = set()
            for e in history:
                if isinstance(e, StepStarted | StepCompensationStarted):
                    seen.add(e.attempt_id)
                elif isinstance(e, LateResultRecorded):
                    assert e.attempt_id in seen

    @invariant()
    def budgets_and_thresholds_hold(self) -> None:
        for state in self.states.values():
            if state is None or not state.steps:  # a rejection of a workflow nobody runs has none
                continue
            workflow = REGISTRY.get(state.workflow, state.workflow_version)
            for step in state.steps:
                spec = workflow.step(step.name)
                assert step.calls_used <= spec.attempt_budget
                assert step.failure_count <= workflow.failure_threshold
                if step.status == "processing":
                    assert 1 <= step.calls_allowed <= spec.calls_per_attempt
                    assert step.calls_used + step.calls_allowed <= spec.attempt_budget
                undo = step.compensation
                if spec.compensation is None:
                    assert undo.attempt == 0
                    continue
                assert undo.calls_used <= spec.compensation.attempt_budget
                assert undo.failure_count <= workflow.failure_threshold
                if step.status == "compensating":
                    assert 1 <= undo.calls_allowed <= spec.compensation.calls_per_attempt
                    assert undo.calls_used + undo.calls_allowed <= spec.compensation.attempt_budget
            if state.status == "completed":
                assert [s.name for s in state.steps] == [s.name for s in workflow.steps]
                assert all(s.status == "succeeded" for s in state.steps)

    @invariant()
    def no_attempt_starts_before_the_not_before_of_its_timer(self) -> None:
        for history in self.histories.values():
            timers: dict[tuple[str, bool, int], datetime] = {}
            last: dict[str, tuple[str, bool, int]] = {}
            for e in history:
                if isinstance(e, StepRetryScheduled):
                    last[e.step] = (e.step, e.compensation, e.attempt)
                    timers[last[e.step]] = e.not_before
                elif isinstance(e, RetryBroughtForward):  # an operator's try-now: the timer is now
                    timers[last[e.step]] = min(timers[last[e.step]], e.occurred_at)
                elif isinstance(e, StepStarted | StepCompensationStarted):
                    not_before = timers.get((e.step, isinstance(e, StepCompensationStarted), e.attempt))
                    assert not_before is None or e.occurred_at >= not_before, \
                        f"{e.attempt_id} started at {e.occurred_at}, its timer said {not_before}"

    @invariant()
    def no_retry_of_a_step_is_set_or_started_at_once_past_the_steps_total_time(self) -> None:
        """A timer's ``not_before``, and an attempt started at once after a failure, are within the workflow's
        ``step_total_s`` of the step's first attempt (again from an operator's resubmit); deferrals included."""
        for task, history in self.histories.items():
            state = self.states[task]
            known = state is not None and bool(state.steps)  # a rejection of a workflow nobody runs has none
            total_s = REGISTRY.get(state.workflow, state.workflow_version).step_total_s if state and known else None
            if total_s is None:
                continue
            total = timedelta(seconds=total_s)
            first: dict[str, datetime] = {}
            timed: set[tuple[str, int]] = set()
            for e in history:
                if isinstance(e, StepResubmitted):
                    first.pop(e.step, None)
                elif isinstance(e, StepRetryScheduled) and not e.compensation:
                    timed.add((e.step, e.attempt))
                    assert e.not_before <= first[e.step] + total, f"{e.step}: a timer past the total time"
                elif isinstance(e, StepStarted):
                    at_once = e.step in first and (e.step, e.attempt) not in timed
                    assert not at_once or e.occurred_at <= first[e.step] + total, f"{e.attempt_id} past the total"
                    first.setdefault(e.step, e.occurred_at)
                elif "total time" in getattr(e, "reason", ""):
                    note("a step gave up at its total time")

    @invariant()
    def attempt_ids_are_never_reused(self) -> None:
        for attempts in self.attempts.values():
            assert len(set(attempts)) == len(attempts)

    def teardown(self) -> None:
        """Replay from Kafka: each history, through the Avro codec, folds to the state the decider held."""
        codec = default_codec()
        for task, history in self.histories.items():
            decoded = [codec.decode(codec.encode(event)) for event in history]
            assert decoded == history
            assert fold(e for e in decoded if isinstance(e, Event)) == self.states[task]


def _started_steps(history: list[Event]) -> list[str]:
    """The steps any attempt of which started, in the order their first attempts started."""
    steps: list[str] = []
    for e in history:
        if isinstance(e, StepStarted) and e.step not in steps:
            steps.append(e.step)
    return steps


# 100 command sequences a run (42 s at 300 beside the rest of the suite): Hypothesis draws new ones every run
# and replays any that failed; STEPSTREAM_DECIDER_EXAMPLES=1000 for a longer search.
DeciderMachine.TestCase.settings = settings(max_examples=int(os.environ.get("STEPSTREAM_DECIDER_EXAMPLES", "100")),
                                            stateful_step_count=60, deadline=None)
TestAnyCommandSequenceKeepsTheDecidersInvariants = DeciderMachine.TestCase
