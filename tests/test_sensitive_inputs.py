"""Sensitive inputs and erasure, without a broker: task data keys (AES-SIV, wrapped by the master keys),
sealing a submission's marked fields, opening an agent request's input, and the decider's ``erase``.
End to end (every way in, raw topics, store, DLQ, logs, erasure): tests/test_sensitive_end_to_end.py."""

from __future__ import annotations

import base64
from dataclasses import replace
from typing import Any

import pytest

from agents.sealed_inputs import SealedInputs
from eventstore.keys import DataKeys, Proposals, proposal_record, proposal_task
from scheduler.decider import Limits, TaskState, decide
from scheduler.sealing import EventSealer, SubmissionSealer, open_input, seal_input
from scheduler.workflow import Step, Workflow, WorkflowRegistry
from schemas.messages import (
    AgentRequest,
    OperatorCommandRefused,
    StepCompensated,
    StepResult,
    StepSucceeded,
    SubmitTask,
    TaskAccepted,
    TaskDataErased,
)
from schemas.sealed import SEALED, Keyring, SealingError, TaskKey, is_sealed, open_step_input
from tests.test_decider import NOW
from tests.test_decider_compensation import apply, command, compensating, in_error, only, run, undo_all

KEYRING = Keyring.parse(f"k2:{base64.b64encode(bytes(range(32))).decode()},"
                        f"k1:{base64.b64encode(bytes(range(100, 132))).decode()}")
OLD_KEYRING = Keyring.parse(f"k1:{base64.b64encode(bytes(range(100, 132))).decode()}")
PAY = Workflow("pay", 1, (Step("charge", "payments", sensitive_output=frozenset({"card_ref"})),),
               sensitive_input=frozenset({"card_token"}))
REGISTRY = WorkflowRegistry.of([PAY])
CARD = "tok_4111111111111111"


def submission(**input: Any) -> SubmitTask:
    return SubmitTask(task_id="t1", workflow="pay", input={"order_id": "o-1", "card_token": CARD, **input})


# ---- task data keys -------------------------------------------------------------------------------


def test_a_task_key_seals_the_same_value_to_the_same_bytes_and_only_for_its_place() -> None:
    key = TaskKey.generate()
    where = ("t1", "input", "card_token")
    sealed = key.seal(CARD, where)
    assert sealed == key.seal(CARD, where), "deterministic: a repeat keeps its digest"
    assert CARD not in str(sealed) and key.unseal(sealed, where) == CARD
    for elsewhere in [("t2", "input", "card_token"), ("t1", "input", "order_id")]:
        with pytest.raises(SealingError, match="does not open"):
            key.unseal(sealed, elsewhere)
    with pytest.raises(SealingError, match="does not open"):
        TaskKey.generate().unseal(sealed, where)


def test_a_wrapped_task_key_opens_with_the_master_key_that_wrapped_it_even_after_rotation() -> None:
    key = TaskKey.generate()
    old = OLD_KEYRING.wrap(key, "t1")
    assert old.startswith("k1:") and KEYRING.wrap(key, "t1").startswith("k2:")
    assert KEYRING.unwrap(old, "t1") == key, "the old master key, kept second, still opens old tasks"
    with pytest.raises(SealingError, match="does not open"):
        KEYRING.unwrap(old, "t2")
    with pytest.raises(SealingError, match="'k2', which is not configured"):
        OLD_KEYRING.unwrap(KEYRING.wrap(key, "t1"), "t1")


# ---- sealing submissions --------------------------------------------------------------------------


def test_a_submission_has_only_its_marked_fields_sealed_and_carries_its_new_wrapped_key_to_propose() -> None:
    sealed = SubmissionSealer(REGISTRY, KEYRING).seal(submission())
    assert sealed.input["order_id"] == "o-1" and is_sealed(sealed.input["card_token"])
    assert sealed.data_key is not None and CARD not in sealed.model_dump_json()
    key = KEYRING.unwrap(sealed.data_key, "t1")
    assert open_input(PAY, "t1", sealed.input, key) == submission().input
    assert SubmissionSealer(REGISTRY, KEYRING).seal(sealed) is sealed, "sealed once, not twice"
    assert sealed.key_ref is not None and sealed.key_ref != SubmissionSealer(REGISTRY, KEYRING).seal(
        submission()).key_ref, "each new key has its own reference: no two proposals share a record"
    proposed = sealed.model_copy(update={"data_key": None})  # as it goes to inbox, its key proposed on keys
    assert SubmissionSealer(REGISTRY, KEYRING).seal(proposed) is proposed


def test_a_repeat_sealed_under_the_tasks_own_key_is_the_same_submission_byte_for_byte() -> None:
    sealer = SubmissionSealer(REGISTRY, KEYRING)
    key = TaskKey.generate()
    assert sealer.seal(submission(), key).input == sealer.seal(submission(), key).input
    assert sealer.seal(submission(), key).data_key is None and sealer.seal(submission(), key).key_ref is None, \
        "the scheduler holds a known task's key: nothing to propose"
    assert sealer.seal(submission(), key).input != sealer.seal(submission(card_token="tok_other"), key).input


def test_a_submission_to_a_workflow_marking_inputs_without_a_key_is_refused_and_others_pass() -> None:
    with pytest.raises(SealingError, match="workflow pay v1 marks input fields sensitive but no encryption key"):
        SubmissionSealer(REGISTRY, None).seal(submission())
    plain = WorkflowRegistry.of([Workflow("plain", 1, (Step("s", "a"),))])
    command = SubmitTask(task_id="t1", workflow="plain", input={"x": 1})
    assert SubmissionSealer(plain, None).seal(command) is command


def test_a_workflow_marking_an_input_field_names_it() -> None:
    with pytest.raises(ValueError, match="sensitive_input"):
        Workflow("w", 1, (Step("s", "a"),), sensitive_input=frozenset({""}))


def test_a_retention_is_positive_and_only_for_a_workflow_that_marks_data() -> None:
    with pytest.raises(ValueError, match="sensitive_retention_s must be positive"):
        Workflow("w", 1, (Step("s", "a"),), sensitive_retention_s=60.0)
    with pytest.raises(ValueError, match="sensitive_retention_s must be positive"):
        Workflow("w", 1, (Step("s", "a"),), sensitive_input=frozenset({"x"}), sensitive_retention_s=0.0)


def test_an_accepted_task_carries_its_workflow_versions_retention() -> None:
    brief = WorkflowRegistry.of([replace(PAY, sensitive_retention_s=30.0)])
    decision = decide(submission(), None, registry=brief, now=NOW, in_flight=0, limits=Limits())
    assert only(decision, TaskAccepted)[0].retention_s == 30.0


# ---- opening an agent request's input -------------------------------------------------------------


def test_an_agent_request_input_opens_its_task_input_and_earlier_step_outputs_each_for_its_place() -> None:
    key = TaskKey.generate()
    sealer = EventSealer(REGISTRY, KEYRING)
    data = {"task": seal_input(PAY, "t1", submission().input, key),
            "steps": sealer.seal_outputs(PAY, "t1", {"charge": {"card_ref": "ref-9", "id": "c"}}, key)}
    assert CARD not in str(data) and "ref-9" not in str(data)
    asked: list[str] = []

    def key_of() -> TaskKey:
        asked.append("t1")
        return key

    opened, values = open_step_input(data, "t1", key_of)
    assert opened == {"task": submission().input, "steps": {"charge": {"card_ref": "ref-9", "id": "c"}}}
    assert sorted(values) == sorted([submission().input["card_token"], "ref-9"]), "each value opened, for masking"
    assert asked == ["t1"], "the key is looked up once per request"


def test_a_request_without_sealed_values_needs_no_key_and_an_erased_tasks_request_does_not_open() -> None:
    plain = {"task": {"order_id": "o-1"}, "steps": {}}
    assert open_step_input(plain, "t1", lambda: pytest.fail("no key lookup")) == (plain, [])
    sealed = {"task": seal_input(PAY, "t1", submission().input, TaskKey.generate()), "steps": {}}
    with pytest.raises(SealingError, match="data was erased"):
        open_step_input(sealed, "t1", lambda: None)


# ---- erasure in the decider -----------------------------------------------------------------------


def erased(state: TaskState) -> TaskState:
    decision, after = run(command(state, "erase", command_id="erase-1"), state)
    assert [type(e) for e in decision.events] == [TaskDataErased] and after is not None and after.erased
    return after


def test_an_ended_task_is_erased_by_an_operator_and_a_second_erase_is_refused() -> None:
    state = erased(undo_all(compensating()))
    decision, _ = run(command(state, "erase", command_id="erase-2"), state)
    assert [e.reason for e in only(decision, OperatorCommandRefused)] == ["task data already erased"]


def test_a_running_task_cannot_be_erased_it_must_be_cancelled_first() -> None:
    state = compensating()
    refusal = only(run(command(state, "erase"), state)[0], OperatorCommandRefused)
    assert "only an ended task's data can be erased (cancel a running task first)" in refusal[0].reason


def test_compensation_of_an_erased_task_is_refused_with_the_reason() -> None:
    state = erased(in_error())
    for action in ("compensate", "resubmit"):
        refusal = only(run(command(state, action, command_id=f"c-{action}"), state)[0], OperatorCommandRefused)
        assert refusal[0].reason.startswith(f"task data erased: its input and outputs open nowhere, so {action}")
    assert apply(command(state, "compensate", command_id="c-x"), state).status == "error"


def test_a_step_output_of_an_erased_task_replays_sealed() -> None:
    sealer = EventSealer(REGISTRY, KEYRING)
    event = StepSucceeded(task_id="t1", sequence=3, workflow="pay", workflow_version=1, causation_id="c",
                          step="charge", attempt_id="t1:charge:1", output={"card_ref": "ref-9"}, calls=1)
    sealed = sealer.seal(event, TaskKey.generate())
    assert sealed.output["card_ref"][SEALED].startswith("@task:")
    assert sealer.unseal(sealed, None) == sealed


# ---- agents seal the marked fields of their answers -----------------------------------------------


def answer_sealed(*, compensation: bool, marked: list[str], output: dict[str, Any]) -> tuple[dict[str, Any], TaskKey]:
    """``output`` as the agent answers it for a request naming ``marked``, and the task's key."""
    key = TaskKey.generate()
    keys = DataKeys("127.0.0.1:1", "keys")  # never read: the task's key is known already
    keys._wrapped["t1"] = KEYRING.wrap(key, "t1")
    attempt = "t1:charge:undo:1" if compensation else "t1:charge:1"
    request = AgentRequest(task_id="t1", step="charge", attempt=1, attempt_id=attempt, idempotency_key="t1:charge",
                           complete_by=NOW, calls_allowed=1, input={}, compensation=compensation,
                           sealed_output=marked)
    result = StepResult(task_id="t1", step="charge", attempt_id=attempt, ok=True, output=output)
    sealed = SealedInputs(keys, KEYRING).seal_answer(request, result).output
    assert sealed is not None
    return sealed, key


def test_an_agent_seals_the_marked_fields_of_its_answer_where_the_scheduler_opens_them() -> None:
    sealed, key = answer_sealed(compensation=False, marked=["card_ref"], output={"card_ref": "ref-9", "id": "c"})
    assert is_sealed(sealed["card_ref"]) and sealed["id"] == "c"
    event = StepSucceeded(task_id="t1", sequence=3, workflow="pay", workflow_version=1, causation_id="c",
                          step="charge", attempt_id="t1:charge:1", output=sealed, calls=1)
    assert EventSealer(REGISTRY, KEYRING).unseal(event, key).output == {"card_ref": "ref-9", "id": "c"}


def test_a_compensation_of_a_marked_step_answers_every_field_sealed() -> None:
    sealed, key = answer_sealed(compensation=True, marked=["*"], output={"refunded": ["ref-9"], "status": "ok"})
    assert all(is_sealed(value) for value in sealed.values())
    event = StepCompensated(task_id="t1", sequence=9, workflow="pay", workflow_version=1, causation_id="c",
                            step="charge", attempt_id="t1:charge:undo:1", output=sealed, calls=1)
    assert EventSealer(REGISTRY, KEYRING).unseal(event, key).output == {"refunded": ["ref-9"], "status": "ok"}


def test_a_tasks_kept_proposals_are_its_own_and_not_those_of_a_task_whose_id_starts_the_same() -> None:
    assert proposal_task(proposal_record("loan#7", "ab12")) == "loan#7", "a task id may hold '#' itself"
    kept = Proposals("127.0.0.1:9", "keys", 0, {}, {proposal_record("forget-me", "a"): "wrapped-a",
                                                    proposal_record("forget-me-too", "b"): "wrapped-b",
                                                    proposal_record("forget-me", "c"): None})
    assert kept.of_task("forget-me") == [proposal_record("forget-me", "a")], "a tombstoned proposal is gone"
