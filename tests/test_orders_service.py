"""The orders service, as a real subprocess over real HTTP: dedup, fencing, faults, admin, persistence.

One service process per module (started once, reset before each test) keeps the file fast; the
persistence tests start their own process because they restart it.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from demo.orders_client import OrdersAdmin, ServiceProcess

ORDER: dict[str, Any] = {"order_id": "o-1", "sku": "SKU-1", "qty": 2, "amount": 42.5}


@pytest.fixture(scope="module")
def service() -> Iterator[ServiceProcess]:
    with ServiceProcess(seed=1234) as proc:
        yield proc


@pytest.fixture
def admin(service: ServiceProcess) -> Iterator[OrdersAdmin]:
    with service.admin() as client:
        client.reset(seed=1234)
        yield client


def key() -> str:
    return f"k-{uuid.uuid4().hex[:12]}"


# ---- idempotency and fencing ----------------------------------------------------------------------


def test_repeat_of_applied_key_returns_same_result_and_applies_once(admin: OrdersAdmin) -> None:
    k = key()
    first = admin.call("inventory/reserve", ORDER, idempotency_key=k, attempt=1)
    again = admin.call("inventory/reserve", ORDER, idempotency_key=k, attempt=1)
    retry = admin.call("inventory/reserve", ORDER, idempotency_key=k, attempt=2)

    assert first.status_code == again.status_code == retry.status_code == 200
    assert "reservation_id" in first.json()
    assert again.json() == first.json() == retry.json()
    assert first.headers["Idempotent-Replayed"] == "false"
    assert again.headers["Idempotent-Replayed"] == retry.headers["Idempotent-Replayed"] == "true"
    assert admin.requests_for("inventory/reserve", k) == 3
    assert admin.applied_for("inventory/reserve", k) == 1
    assert len(admin.records()["reservations"]) == 1


def test_same_key_is_independent_per_operation(admin: OrdersAdmin) -> None:
    k = key()
    assert admin.call("inventory/reserve", ORDER, idempotency_key=k, attempt=1).status_code == 200
    assert admin.call("payments/charge", ORDER, idempotency_key=k, attempt=1).status_code == 200
    calls = admin.calls()
    assert calls["applied"] == {"inventory/reserve": {k: 1}, "payments/charge": {k: 1}}


def test_same_key_with_different_body_is_rejected_422_not_replayed(admin: OrdersAdmin) -> None:
    k = key()
    assert admin.call("payments/charge", ORDER, idempotency_key=k, attempt=1).status_code == 200
    other = admin.call("payments/charge", {**ORDER, "amount": 99}, idempotency_key=k, attempt=2)
    assert other.status_code == 422
    assert other.json()["error"] == "idempotency_key_reused"
    assert admin.applied_for("payments/charge", k) == 1


def test_stale_attempt_is_fenced_with_409_and_applies_nothing(admin: OrdersAdmin) -> None:
    k = key()
    admin.set_faults("shipping/create", fail_next=1)
    assert admin.call("shipping/create", ORDER, idempotency_key=k, attempt=3).status_code == 503

    stale = admin.call("shipping/create", ORDER, idempotency_key=k, attempt=2)
    assert stale.status_code == 409
    assert stale.json()["error"] == "stale_attempt"
    assert stale.json()["highest_attempt"] == 3
    assert admin.applied_for("shipping/create", k) == 0

    assert admin.call("shipping/create", ORDER, idempotency_key=k, attempt=3).status_code == 200
    assert admin.call("shipping/create", ORDER, idempotency_key=k, attempt=1).status_code == 409
    assert admin.applied_for("shipping/create", k) == 1


def test_slow_old_attempt_cannot_act_after_newer_attempt_arrived(admin: OrdersAdmin, service: ServiceProcess) -> None:
    """Attempt 1 is delayed in the service; attempt 2 arrives meanwhile; attempt 1 must then be fenced."""
    k = key()
    admin.set_faults("inventory/reserve", latency_ms=600)
    results: dict[int, httpx.Response] = {}

    def send(attempt: int) -> None:
        with service.admin() as client:
            results[attempt] = client.call("inventory/reserve", ORDER, idempotency_key=k, attempt=attempt)

    old = threading.Thread(target=send, args=(1,))
    old.start()
    _wait_until(lambda: admin.requests_for("inventory/reserve", k) == 1)
    send(2)
    old.join(timeout=10)

    assert results[2].status_code == 200
    assert results[1].status_code == 409
    assert admin.applied_for("inventory/reserve", k) == 1
    assert admin.records()["effects"][0]["attempt"] == 2


@pytest.mark.parametrize(
    ("idempotency_key", "attempt", "header"),
    [
        (None, 1, "Idempotency-Key"),
        ("", 1, "Idempotency-Key"),
        ("k", None, "X-Attempt"),
        ("k", "one", "X-Attempt"),
        ("k", "-1", "X-Attempt"),
    ],
)
def test_missing_or_invalid_headers_get_400_naming_the_header(
    service: ServiceProcess, admin: OrdersAdmin, idempotency_key: str | None, attempt: Any, header: str
) -> None:
    headers = {}
    if idempotency_key is not None:
        headers["Idempotency-Key"] = idempotency_key
    if attempt is not None:
        headers["X-Attempt"] = str(attempt)
    response = httpx.post(f"{service.base_url}/payments/charge", json=ORDER, headers=headers)
    assert response.status_code == 400
    assert response.json()["header"] == header
    assert header in response.json()["detail"]
    assert admin.calls()["applied"] == {}


@pytest.mark.parametrize(
    ("body", "field"),
    [({"sku": "x"}, "order_id"), ({"order_id": "o", "qty": 0}, "qty"), ({"order_id": "o", "amount": -1}, "amount")],
)
def test_invalid_order_data_is_a_permanent_422_naming_the_field(
    admin: OrdersAdmin, body: dict[str, Any], field: str
) -> None:
    response = admin.call("inventory/reserve", body, idempotency_key=key(), attempt=1)
    assert response.status_code == 422
    assert response.json()["field"] == field
    assert admin.calls()["applied"] == {}


# ---- compensations ------------------------------------------------------------------------------


def test_compensations_undo_the_forward_effects_of_the_order(admin: OrdersAdmin) -> None:
    order = {**ORDER, "order_id": "o-comp"}
    reservation = admin.call("inventory/reserve", order, idempotency_key=key(), attempt=1).json()
    charge = admin.call("payments/charge", order, idempotency_key=key(), attempt=1).json()
    shipment = admin.call("shipping/create", order, idempotency_key=key(), attempt=1).json()

    cancel = admin.call("shipping/cancel", {"order_id": "o-comp"}, idempotency_key=key(), attempt=1).json()
    refund = admin.call("payments/refund", {"order_id": "o-comp"}, idempotency_key=key(), attempt=1).json()
    release = admin.call("inventory/release", {"order_id": "o-comp"}, idempotency_key=key(), attempt=1).json()

    assert cancel["cancelled"] == [shipment["shipment_id"]]
    assert refund["refunded"] == [charge["charge_id"]]
    assert refund["amount"] == order["amount"]
    assert release["released"] == [reservation["reservation_id"]]
    records = admin.records(order_id="o-comp")
    assert records["reservations"][reservation["reservation_id"]]["status"] == "released"
    assert records["charges"][charge["charge_id"]]["status"] == "refunded"
    assert records["shipments"][shipment["shipment_id"]]["status"] == "cancelled"
    assert [e["operation"] for e in records["effects"]] == [
        "inventory/reserve",
        "payments/charge",
        "shipping/create",
        "shipping/cancel",
        "payments/refund",
        "inventory/release",
    ]


def test_compensation_with_nothing_to_undo_succeeds_empty(admin: OrdersAdmin) -> None:
    response = admin.call("inventory/release", {"order_id": "never-reserved"}, idempotency_key=key(), attempt=1)
    assert response.status_code == 200
    assert response.json()["released"] == []
    assert response.json()["status"] == "nothing_to_release"


# ---- faults ---------------------------------------------------------------------------------------


def test_fail_next_fails_n_requests_with_503_then_succeeds_once(admin: OrdersAdmin) -> None:
    k = key()
    admin.set_faults(fail_next=2)
    statuses = [admin.call("payments/charge", ORDER, idempotency_key=k, attempt=n).status_code for n in (1, 2, 3, 4)]
    assert statuses == [503, 503, 200, 200]
    assert admin.requests_for("payments/charge", k) == 4
    assert admin.applied_for("payments/charge", k) == 1
    assert admin.faults()["global"] is not None
    assert admin.faults()["global"]["fail_next"] == 0  # type: ignore[index]


def test_throttle_returns_429_with_retry_after_header(admin: OrdersAdmin) -> None:
    k = key()
    admin.set_faults(throttle_rate=1.0, retry_after_s=7)
    response = admin.call("inventory/reserve", ORDER, idempotency_key=k, attempt=1)
    assert response.status_code == 429
    assert response.headers["Retry-After"] == "7"
    assert response.json()["retry_after_s"] == 7
    assert admin.applied_for("inventory/reserve", k) == 0


def test_permanent_error_rate_returns_422_with_json_error(admin: OrdersAdmin) -> None:
    k = key()
    admin.set_faults(permanent_error_rate=1.0)
    response = admin.call("shipping/create", ORDER, idempotency_key=k, attempt=1)
    assert response.status_code == 422
    assert response.json()["error"] == "rejected"
    assert admin.applied_for("shipping/create", k) == 0


def test_error_rate_faults_are_reproducible_from_the_seed(admin: OrdersAdmin) -> None:
    def run() -> list[int]:
        admin.reset(seed=7)
        admin.set_faults(error_rate=0.5)
        return [admin.call("payments/charge", ORDER, idempotency_key=key(), attempt=1).status_code for _ in range(20)]

    first, second = run(), run()
    assert first == second
    assert set(first) == {200, 503}


def test_latency_is_applied_before_answering(admin: OrdersAdmin) -> None:
    admin.set_faults(latency_ms=300)
    started = time.monotonic()
    response = admin.call("inventory/reserve", ORDER, idempotency_key=key(), attempt=1)
    elapsed = time.monotonic() - started
    assert response.status_code == 200
    assert 0.29 <= elapsed < 3.0


def test_latency_jitter_spreads_answers_over_the_range_so_some_land_after_a_caller_gave_up(admin: OrdersAdmin) -> None:
    admin.set_faults(latency_ms=100, latency_jitter_ms=400)
    elapsed = []
    for _ in range(12):
        started = time.monotonic()
        assert admin.call("inventory/reserve", ORDER, idempotency_key=key(), attempt=1).status_code == 200
        elapsed.append(time.monotonic() - started)
    assert all(0.099 <= e < 3.0 for e in elapsed)
    assert max(elapsed) - min(elapsed) > 0.1, f"answer times spread over the jitter: {elapsed}"


def test_hang_holds_until_client_times_out_and_applies_nothing(admin: OrdersAdmin) -> None:
    k = key()
    admin.set_faults("payments/charge", hang=True)
    started = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        admin.call("payments/charge", ORDER, idempotency_key=k, attempt=1, timeout_s=0.5)
    assert time.monotonic() - started >= 0.5
    # The service notices the client went away and releases the request, without an effect.
    _wait_until(lambda: admin.calls()["in_flight"] == 0)
    calls = admin.calls()
    assert calls["requests"]["payments/charge"][k] == 1
    assert calls["applied"] == {}
    assert calls["outcomes"]["payments/charge"][k] == {"disconnected": 1}


def test_hanging_request_does_not_block_other_requests(admin: OrdersAdmin, service: ServiceProcess) -> None:
    admin.set_faults("payments/charge", hang=True)

    def hang() -> None:
        with service.admin() as client, contextlib.suppress(httpx.HTTPError):
            client.call("payments/charge", ORDER, idempotency_key=key(), attempt=1, timeout_s=1.5)

    hung = threading.Thread(target=hang)
    hung.start()
    try:
        _wait_until(lambda: admin.calls()["in_flight"] == 1)
        started = time.monotonic()
        response = admin.call("inventory/reserve", ORDER, idempotency_key=key(), attempt=1)
        assert response.status_code == 200
        assert time.monotonic() - started < 1.0
        assert admin.calls()["in_flight"] == 1  # still hanging
    finally:
        hung.join(timeout=10)


def test_faults_scoped_to_one_operation_leave_others_alone(admin: OrdersAdmin) -> None:
    admin.set_faults("payments/charge", error_rate=1.0)
    assert admin.call("payments/charge", ORDER, idempotency_key=key(), attempt=1).status_code == 503
    for op in ("inventory/reserve", "shipping/create", "payments/refund"):
        assert admin.call(op, ORDER, idempotency_key=key(), attempt=1).status_code == 200


def test_operation_override_replaces_global_faults_and_clearing_it_falls_back(admin: OrdersAdmin) -> None:
    admin.set_faults(error_rate=1.0)
    admin.set_faults("inventory/reserve")  # an explicit "no faults" override
    assert admin.call("inventory/reserve", ORDER, idempotency_key=key(), attempt=1).status_code == 200
    assert admin.call("shipping/create", ORDER, idempotency_key=key(), attempt=1).status_code == 503

    view = admin.clear_faults("inventory/reserve")
    assert view["operations"] == {}
    assert admin.call("inventory/reserve", ORDER, idempotency_key=key(), attempt=1).status_code == 503

    view = admin.clear_faults()
    assert view == {"global": None, "operations": {}}
    assert admin.call("inventory/reserve", ORDER, idempotency_key=key(), attempt=1).status_code == 200


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ({"error_rate": 1.5}, "error_rate"),
        ({"latency_ms": -1}, "latency_ms"),
        ({"operation": "payments/steal"}, "operation"),
        ({"fail_next": "many"}, "fail_next"),
        ({"eror_rate": 0.5}, "eror_rate"),
    ],
)
def test_bad_admin_payload_is_422_naming_the_field(
    service: ServiceProcess, admin: OrdersAdmin, payload: dict[str, Any], field: str
) -> None:
    response = httpx.put(f"{service.base_url}/admin/faults", json=payload)
    assert response.status_code == 422
    assert field in [err["loc"][-1] for err in response.json()["detail"]]
    assert admin.faults() == {"global": None, "operations": {}}


def test_reset_clears_state_and_faults(admin: OrdersAdmin) -> None:
    admin.call("inventory/reserve", ORDER, idempotency_key=key(), attempt=1)
    admin.set_faults(error_rate=1.0)
    admin.reset()
    assert admin.calls() == {"requests": {}, "applied": {}, "outcomes": {}, "in_flight": 0, "peak_in_flight": 0}
    assert admin.arrivals() == {}
    assert admin.records()["effects"] == []
    assert admin.faults() == {"global": None, "operations": {}}


# ---- persistence --------------------------------------------------------------------------------


def test_state_file_keeps_dedup_and_fencing_across_clean_stop_and_crash(tmp_path: Path) -> None:
    state_file = tmp_path / "orders-state.json"
    k = key()
    with ServiceProcess(state_file=state_file) as proc, proc.admin() as client:
        first = client.call("inventory/reserve", ORDER, idempotency_key=k, attempt=2)
        assert first.status_code == 200

        def assert_dedup_and_fencing_survived() -> None:
            again = client.call("inventory/reserve", ORDER, idempotency_key=k, attempt=2)
            assert again.status_code == 200
            assert again.json() == first.json()
            assert again.headers["Idempotent-Replayed"] == "true"
            assert client.call("inventory/reserve", ORDER, idempotency_key=k, attempt=1).status_code == 409
            assert client.applied_for("inventory/reserve", k) == 1
            assert len(client.records()["reservations"]) == 1

        assert proc.stop() == 0  # SIGTERM: graceful drain, exit code 0
        proc.start()  # same port: URLs handed out stay valid
        assert_dedup_and_fencing_survived()

        proc.restart(hard=True)  # SIGKILL: nothing flushed at shutdown, effects were written before answering
        assert_dedup_and_fencing_survived()


# ---- undo fencing (tombstones) --------------------------------------------------------------------


def test_a_forward_call_arriving_after_the_undo_of_its_key_is_refused_and_applies_nothing(
    admin: OrdersAdmin,
) -> None:
    """The undo never saw the forward call (it had not landed): the late forward call must not land after it."""
    k = key()
    undo = admin.call("inventory/release", ORDER, idempotency_key=f"{k}:undo", attempt=1, undoes_key=k)
    assert undo.status_code == 200 and undo.json()["status"] == "nothing_to_release"

    late = admin.call("inventory/reserve", ORDER, idempotency_key=k, attempt=3)

    assert late.status_code == 410
    assert late.json()["error"] == "already_undone"
    assert admin.applied_for("inventory/reserve", k) == 0
    assert admin.records()["reservations"] == {}
    assert admin.records()["tombstones"]["inventory/reserve"][k]["undo_key"] == f"{k}:undo"


def test_a_forward_effect_that_landed_before_the_undo_is_released_and_its_replay_is_refused(
    admin: OrdersAdmin,
) -> None:
    """A stored result is not replayed after the undo: the caller would otherwise believe it still holds."""
    k = key()
    assert admin.call("payments/charge", ORDER, idempotency_key=k, attempt=1).status_code == 200
    undo = admin.call("payments/refund", ORDER, idempotency_key=f"{k}:undo", attempt=1, undoes_key=k)
    assert undo.status_code == 200 and undo.json()["status"] == "refunded"

    replay = admin.call("payments/charge", ORDER, idempotency_key=k, attempt=1)

    assert replay.status_code == 410
    assert admin.applied_for("payments/charge", k) == 1
    assert [c["status"] for c in admin.records()["charges"].values()] == ["refunded"]


def test_a_forward_call_delayed_in_the_service_while_its_undo_lands_applies_nothing(
    admin: OrdersAdmin, service: ServiceProcess,
) -> None:
    """The race the issue saw: the call was received before the undo but would apply after it."""
    k = key()
    admin.set_faults("shipping/create", latency_ms=600)
    results: list[httpx.Response] = []

    def send() -> None:
        with service.admin() as client:
            results.append(client.call("shipping/create", ORDER, idempotency_key=k, attempt=1))

    slow = threading.Thread(target=send)
    slow.start()
    _wait_until(lambda: admin.requests_for("shipping/create", k) == 1)
    undo = admin.call("shipping/cancel", ORDER, idempotency_key=f"{k}:undo", attempt=1, undoes_key=k)
    slow.join(timeout=10)

    assert undo.status_code == 200
    assert results[0].status_code == 410
    assert admin.applied_for("shipping/create", k) == 0
    assert admin.records()["shipments"] == {}


def test_an_undo_of_a_forward_call_refused_for_its_data_succeeds_with_nothing_to_undo(admin: OrdersAdmin) -> None:
    """A compensation must be safe when the forward call never happened, whatever made it not happen."""
    k = key()
    bad = {**ORDER, "qty": 0}
    assert admin.call("inventory/reserve", bad, idempotency_key=k, attempt=1).status_code == 422
    undo = admin.call("inventory/release", bad, idempotency_key=f"{k}:undo", attempt=1, undoes_key=k)
    assert undo.status_code == 200 and undo.json()["status"] == "nothing_to_release"


def test_an_undoes_header_on_a_forward_operation_is_a_400_naming_it(admin: OrdersAdmin) -> None:
    answer = admin.call("inventory/reserve", ORDER, idempotency_key=key(), attempt=1, undoes_key="other")
    assert answer.status_code == 400
    assert answer.json()["header"] == "X-Undoes-Key"


def test_a_tombstone_survives_a_crash_of_the_service(tmp_path: Path) -> None:
    state_file = tmp_path / "orders-state.json"
    k = key()
    with ServiceProcess(state_file=state_file) as proc, proc.admin() as client:
        assert client.call("inventory/release", ORDER, idempotency_key=f"{k}:undo", attempt=1,
                           undoes_key=k).status_code == 200
        proc.restart(hard=True)
        assert client.call("inventory/reserve", ORDER, idempotency_key=k, attempt=1).status_code == 410
        assert client.applied_for("inventory/reserve", k) == 0


# ---- helpers --------------------------------------------------------------------------------------


def _wait_until(condition: Any, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.02)
