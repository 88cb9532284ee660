"""A value a step opened never leaves the agent in clear: not in the answer's error or output, not in a log
line, not in a span. End to end (a real service echoing it, scanned in topics, store, logs, API, CLI):
tests/test_sensitive_end_to_end.py."""

from __future__ import annotations

import json
import traceback
from datetime import UTC, datetime, timedelta
from typing import Any, cast
from urllib.parse import quote

import httpx
import pydantic
import pytest
import structlog
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from agents.faults import TransientError, classify_response
from agents.policy import BreakerPolicy, DependencyPolicy
from agents.redaction import MASK, Redactor, redacting
from agents.runtime import Agent, AttemptAbandoned, Call
from agents.sealed_inputs import SealedInputs
from eventstore.keys import DataKeys
from eventstore.masking import mask_values
from eventstore.producer import EventProducer
from eventstore.runtime import Record
from scheduler.sealing import seal_input
from schemas.messages import AgentRequest, StepResult
from schemas.sealed import TaskKey, is_sealed
from tests.test_field_access import SHOP
from tests.test_sensitive_inputs import KEYRING
from tests.test_tracing import Sent, spans  # noqa: F401  (the fixture)

IBAN = "DE89370400440532013000"


# ---- the redactor ---------------------------------------------------------------------------------


def test_an_opened_value_is_masked_as_it_stands_and_as_json_repr_and_a_url_quote_it() -> None:
    odd = 'ab"c\\d é'
    redactor = Redactor([IBAN, odd])
    for text in (f"iban {IBAN} is blocked", json.dumps({"detail": odd}), json.dumps({"d": json.dumps(odd)}),
                 json.dumps(odd, ensure_ascii=False), f"input_value={odd!r}", f"https://x/pay?to={quote(odd)}"):
        masked = redactor.text(text)
        assert IBAN not in masked and odd not in masked and MASK in masked, text
    assert redactor.text("nothing secret here") == "nothing secret here"


def test_a_longer_value_holding_a_shorter_one_is_masked_whole() -> None:
    assert Redactor(["4242", "tok_4242_x"]).text("card tok_4242_x, last 4242") == f"card {MASK}, last {MASK}"


def test_values_shorter_than_four_characters_are_left_alone_structured_ones_by_their_parts() -> None:
    redactor = Redactor(["EUR", 7, True, {"pin": "0815", "n": 123456}, ["tok_abcd"]])
    assert redactor.text("7 x 100 EUR, pin 0815, ref 123456, tok_abcd") == \
        f"7 x 100 EUR, pin {MASK}, ref {MASK}, {MASK}"
    assert not Redactor(["EUR", 7, None]), "nothing long enough to mask: a redactor that does nothing"


def test_an_output_is_masked_field_by_field_and_a_sealed_envelope_is_kept() -> None:
    sealed = KEYRING.seal(IBAN, ("t1", "charge", "output", "iban"))
    redactor = Redactor([IBAN, 123456])
    output = {"iban": IBAN, "note": f"paid to {IBAN}", "amount": 123456, "count": 2, "ok": True,
              "lines": [{"to": IBAN}], "kept": sealed}
    assert redactor.value(output) == {"iban": MASK, "note": f"paid to {MASK}", "amount": MASK, "count": 2,
                                      "ok": True, "lines": [{"to": MASK}], "kept": sealed}


def test_a_log_line_written_while_redacting_is_masked_its_traceback_too() -> None:
    lines: list[str] = []

    class Lines:
        def msg(self, line: str) -> None:
            lines.append(line)

        error = info = msg

    log = structlog.wrap_logger(Lines(), processors=[structlog.processors.format_exc_info, mask_values,
                                                     structlog.processors.JSONRenderer()])
    try:
        raise ValueError(f"iban {IBAN} refused")
    except ValueError as exc:
        with redacting(Redactor([IBAN])):
            log.error("call failed", error=str(exc), detail={"iban": IBAN}, exc_info=exc)
        log.info("after the attempt", error=str(exc))
    assert IBAN not in lines[0] and lines[0].count(MASK) >= 3 and "ValueError" in lines[0]
    assert IBAN in lines[1], "outside the attempt nothing is masked (nothing was opened there)"


# ---- what the agent answers, logs and traces -------------------------------------------------------


def charge_request() -> tuple[AgentRequest, SealedInputs]:
    """A charge request holding the iban sealed (the step opens it), marking ``charge_id`` sensitive."""
    key = TaskKey.generate()
    keys = DataKeys("127.0.0.1:1", "keys")  # never read: the task's key is known already
    keys._wrapped["t1"] = KEYRING.wrap(key, "t1")
    request = AgentRequest(task_id="t1", step="charge", attempt=1, attempt_id="t1:charge:1",
                           idempotency_key="t1:charge", complete_by=datetime.now(UTC) + timedelta(minutes=1),
                           calls_allowed=2, sealed_output=["charge_id"],
                           input={"task": seal_input(SHOP, "t1", {"order_id": "o-1", "card_token": IBAN}, key),
                                  "steps": {}})
    return request, SealedInputs(keys, KEYRING)


def answer(handler: Any, *, draining: bool = False) -> StepResult:
    """What the agent sends back for the charge request run by ``handler``."""
    agent = Agent("payments", handler, DependencyPolicy(breaker=BreakerPolicy(enabled=False)),
                  sleep=lambda _: draining)
    request, inputs = charge_request()
    sent = Sent()
    agent.handle(Record("agent.payments", 0, 1, "t1", request, []), cast(EventProducer, sent), "inbox", inputs)
    (result, _), = sent.messages
    assert isinstance(result, StepResult)
    return result


def test_a_refusal_quoting_the_opened_value_is_answered_masked_and_its_call_span_too(
    spans: InMemorySpanExporter,  # noqa: F811
) -> None:
    def refuse(call: Call) -> dict[str, Any]:
        body = {"detail": f"iban {call.request.input['task']['card_token']} is blocked"}
        fault = classify_response(httpx.Response(422, json=body), what="payments/charge")
        assert fault is not None
        raise fault

    result = answer(refuse)
    assert not result.ok and result.permanent
    assert result.error is not None and IBAN not in result.error and f"iban {MASK} is blocked" in result.error
    recorded = [(s.status.description or "", str(s.events)) for s in spans.get_finished_spans()]
    assert any(MASK in status for status, _ in recorded), "the call's span says why, masked"
    assert not [r for r in recorded if IBAN in str(r)]


def test_a_validation_error_says_what_was_wrong_without_quoting_the_input_however_long() -> None:
    class Payout(pydantic.BaseModel):
        iban: str = pydantic.Field(pattern=r"^GB")

    long = IBAN * 4  # pydantic cuts a long input in the middle: its ends would match no mask

    def validate(call: Call) -> dict[str, Any]:
        Payout.model_validate({"iban": call.request.input["task"]["card_token"] * 4})
        return {}

    result = answer(validate)
    assert result.error == "invalid data: ValidationError: iban: String should match pattern '^GB'"
    assert long[:10] not in result.error and long[-10:] not in result.error


def test_a_value_straddling_the_cut_of_an_error_body_leaves_no_piece_of_itself() -> None:
    def refuse(call: Call) -> dict[str, Any]:
        body = {"detail": "x" * 270 + f" iban {call.request.input['task']['card_token']} is blocked"}
        fault = classify_response(httpx.Response(422, json=body), what="payments/charge")
        assert fault is not None
        raise fault

    error = answer(refuse).error or ""
    assert IBAN[:6] not in error and f"iban {MASK}" in error, "masked before the body is cut to 300 characters"


def test_an_output_echoing_the_opened_value_has_it_masked_and_its_marked_field_sealed() -> None:
    def pay(call: Call) -> dict[str, Any]:
        iban = call.request.input["task"]["card_token"]
        return {"charge_id": f"ch_{iban}", "paid_to": iban, "status": "captured"}

    result = answer(pay)
    assert result.ok and result.output is not None
    assert is_sealed(result.output["charge_id"]), "marked: sealed (the service's own value, kept whole)"
    assert result.output["paid_to"] == MASK and result.output["status"] == "captured"
    assert IBAN not in str(result.output)


def test_an_attempt_abandoned_by_a_drain_carries_the_last_error_masked_and_no_clear_cause() -> None:
    def throttle(call: Call) -> dict[str, Any]:
        raise TransientError(f"busy paying {call.request.input['task']['card_token']}", kind="throttled")

    with pytest.raises(AttemptAbandoned) as abandoned:
        answer(throttle, draining=True)
    rendered = "".join(traceback.format_exception(abandoned.value))
    assert IBAN not in rendered and f"busy paying {MASK}" in str(abandoned.value)
