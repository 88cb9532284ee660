"""The handler contract as handler authors use it (agents.handler): the documented example is the example
file, the page's test block runs as it stands, and the harness treats a handler as the runtime does."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from agents.handler import Call, FieldNotGranted, HandlerEnvironment, PermanentError, TransientError
from agents.policy import BreakerPolicy, DependencyPolicy
from examples.contracts import sign_contract
from scheduler.decider.ids import compensation_idempotency_key, idempotency_key
from tests.loans import PROJECT
from tests.system import System

ROOT = Path(__file__).parent.parent
PAGE = ROOT / "docs" / "handlers.md"


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", PAGE.read_text(), re.MULTILINE | re.DOTALL)


@pytest.fixture
def contracts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("CONTRACTS_DIR", str(tmp_path))
    return tmp_path


def test_the_page_shows_the_example_file_as_it_is() -> None:
    assert python_blocks()[0] == (ROOT / "examples" / "contracts.py").read_text()


def test_the_pages_testing_block_runs_as_it_stands(contracts: Path) -> None:
    exec(compile(python_blocks()[1], str(PAGE), "exec"), {})
    assert (contracts / "loan-7:contract.withdrawn").exists() and not (contracts / "loan-7:contract.json").exists()


def test_a_busy_pad_is_a_throttle_with_its_wait_and_an_attempt_spends_its_calls_on_it(contracts: Path) -> None:
    (contracts / ".busy").touch()
    env = HandlerEnvironment(task_id="loan-8", step="contract", calls_allowed=2)
    loan, held = {"loan_id": "L-8", "amount": 10}, {"hold-credit": {"credit_line": "CL-2"}}
    with pytest.raises(TransientError, match="signing pad busy") as busy:
        env.run(sign_contract, loan, steps=held)
    assert busy.value.kind == "throttled" and busy.value.retry_after_s == 1.0
    answer = env.run_attempt(sign_contract, loan, steps=held,
                         policy=DependencyPolicy(breaker=BreakerPolicy(enabled=False)))
    assert not answer.ok and not answer.permanent and answer.calls == 2 and answer.error_kind == "throttled"
    assert answer.retry_after_s is not None and answer.retry_after_s > 0.9, "the handler's wait goes back with it"


def test_a_call_offers_the_task_input_earlier_outputs_keys_and_deadline_as_the_scheduler_sent_them() -> None:
    env = HandlerEnvironment(task_id="t-1", step="sign", attempt=3, timeout_s=4.0)
    call = env.call({"loan_id": "L"}, steps={"hold": {"line": "CL"}})
    assert (call.task_id, call.step, call.attempt, call.timeout_s) == ("t-1", "sign", 3, 4.0)
    assert call.task_input == {"loan_id": "L"} and call.step_outputs == {"hold": {"line": "CL"}}
    assert call.idempotency_key == idempotency_key("t-1", "sign"), "the key the scheduler gives the step"
    assert call.undoes_key is None and not call.is_compensation
    assert call.deadline == call.request.complete_by
    with pytest.raises(KeyError, match=r"no output of step 'pay' in this call \(outputs of: hold\)"):
        call.output_of("pay")
    undo = env.call(undoes=True)
    assert undo.is_compensation and undo.undoes_key == "t-1:sign" and undo.undoes_attempt == 3
    assert undo.idempotency_key == compensation_idempotency_key("t-1", "sign"), "an undo's key of its own"


def test_what_a_handler_raises_comes_out_as_the_runtime_takes_it() -> None:
    def bad_data(call: Call) -> dict[str, Any]:
        return {"n": int(call.task_input["n"])}

    with pytest.raises(PermanentError, match="invalid data: ValueError") as refused:
        HandlerEnvironment().run(bad_data, {"n": "seven"})
    assert refused.value.kind == "validation" and isinstance(refused.value.__cause__, ValueError)
    with pytest.raises(TransientError) as dropped:
        HandlerEnvironment().run(lambda call: (_ for _ in ()).throw(ConnectionResetError("peer")), {})
    assert dropped.value.kind == "connection"
    assert issubclass(FieldNotGranted, PermanentError), "asking for a value not granted fails for good"


def test_a_handler_asking_for_a_value_its_step_is_not_granted_fails_for_good_naming_it() -> None:
    def nosy(call: Call) -> dict[str, Any]:
        return {"card": call.task_input["card_token"], "ref": call.output_of("charge").get("charge_id")}

    env = HandlerEnvironment(step="ship")
    task, steps = {"order_id": "o-1", "card_token": "tok_1"}, {"charge": {"charge_id": "ch_1", "status": "ok"}}
    assert env.run(nosy, task, steps=steps) == {"card": "tok_1", "ref": "ch_1"}, "granted: given"
    with pytest.raises(FieldNotGranted, match="step ship is not granted card_token"):
        env.run(nosy, task, steps=steps, withheld=["card_token"])
    with pytest.raises(FieldNotGranted, match=r"step ship is not granted charge\.charge_id"):
        env.run(nosy, task, steps=steps, withheld=["charge.charge_id"])
    answer = env.run_attempt(nosy, task, steps=steps, withheld=["card_token"])
    assert answer.permanent and answer.calls == 1 and "not granted card_token" in (answer.error or "")


@pytest.mark.kafka
def test_handler_agents_of_a_project_sign_a_loans_contract_once_and_withdraw_it_when_the_payout_is_refused(
    system: System, tmp_path: Path,
) -> None:
    project, contracts = tmp_path / "loans", tmp_path / "contracts"
    project.mkdir()
    (project / "stepstream.toml").write_text(PROJECT)
    system.env.update({"STEPSTREAM_SCHEDULER_WORKFLOWS": "tests.loans:REGISTRY", "STEPSTREAM_PROJECT": str(project),
                       "CONTRACTS_DIR": str(contracts)})
    agents = ("credit", "contract-sign", "contract-withdraw", "payout")
    for name in agents:
        system.procs.service(name, "agent", name)
    system.start("projector", "scheduler")
    for name in agents:
        system.procs.wait_started(name)
    system.submit("loan-1", {"loan_id": "L-1", "amount": 500}, workflow="loan")
    system.submit("loan-2", {"loan_id": "L-2", "amount": 50_000}, workflow="loan")
    assert system.wait_terminal(["loan-1", "loan-2"], timeout_s=90) == {"loan-1": "completed",
                                                                        "loan-2": "compensated"}

    # The world, the contracts folder: the first loan's contract signed once, the second's withdrawn for good.
    assert json.loads((contracts / "loan-1:contract.json").read_text()) == {
        "contract_id": "c-loan-1", "loan_id": "L-1", "amount": 500, "credit_line": "CL-L-1", "attempt": 1}
    assert not (contracts / "loan-2:contract.json").exists() and (contracts / "loan-2:contract.withdrawn").exists()
    assert not (contracts / "loan-1:contract.withdrawn").exists()
    steps = {step["step"]: step for step in system.steps("loan-2")}
    assert steps["contract"]["status"] == "compensated", "undone by the withdrawal handler"
    assert steps["payout"]["status"] == "compensation_skipped", "refused for good: nothing applied, nothing to undo"
    assert "payout of 50000 is over the limit of 10000" in steps["payout"]["error"]
