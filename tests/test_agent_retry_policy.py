"""The delay maths of agent retries, and how failures are classified as transient or permanent."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import httpx
import pydantic
import pytest
from hypothesis import given
from hypothesis import strategies as st

from agents.faults import PermanentError, TransientError, classify, classify_status, parse_retry_after
from agents.retry import RetryPolicy

policies = st.builds(
    RetryPolicy,
    strategy=st.sampled_from(["exponential", "incremental", "regular"]),
    initial_backoff_s=st.floats(0.001, 2.0),
    multiplier=st.floats(1.0, 10.0),
    increment_s=st.floats(0.0, 2.0),
    max_backoff_s=st.floats(2.0, 60.0),
    jitter=st.floats(0.0, 1.0),
    immediate_first_retry=st.booleans(),
)
retries = st.integers(1, 2000)


# ---- the schedules ----------------------------------------------------------------------------------


def test_exponential_doubles_from_the_initial_delay_up_to_the_cap() -> None:
    policy = RetryPolicy(initial_backoff_s=0.1, multiplier=2, max_backoff_s=1.0)
    assert [policy.base_delay(n) for n in range(1, 7)] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])


def test_incremental_grows_by_the_increment_up_to_the_cap() -> None:
    policy = RetryPolicy(strategy="incremental", initial_backoff_s=0.5, increment_s=0.25, max_backoff_s=1.2)
    assert [policy.base_delay(n) for n in range(1, 6)] == pytest.approx([0.5, 0.75, 1.0, 1.2, 1.2])


def test_regular_waits_the_same_every_time() -> None:
    policy = RetryPolicy(strategy="regular", initial_backoff_s=0.3)
    assert {policy.base_delay(n) for n in range(1, 20)} == {0.3}


def test_only_the_first_retry_may_be_immediate_and_the_schedule_then_starts_over() -> None:
    policy = RetryPolicy(initial_backoff_s=0.1, immediate_first_retry=True, jitter=0.5)
    rng = random.Random(1)
    assert policy.delay(1, rng) == 0.0
    assert [policy.base_delay(n) for n in (2, 3, 4)] == pytest.approx([0.1, 0.2, 0.4])
    assert all(policy.delay(n, rng) > 0 for n in range(2, 50))


def test_jitter_spreads_delays_within_the_documented_band() -> None:
    policy = RetryPolicy(initial_backoff_s=1.0, max_backoff_s=8.0, jitter=0.5)
    rng = random.Random(7)
    draws = [policy.delay(3, rng) for _ in range(200)]
    assert all(2.0 <= d <= 4.0 for d in draws)
    assert len(set(draws)) > 150, "jittered delays differ between requests"


def test_no_jitter_means_the_exact_schedule() -> None:
    policy = RetryPolicy(initial_backoff_s=0.2, jitter=0.0)
    assert policy.delay(2, random.Random()) == pytest.approx(0.4)


def test_retry_after_replaces_the_computed_delay_whether_longer_or_shorter() -> None:
    policy = RetryPolicy(initial_backoff_s=1.0, max_backoff_s=2.0, retry_after_jitter=0.0)
    rng = random.Random(0)
    assert policy.delay(1, rng, retry_after_s=30.0) == 30.0, "longer than the cap: still honoured"
    assert policy.delay(5, rng, retry_after_s=0.01) == 0.01
    assert policy.delay(1, rng, retry_after_s=-3) == 0.0


def test_calls_throttled_together_with_one_retry_after_come_back_spread_over_a_fifth_of_it() -> None:
    policy = RetryPolicy()
    rng = random.Random(7)
    waits = [policy.delay(1, rng, retry_after_s=2.0) for _ in range(32)]
    assert all(2.0 <= w <= 2.4 for w in waits), "never earlier than asked, at most 20 % later"
    assert len(set(waits)) == 32 and max(waits) - min(waits) > 0.2, "spread, not one herd"


def test_a_cap_below_the_initial_delay_is_refused_naming_both_fields() -> None:
    with pytest.raises(pydantic.ValidationError, match=r"max_backoff_s.*initial_backoff_s"):
        RetryPolicy(initial_backoff_s=2.0, max_backoff_s=1.0)


@given(policies, retries, st.integers(0, 2**32))
def test_every_delay_lies_between_the_jitter_floor_and_the_cap(policy: RetryPolicy, retry: int, seed: int) -> None:
    base = policy.base_delay(retry)
    delay = policy.delay(retry, random.Random(seed))
    assert 0.0 <= delay <= base <= policy.max_backoff_s
    assert delay >= base * (1 - policy.jitter) - 1e-12


@given(policies, retries)
def test_the_schedule_never_shrinks(policy: RetryPolicy, retry: int) -> None:
    assert policy.base_delay(retry + 1) >= policy.base_delay(retry)


@given(policies, retries)
def test_at_most_one_retry_is_immediate(policy: RetryPolicy, retry: int) -> None:
    if retry >= 2:
        assert policy.base_delay(retry) > 0


@given(policies, retries, st.floats(0.0, 3600.0), st.integers(0, 2**32))
def test_retry_after_always_takes_precedence(policy: RetryPolicy, retry: int, after: float, seed: int) -> None:
    delay = policy.delay(retry, random.Random(seed), retry_after_s=after)
    assert after <= delay <= after * (1 + policy.retry_after_jitter)


@given(st.floats(0.001, 1.0), st.floats(1.0, 60.0), retries, st.integers(0, 2**32))
def test_exponential_with_equal_jitter_keeps_growing_until_the_cap(initial: float, cap: float, retry: int,
                                                                     seed: int) -> None:
    """With multiplier 2 and jitter 0.5, retry n+1's floor is retry n's ceiling: delays never go down."""
    policy = RetryPolicy(initial_backoff_s=initial, max_backoff_s=cap, multiplier=2.0, jitter=0.5)
    rng = random.Random(seed)
    if policy.base_delay(retry + 1) < cap:
        assert policy.delay(retry + 1, rng) >= policy.delay(retry, rng)


# ---- classification ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("status", "kind"), [(429, "throttled"), (408, "timeout"), (500, "server_error"),
                                              (502, "server_error"), (503, "server_error"), (504, "server_error")])
def test_throttling_timeouts_and_server_errors_are_transient(status: int, kind: str) -> None:
    fault = classify_status(status)
    assert isinstance(fault, TransientError)
    assert fault.kind == kind and fault.retry_after_s is None


@pytest.mark.parametrize("status", [429, 408, 500, 503])
def test_any_transient_answer_carrying_retry_after_is_a_throttle(status: int) -> None:
    fault = classify_status(status, retry_after_s=2.0)
    assert isinstance(fault, TransientError)
    assert fault.kind == "throttled" and fault.retry_after_s == 2.0


@pytest.mark.parametrize("status", [400, 401, 403, 404, 409, 410, 422])
def test_other_client_errors_are_permanent(status: int) -> None:
    assert isinstance(classify_status(status), PermanentError)


def test_success_statuses_are_no_fault() -> None:
    assert classify_status(200) is None and classify_status(304) is None


@pytest.mark.parametrize(("exc", "kind"), [
    (httpx.ReadTimeout("slow"), "timeout"),
    (TimeoutError(), "timeout"),
    (httpx.ConnectError("refused"), "connection"),
    (ConnectionResetError(), "connection"),
])
def test_timeouts_and_connection_errors_are_transient(exc: Exception, kind: str) -> None:
    fault = classify(exc)
    assert isinstance(fault, TransientError) and fault.kind == kind and fault.__cause__ is exc


def test_validation_errors_and_unknown_bugs_are_permanent() -> None:
    with pytest.raises(pydantic.ValidationError) as caught:
        RetryPolicy(max_retries=-1)
    assert isinstance(classify(caught.value), PermanentError)
    assert classify(ValueError("bad qty")).kind == "validation"
    unexpected = classify(ZeroDivisionError())
    assert isinstance(unexpected, PermanentError) and unexpected.kind == "unexpected"


def test_an_http_status_error_is_classified_by_its_response() -> None:
    request = httpx.Request("POST", "http://svc/x")
    response = httpx.Response(429, headers={"Retry-After": "3"}, request=request)
    fault = classify(httpx.HTTPStatusError("429", request=request, response=response))
    assert isinstance(fault, TransientError) and fault.kind == "throttled" and fault.retry_after_s == 3.0


def test_errors_a_handler_raises_explicitly_pass_through_with_its_suggested_delay() -> None:
    mine = TransientError("busy, come back later", retry_after_s=0.7, kind="throttled")
    assert classify(mine) is mine
    refused = PermanentError("no such customer")
    assert classify(refused) is refused


def test_retry_after_is_read_as_seconds_or_as_an_http_date() -> None:
    now = datetime(2025, 1, 1, 12, 0, 0, tzinfo=UTC)
    assert parse_retry_after("5") == 5.0
    assert parse_retry_after("1.5") == 1.5
    assert parse_retry_after(format_datetime(now + timedelta(seconds=30), usegmt=True), now) == pytest.approx(30)
    assert parse_retry_after(format_datetime(now - timedelta(seconds=30), usegmt=True), now) == 0.0
    assert parse_retry_after("soon") is None
    assert parse_retry_after(None) is None
