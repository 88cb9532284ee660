"""The scheduler's door, without Kafka: a submission of a workflow or version it does not run, or with an input
its version's model refuses, is rejected naming why (and dead-lettered); a repeat asks again."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from scheduler.decider import Decision, Limits, TaskState, decide, fold, input_digest
from scheduler.workflow import Step, Workflow, WorkflowRegistry
from schemas.messages import StepStarted, SubmitTask, TaskAccepted, TaskRejected
from schemas.sealed import TaskKey
from tests.test_decider import NOW


class Loan(BaseModel):
    applicant: str
    amount: int
    national_id: str


LOAN_V1 = Workflow("loan", 1, (Step("hold", "funds"),), input_model=Loan, sensitive_input=frozenset({"national_id"}))
LOAN_V2 = Workflow("loan", 2, (Step("hold", "funds"), Step("notify", "mail")), input_model=Loan)
V1_ONLY = WorkflowRegistry.of([LOAN_V1])
BOTH = WorkflowRegistry.of([LOAN_V1, LOAN_V2])
VALID = {"applicant": "ada", "amount": 100, "national_id": "AB123"}


def submit(input: dict[str, Any], *, workflow: str = "loan", version: int | None = 1) -> SubmitTask:
    return SubmitTask(task_id="t1", workflow=workflow, workflow_version=version, input=input, submitter="bank",
                      reply_topic="stepstream.status.bank")


def run(command: SubmitTask, state: TaskState | None, registry: WorkflowRegistry = V1_ONLY,
        in_flight: int = 0, limits: Limits | None = None) -> tuple[Decision, TaskState | None]:
    decision = decide(command, state, registry=registry, now=NOW, in_flight=in_flight, limits=limits or Limits())
    return decision, fold(decision.events, state)


def rejection(decision: Decision) -> TaskRejected:
    assert [type(e) for e in decision.events] == [TaskRejected]
    event = decision.events[0]
    assert isinstance(event, TaskRejected)
    return event


def sealed(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` as the scheduler receives it: its marked field is ciphertext."""
    key = TaskKey.generate()
    return {**data, "national_id": key.seal(data["national_id"], ("input", "national_id"))}


def test_a_submission_missing_a_field_is_rejected_naming_it_and_dead_lettered() -> None:
    data = sealed({k: v for k, v in VALID.items() if k != "amount"})
    decision, state = run(submit(data), None)
    event = rejection(decision)
    assert event.reason == "invalid input for 'loan' v1: amount: Field required"
    assert decision.dead_letter == event.reason and event.cause == "invalid_input"
    assert (event.submitter, event.reply_topic) == ("bank", "stepstream.status.bank")
    assert event.input_digest == input_digest("loan", 1, data)
    assert state is not None and state.status == "rejected" and state.rejection == event.reason


def test_a_clear_field_of_the_wrong_type_is_rejected_but_a_sealed_field_is_checked_for_presence_only() -> None:
    wrong = rejection(run(submit(sealed({**VALID, "amount": "lots"})), None)[0])
    assert wrong.reason.startswith("invalid input for 'loan' v1: amount: Input should be a valid integer")
    # The ciphertext of national_id is not a string: only its presence counts, and it is present.
    assert [type(e) for e in run(submit(sealed(VALID)), None)[0].events] == [TaskAccepted, StepStarted]
    absent = rejection(run(submit({k: v for k, v in VALID.items() if k != "national_id"}), None)[0])
    assert absent.reason == "invalid input for 'loan' v1: national_id: Field required"


def test_an_invalid_input_is_rejected_as_invalid_even_when_the_system_is_full() -> None:
    decision, _ = run(submit({"applicant": "ada"}), None, in_flight=5, limits=Limits(max_in_flight=5))
    assert "amount: Field required" in rejection(decision).reason and decision.dead_letter is not None


def test_a_repeat_of_an_invalid_submission_changes_nothing() -> None:
    _, state = run(submit({"applicant": "ada"}), None)
    assert run(submit({"applicant": "ada"}), state)[0] == Decision(())


def test_an_unknown_version_is_rejected_visibly_and_admitted_on_a_repeat_once_a_scheduler_runs_it() -> None:
    decision, state = run(submit(VALID, version=2), None)
    event = rejection(decision)
    assert event.reason == ("not run by this scheduler: workflow 'loan' has no version 2 "
                            "(this scheduler runs 'loan' v1)")
    assert decision.dead_letter == event.reason and event.workflow_version == 2 and event.cause == "unknown_version"
    again, state = run(submit(VALID, version=2), state)  # still unknown: rejected again, visibly
    assert rejection(again).sequence == 2
    admitted, state = run(submit(VALID, version=2), state, registry=BOTH)
    assert [type(e) for e in admitted.events] == [TaskAccepted, StepStarted] and admitted.dead_letter is None
    assert state is not None and state.status == "running" and state.workflow_version == 2
    assert state.rejection is None and state.sequence == 4


def test_an_unknown_workflow_named_without_a_version_is_pinned_to_v1_and_admitted_once_it_runs() -> None:
    decision, state = run(submit(VALID, version=None), None, registry=WorkflowRegistry())
    event = rejection(decision)
    assert event.reason == "not run by this scheduler: no workflow named 'loan' (this scheduler runs none)"
    assert event.workflow_version == 1
    admitted, state = run(submit(VALID, version=None), state, registry=BOTH)
    assert [type(e) for e in admitted.events] == [TaskAccepted, StepStarted]
    assert state is not None and state.workflow_version == 1


def test_an_unknown_version_whose_input_its_version_refuses_once_known_is_rejected_for_the_input() -> None:
    lacking = {"applicant": "ada", "national_id": "AB123"}
    _, state = run(submit(lacking, version=2), None)
    decision, state = run(submit(lacking, version=2), state, registry=BOTH)
    assert rejection(decision).reason == "invalid input for 'loan' v2: amount: Field required"
    assert run(submit(lacking, version=2), state, registry=BOTH)[0] == Decision(())
