"""Property tests of the decider: random command sequences against a small registry keep every invariant.

Hypothesis drives a scheduler of three tasks with submissions (repeats and contradictions included),
successes and transient or permanent failures for current, stale and made-up attempt ids, recoveries at
times around each deadline, and a clock that moves on. After every command the decision and the states
it leads to are checked, and at the end every history is replayed through the Avro codec.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from scheduler.decider import (
    TERMINAL,
    Decision,
    Limits,
    StepState,
    TaskState,
    decide,
    fold,
)
from scheduler.workflow import Step, Workflow, WorkflowRegistry
from schemas.codec import default_codec
from schemas.messages import (
    Event,
    MessageIgnored,
    OperatorAlert,
    RecoverStep,
    StepResult,
    StepStarted,
    SubmitTask,
)

REGISTRY = WorkflowRegistry.of([
    Workflow(
        "flow",
        1,
        (
            Step("a", "agent-a", timeout_s=10, attempt_budget=4, calls_per_attempt=2),
            Step("b", "agent-b", timeout_s=5, attempt_budget=3, calls_per_attempt=3),
        ),
        failure_threshold=3,
    ),
    Workflow("flow", 2, (Step("c", "agent-c", timeout_s=1, attempt_budget=2, calls_per_attempt=1),),
             failure_threshold=1, escalation="compensate"),
])
LIMITS = Limits(max_in_flight=2)
TASKS = ("t1", "t2", "t3")
START = datetime(2025, 1, 1, tzinfo=UTC)

tasks = st.sampled_from(TASKS)
# Weighted towards the attempt in progress and towards success, so runs get past their first step.
attempt_choices = st.sampled_from(["current", "current", "current", "stale", "made-up"])
outcomes = st.sampled_from(["ok", "ok", "ok", "transient", "permanent"])


class DeciderMachine(RuleBasedStateMachine):
    """Plays the scheduler service: decides each command on the task's state, then folds the events in."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = START
        self.states: dict[str, TaskState | None] = dict.fromkeys(TASKS)
        self.histories: dict[str, list[Event]] = {task: [] for task in TASKS}
        self.attempts: dict[str, list[str]] = {task: [] for task in TASKS}

    # ---- commands -------------------------------------------------------------------------------

    @rule(task=tasks, workflow=st.sampled_from([("flow", None), ("flow", 1), ("flow", 2), ("nope", None)]),
          data=st.sampled_from([{"n": 1}, {"n": 2}]))
    def submit(self, task: str, workflow: tuple[str, int | None], data: dict[str, int]) -> None:
        name, version = workflow
        self.run(SubmitTask(task_id=task, workflow=name, workflow_version=version, input=data), self.clock)

    @rule(task=tasks, which=attempt_choices, pick=st.integers(0, 20),
          outcome=outcomes, calls=st.integers(0, 4))
    def result(self, task: str, which: str, pick: int, outcome: str, calls: int) -> None:
        attempt = self.attempt(task, which, pick)
        self.run(
            StepResult(task_id=task, step=attempt.split(":")[1], attempt_id=attempt, ok=outcome == "ok",
                       output={"by": attempt} if outcome == "ok" else None,
                       error=None if outcome == "ok" else outcome, permanent=outcome == "permanent",
                       calls=calls),
            self.clock,
        )

    @rule(task=tasks, which=attempt_choices, pick=st.integers(0, 20), offset=st.integers(-15, 15))
    def recover(self, task: str, which: str, pick: int, offset: int) -> None:
        """A recovery some seconds before or after the current deadline: the supervisor's clock varies."""
        attempt = self.attempt(task, which, pick)
        step = self.processing(task)
        around = step.complete_by if step is not None and step.complete_by is not None else self.clock
        now = max(self.clock, around + timedelta(seconds=offset))
        self.run(RecoverStep(task_id=task, attempt_id=attempt, reason="expired"), now)

    @rule(seconds=st.integers(0, 30))
    def tick(self, seconds: int) -> None:
        self.clock += timedelta(seconds=seconds)

    def attempt(self, task: str, which: str, pick: int) -> str:
        step = self.processing(task)
        if which == "current" and step is not None and step.attempt_id is not None:
            return step.attempt_id
        if which == "stale" and self.attempts[task]:
            return self.attempts[task][pick % len(self.attempts[task])]
        return f"{task}:a:{pick + 1}"

    def processing(self, task: str) -> StepState | None:
        state = self.states[task]
        if state is None or state.current_step is None:
            return None
        return state.steps[state.current_step]

    def run(self, command: SubmitTask | StepResult | RecoverStep, now: datetime) -> None:
        before = self.states[command.task_id]
        in_flight = sum(1 for state in self.states.values() if state is not None and not state.is_terminal)
        decision = decide(command, before, registry=REGISTRY, now=now, in_flight=in_flight, limits=LIMITS)
        assert decide(command, before, registry=REGISTRY, now=now, in_flight=in_flight,
                      limits=LIMITS) == decision, "decide is not deterministic"
        after = fold(decision.events, before)
        self.check_decision(command, before, decision, after, now)
        self.states[command.task_id] = after
        self.histories[command.task_id].extend(decision.events)
        self.attempts[command.task_id].extend(e.attempt_id for e in decision.events if isinstance(e, StepStarted))

    # ---- checks on each decision ----------------------------------------------------------------

    def check_decision(self, command: SubmitTask | StepResult | RecoverStep, before: TaskState | None,
                       decision: Decision, after: TaskState | None, now: datetime) -> None:
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
            assert [type(e) for e in events] == ([OperatorAlert] if contradiction else [])
        if before is not None and before.is_terminal:
            assert all(isinstance(e, MessageIgnored | OperatorAlert) for e in events)
            assert after is not None and after.status == before.status
        if before is not None and after is not None:
            self.check_monotonic(before, after)
        if isinstance(command, StepResult | RecoverStep) and before is not None:
            current = before.steps[before.current_step] if before.current_step is not None else None
            if current is None or current.attempt_id != command.attempt_id or before.is_terminal:
                assert [type(e) for e in events] == [MessageIgnored]
            if isinstance(command, RecoverStep) and current is not None and current.complete_by is not None \
                    and now < current.complete_by:
                assert [type(e) for e in events] == [MessageIgnored]

    @staticmethod
    def check_monotonic(before: TaskState, after: TaskState) -> None:
        """Steps are never forgotten, and failure counts, calls used and attempt numbers only grow."""
        assert len(after.steps) >= len(before.steps)
        for old, new in zip(before.steps, after.steps, strict=False):
            assert new.name == old.name
            assert new.failure_count >= old.failure_count
            assert new.calls_used >= old.calls_used
            assert new.attempt >= old.attempt

    # ---- invariants over every task -------------------------------------------------------------

    @invariant()
    def at_most_one_step_in_processing_and_it_is_the_current_one(self) -> None:
        for state in self.states.values():
            if state is None:
                continue
            processing = [i for i, step in enumerate(state.steps) if step.status == "processing"]
            assert len(processing) <= 1
            assert state.current_step == (processing[0] if processing else None)
            # Between commands a live task always has an attempt out: retries start at once.
            assert state.status in TERMINAL or (state.status == "running" and len(processing) == 1)

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
    def budgets_and_thresholds_hold(self) -> None:
        for state in self.states.values():
            if state is None:
                continue
            workflow = REGISTRY.get(state.workflow, state.workflow_version)
            for step in state.steps:
                spec = workflow.step(step.name)
                assert step.calls_used <= spec.attempt_budget
                assert step.failure_count <= workflow.failure_threshold
                if step.status == "processing":
                    assert 1 <= step.calls_allowed <= spec.calls_per_attempt
                    assert step.calls_used + step.calls_allowed <= spec.attempt_budget
            if state.status == "completed":
                assert [s.name for s in state.steps] == [s.name for s in workflow.steps]
                assert all(s.status == "succeeded" for s in state.steps)

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


DeciderMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
TestAnyCommandSequenceKeepsTheDecidersInvariants = DeciderMachine.TestCase
