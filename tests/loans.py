"""A loan as a project of handler agents (tests/test_handlers.py): hold credit, sign the contract (the
example of docs/handlers.md, examples/contracts.py), pay out; a payout refused for good withdraws the
contract. Loaded by the test's scheduler (``tests.loans:REGISTRY``) and agents (its stepstream.toml)."""

from __future__ import annotations

from typing import Any

from agents.handler import Call, PermanentError
from scheduler.workflow import Compensation, Step, Workflow, WorkflowRegistry

PAYOUT_LIMIT = 10_000

LOAN = Workflow(name="loan", version=1, failure_threshold=1, escalation="compensate", steps=(
    Step("hold-credit", agent="credit", timeout_s=3.0),
    Step("contract", agent="contract-sign", timeout_s=3.0,
         compensation=Compensation("contract-withdraw", timeout_s=3.0)),
    Step("payout", agent="payout", timeout_s=3.0),
))
REGISTRY = WorkflowRegistry.of([LOAN])

PROJECT = """
[project]
workflows = "tests.loans:REGISTRY"

[agents.credit]
handler = "tests.loans:hold_credit"

[agents.contract-sign]
handler = "examples.contracts:sign_contract"

[agents.contract-withdraw]
handler = "examples.contracts:withdraw_contract"

[agents.payout]
handler = "tests.loans:pay_out"
"""


def hold_credit(call: Call) -> dict[str, Any]:
    return {"credit_line": f"CL-{call.task_input['loan_id']}"}


def pay_out(call: Call) -> dict[str, Any]:
    amount = call.task_input["amount"]
    if amount > PAYOUT_LIMIT:
        raise PermanentError(f"payout of {amount} is over the limit of {PAYOUT_LIMIT}", kind="rejected")
    return {"paid": amount, "contract_id": call.output_of("contract")["contract_id"]}
