"""A Python handler agent: sign a loan's contract, and withdraw it as the step's undo (docs/handlers.md).

The contracts are files in ``CONTRACTS_DIR`` (default ``contracts``), one per idempotency key, so a
retried or redelivered call finds its contract signed and signs nothing twice; a withdrawal leaves a
tombstone under the key it undoes, so a forward call arriving after its undo signs nothing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from agents.handler import Call, PermanentError, TransientError


def _contracts() -> Path:
    folder = Path(os.environ.get("CONTRACTS_DIR", "contracts"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def sign_contract(call: Call) -> dict[str, Any]:
    """``[agents.contract-sign] handler = "contracts:sign_contract"``: the step's output is the contract."""
    loan = call.task_input
    if not isinstance(loan.get("amount"), int) or loan["amount"] <= 0:
        raise PermanentError(f"amount must be a positive integer, not {loan.get('amount')!r}", kind="validation")
    folder = _contracts()
    if (folder / ".busy").exists():  # the signing pad is taken: ask to be called again in a second
        raise TransientError("signing pad busy", retry_after_s=1.0, kind="throttled")
    if (folder / f"{call.idempotency_key}.withdrawn").exists():
        raise PermanentError(f"contract {call.idempotency_key} was withdrawn", kind="already_undone")
    signed = folder / f"{call.idempotency_key}.json"
    if not signed.exists():
        contract = {"contract_id": f"c-{call.task_id}", "loan_id": loan["loan_id"], "amount": loan["amount"],
                    "credit_line": call.output_of("hold-credit")["credit_line"], "attempt": call.attempt}
        signed.write_text(json.dumps(contract))
    return dict(json.loads(signed.read_text()))


def withdraw_contract(call: Call) -> dict[str, Any]:
    """``[agents.contract-withdraw] handler = "contracts:withdraw_contract"``: undoes a signing, whether or not
    it happened (the tombstone makes a late signing refuse)."""
    if call.undoes_key is None:
        raise PermanentError("a withdrawal names the signing it undoes", kind="validation")
    folder = _contracts()
    (folder / f"{call.undoes_key}.withdrawn").touch()
    signed = folder / f"{call.undoes_key}.json"
    if not signed.exists():
        return {"withdrawn": None}
    contract = json.loads(signed.read_text())
    signed.unlink()
    return {"withdrawn": contract["contract_id"]}
