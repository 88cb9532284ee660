"""Sealing sensitive fields: the keyring (AES-256-GCM, rotation, binding to place) and which event fields
the scheduler seals; end to end, tests/test_compensation_end_to_end.py reads the raw topic."""

from __future__ import annotations

import base64
from datetime import UTC, datetime
from typing import Any

import pytest

from scheduler.sealing import EventSealer
from scheduler.workflow import Compensation, Step, Workflow, WorkflowRegistry
from schemas.codec import default_codec
from schemas.messages import Event, StepCompensated, StepFailed, StepSucceeded, TaskCompleted
from schemas.sealed import SEALED, EncryptionSettings, Keyring, SealingError, TaskKey, is_sealed

KEY_NEW = base64.b64encode(bytes(range(32))).decode()
KEY_OLD = base64.b64encode(bytes(range(100, 132))).decode()
WHERE = ("t1", "charge", "output", "card")
TASK_KEY = TaskKey(bytes(range(64)))
NOW = datetime(2025, 1, 1, tzinfo=UTC)

PAY = Workflow("pay", 1, (
    Step("reserve", "inventory", compensation=Compensation("inventory-release")),
    Step("charge", "payments", compensation=Compensation("payments-refund"), sensitive_output=frozenset({"card"})),
    Step("vault", "vault", sensitive_output=True),
))
REGISTRY = WorkflowRegistry.of([PAY])


def keyring(spec: str = f"k2:{KEY_NEW},k1:{KEY_OLD}") -> Keyring:
    return Keyring.parse(spec)


def make(kind: type[Event], **fields: Any) -> Any:
    return kind(task_id="t1", sequence=5, workflow="pay", workflow_version=1, causation_id="c", occurred_at=NOW,
                **fields)


# ---- the keyring ----------------------------------------------------------------------------------


def test_a_sealed_value_opens_to_the_same_json_value_and_hides_it() -> None:
    ring = keyring()
    value = {"number": "4111 1111 1111 1111", "expiry": [12, 2030]}
    sealed = ring.seal(value, WHERE)
    assert is_sealed(sealed) and sealed[SEALED].startswith("k2:")
    assert "4111" not in str(sealed)
    assert ring.unseal(sealed, WHERE) == value
    assert ring.seal(value, WHERE) != sealed, "a fresh nonce per value: equal values do not look equal"


def test_a_sealed_value_does_not_open_anywhere_but_where_it_was_sealed() -> None:
    sealed = keyring().seal("secret", WHERE)
    for elsewhere in [("t2", *WHERE[1:]), ("t1", "charge", "output", "other")]:
        with pytest.raises(SealingError, match="does not open"):
            keyring().unseal(sealed, elsewhere)


def test_rotation_seals_with_the_first_key_and_still_opens_values_of_the_old_one() -> None:
    old_only = keyring(f"k1:{KEY_OLD}")
    sealed_before = old_only.seal("v", WHERE)
    rotated = keyring(f"k2:{KEY_NEW},k1:{KEY_OLD}")
    assert rotated.unseal(sealed_before, WHERE) == "v"
    assert rotated.seal("v", WHERE)[SEALED].startswith("k2:")
    with pytest.raises(SealingError, match="'k1', which is not configured"):
        keyring(f"k2:{KEY_NEW}").unseal(sealed_before, WHERE)


def test_a_tampered_value_does_not_open() -> None:
    sealed = keyring().seal("v", WHERE)
    kid, body = sealed[SEALED].split(":")
    raw = bytearray(base64.b64decode(body))
    raw[-1] ^= 1
    with pytest.raises(SealingError):
        keyring().unseal({SEALED: f"{kid}:{base64.b64encode(bytes(raw)).decode()}"}, WHERE)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("", "at least one key"),
        ("k1", "entry 1 is not kid:base64key"),
        ("k1:not base64!", "not valid base64"),
        (f"k1:{base64.b64encode(b'short').decode()}", "AES-256-GCM keys are 32 bytes"),
        (f"k1:{KEY_NEW},k1:{KEY_OLD}", "listed twice"),
        (f"bad kid:{KEY_NEW}", "key id"),
    ],
    ids=["empty", "no separator", "not base64", "wrong length", "duplicate id", "bad id"],
)
def test_a_malformed_key_setting_is_refused_without_repeating_the_key(spec: str, message: str) -> None:
    with pytest.raises(SealingError, match=message) as refused:
        Keyring.parse(spec)
    assert KEY_NEW not in str(refused.value) and KEY_OLD not in str(refused.value)


def test_the_key_setting_comes_from_the_environment_and_never_shows_in_its_repr(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("STEPSTREAM_ENCRYPTION_KEYS", raising=False)
    assert EncryptionSettings().keyring() is None
    monkeypatch.setenv("STEPSTREAM_ENCRYPTION_KEYS", f"k2:{KEY_NEW}, k1:{KEY_OLD}")
    settings = EncryptionSettings()
    assert KEY_NEW not in repr(settings) and KEY_NEW not in str(settings.model_dump())
    ring = settings.keyring()
    assert ring is not None and ring.current == "k2"
    monkeypatch.setenv("STEPSTREAM_ENCRYPTION_KEYS", "")
    assert EncryptionSettings().keyring() is None


def test_a_new_key_is_32_random_bytes() -> None:
    first, second = Keyring.generate_key(), Keyring.generate_key()
    assert len(base64.b64decode(first)) == 32 and first != second
    assert Keyring.parse(f"k:{first}").current == "k"


# ---- which event fields are sealed ----------------------------------------------------------------


def test_only_the_marked_fields_of_a_step_output_are_sealed_and_they_open_again() -> None:
    sealer = EventSealer(REGISTRY, keyring())
    event = make(StepSucceeded, step="charge", attempt_id="t1:charge:1", output={"card": "4111", "charge_id": "ch-1"},
                 calls=1)
    sealed = sealer.seal(event, TASK_KEY)
    assert is_sealed(sealed.output["card"]) and sealed.output["charge_id"] == "ch-1"
    assert "4111" not in default_codec().encode(sealed).decode(errors="replace")
    assert sealer.unseal(sealed, TASK_KEY) == event


def test_a_step_marked_wholly_sensitive_has_every_output_field_sealed() -> None:
    sealer = EventSealer(REGISTRY, keyring())
    event = make(StepSucceeded, step="vault", attempt_id="t1:vault:1", output={"a": 1, "b": "x"}, calls=1)
    sealed = sealer.seal(event, TASK_KEY)
    assert all(is_sealed(v) for v in sealed.output.values())
    assert sealer.unseal(sealed, TASK_KEY) == event


def test_a_completed_task_output_seals_each_step_entry_as_its_step_marks_it() -> None:
    sealer = EventSealer(REGISTRY, keyring())
    event = make(TaskCompleted, output={"reserve": {"reservation_id": "r-1"}, "charge": {"card": "4111", "id": "c"},
                                        "vault": {"token": "tok"}})
    sealed = sealer.seal(event, TASK_KEY)
    assert sealed.output["reserve"] == {"reservation_id": "r-1"}
    assert is_sealed(sealed.output["charge"]["card"]) and sealed.output["charge"]["id"] == "c"
    assert is_sealed(sealed.output["vault"]["token"])
    assert sealer.unseal(sealed, TASK_KEY) == event


def test_a_compensation_inherits_its_steps_marking_every_field_of_its_answer_is_sealed() -> None:
    sealer = EventSealer(REGISTRY, keyring())
    refund = make(StepCompensated, step="charge", attempt_id="t1:charge:undo:1",
                  output={"refunded": ["4111"], "status": "refunded"}, calls=1)
    sealed = sealer.seal(refund, TASK_KEY)
    assert all(is_sealed(v) for v in sealed.output.values())
    assert sealer.unseal(sealed, TASK_KEY) == refund
    release = make(StepCompensated, step="reserve", attempt_id="t1:reserve:undo:1", output={"released": ["r-1"]},
                   calls=1)
    assert sealer.seal(release, TASK_KEY) is release, "an unmarked step's compensation is written as it is"


def test_events_without_marked_data_are_written_as_they_are() -> None:
    sealer = EventSealer(REGISTRY, keyring())
    failed = make(StepFailed, step="charge", attempt_id="t1:charge:1", error="e", permanent=True, calls=1,
                  failure_count=1)
    plain = make(StepSucceeded, step="reserve", attempt_id="t1:reserve:1", output={"reservation_id": "r"}, calls=1)
    assert sealer.seal(failed, TASK_KEY) is failed and sealer.seal(plain, TASK_KEY) is plain


def test_events_sealed_with_a_master_key_before_tasks_had_data_keys_still_open() -> None:
    sealer = EventSealer(REGISTRY, keyring())
    event = make(StepSucceeded, step="charge", attempt_id="t1:charge:1", output={"card": "4111"}, calls=1)
    legacy = sealer.seal(event, None)
    assert legacy.output["card"][SEALED].startswith("k2:")
    assert sealer.unseal(legacy, TASK_KEY) == event


def test_values_of_an_erased_task_stay_sealed_when_read_back() -> None:
    sealer = EventSealer(REGISTRY, keyring())
    event = make(StepSucceeded, step="charge", attempt_id="t1:charge:1", output={"card": "4111"}, calls=1)
    sealed = sealer.seal(event, TASK_KEY)
    assert sealer.unseal(sealed, None) == sealed


def test_a_value_written_in_clear_before_its_field_was_marked_is_read_as_it_is() -> None:
    sealer = EventSealer(REGISTRY, keyring())
    event = make(StepSucceeded, step="charge", attempt_id="t1:charge:1", output={"card": "clear"}, calls=1)
    assert sealer.unseal(event, TASK_KEY) == event


def test_workflows_marking_sensitive_data_refuse_to_run_without_a_key() -> None:
    with pytest.raises(SealingError, match="pay v1 mark sensitive data but no encryption key"):
        EventSealer(REGISTRY, None)
    plain = WorkflowRegistry.of([Workflow("plain", 1, (Step("s", "a"),))])
    event = make(StepSucceeded, step="s", attempt_id="t1:s:1", output={"x": 1}, calls=1)
    assert EventSealer(plain, None).seal(event, None) is event


def test_a_step_marking_names_at_least_one_field() -> None:
    with pytest.raises(ValueError, match="sensitive_output"):
        Step("s", "a", sensitive_output=frozenset())
