"""Per-agent access to sensitive values, without a broker: a step is given only the values its ``opens``
grants (the scheduler leaves the others out of its requests, even sealed), and an agent whose code asks
for one it was not granted gets a permanent failure naming the value. End to end (the payments agent
charges the token, the inventory agent's requests hold no trace of it): tests/test_sensitive_end_to_end.py."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from agents.runtime import Agent, Call
from agents.sealed_inputs import FieldNotGranted, SealedInputs
from eventstore.keys import DataKeys
from scheduler.sealing import granted, seal_input
from scheduler.workflow import Compensation, Step, Workflow
from schemas.messages import AgentRequest
from schemas.sealed import TaskKey
from tests.test_sensitive_inputs import KEYRING

SHOP = Workflow("shop", 1, (
    Step("reserve", "inventory"),
    Step("charge", "payments", opens=frozenset({"card_token"}), sensitive_output=frozenset({"charge_id"}),
         compensation=Compensation("payments-refund")),
    Step("ship", "shipping"),
    Step("audit", "auditor", opens=frozenset({"charge.charge_id"})),
), sensitive_input=frozenset({"card_token"}))
TASK = {"order_id": "o-1", "card_token": "tok_4111"}
CHARGE = {"charge_id": "ch_9", "status": "captured"}


def test_a_step_is_given_only_the_sensitive_values_its_opens_grants() -> None:
    reserve, withheld = granted(SHOP, SHOP.step("reserve"), {"task": TASK, "steps": {}}, compensation=False)
    assert reserve == {"task": {"order_id": "o-1"}, "steps": {}} and withheld == ["card_token"]
    charge, withheld = granted(SHOP, SHOP.step("charge"), {"task": TASK, "steps": {}}, compensation=False)
    assert charge["task"] == TASK and withheld == []

    done = {"task": TASK, "steps": {"reserve": {"reservation_id": "r-1"}, "charge": CHARGE}}
    ship, withheld = granted(SHOP, SHOP.step("ship"), done, compensation=False)
    assert ship["task"] == {"order_id": "o-1"} and ship["steps"]["charge"] == {"status": "captured"}
    assert withheld == ["card_token", "charge.charge_id"], "nor another step's marked output"
    audit, withheld = granted(SHOP, SHOP.step("audit"), done, compensation=False)
    assert audit["steps"]["charge"] == CHARGE and withheld == ["card_token"]


def test_a_compensation_is_given_its_steps_grants_and_its_steps_own_output_whole() -> None:
    data = {"task": TASK, "steps": {"reserve": {"reservation_id": "r-1"}, "charge": CHARGE}}
    refund, withheld = granted(SHOP, SHOP.step("charge"), data, compensation=True)
    assert refund == data and withheld == []


def test_a_step_granted_a_value_the_workflow_does_not_mark_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="step reserve opens card_number: each must be a field of sensitive_input"):
        Workflow("w", 1, (Step("reserve", "inventory", opens=frozenset({"card_number"})),),
                 sensitive_input=frozenset({"card_token"}))
    with pytest.raises(ValueError, match=r"step charge opens ship\.tracking"):  # a later step's output: not yet there
        Workflow("w", 1, (Step("charge", "payments", opens=frozenset({"ship.tracking"})),
                          Step("ship", "shipping", sensitive_output=frozenset({"tracking"}))))


def inventory_request(withheld: list[str]) -> AgentRequest:
    """A reserve request as the scheduler sends it: the card token left out when not granted."""
    key = TaskKey.generate()
    keys = DataKeys("127.0.0.1:1", "keys")  # never read: the task's key is known already
    keys._wrapped["t1"] = KEYRING.wrap(key, "t1")
    task = seal_input(SHOP, "t1", TASK, key)
    request = AgentRequest(task_id="t1", step="reserve", attempt=1, attempt_id="t1:reserve:1",
                           idempotency_key="t1:reserve", complete_by=datetime.now(UTC) + timedelta(minutes=1),
                           calls_allowed=1,
                           input={"task": {k: v for k, v in task.items() if k not in withheld}, "steps": {}},
                           withheld=withheld)
    return SealedInputs(keys, KEYRING).open(request)[0]


def test_an_agent_asking_for_a_value_its_step_is_not_granted_fails_for_good_naming_it() -> None:
    def reserve(call: Call) -> dict[str, Any]:
        return {"reserved": call.request.input["task"]["order_id"], "card": call.request.input["task"]["card_token"]}

    result = Agent("inventory", reserve).execute(inventory_request(["card_token"]))
    assert not result.ok and result.permanent and result.calls == 1
    assert "step reserve is not granted card_token" in (result.error or "")
    with pytest.raises(FieldNotGranted, match="not granted card_token"):
        inventory_request(["card_token"]).input["task"].get("card_token")

    def reserve_own(call: Call) -> dict[str, Any]:
        return {"reserved": call.request.input["task"]["order_id"]}

    assert Agent("inventory", reserve_own).execute(inventory_request(["card_token"])).output == {"reserved": "o-1"}
