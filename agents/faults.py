"""What went wrong with a call to a remote service, and whether another call could help.

Every failure an agent sees ends up as one of two exceptions, because the rest of the agent (retry
policy, retry budget, circuit breaker, the scheduler's answer) only needs that one bit plus a little
detail:

- :class:`TransientError`: worth another call later -- timeouts, connection errors, 429 and 5xx (and
  408). It carries a *kind* (for logs, metrics and the breaker: throttling -- a 429, or any of these
  carrying ``Retry-After`` -- is not a dead server) and optionally the delay the service or the handler
  suggests (``Retry-After``), which takes precedence over back-off.
- :class:`PermanentError`: the service said no for good -- other 4xx, validation errors. Retrying
  would only repeat the refusal and spend the step's budget, so the step fails at once.

A handler may raise either itself (it knows best, e.g. a body saying ``"retryable": false``); anything
else it raises is mapped by :func:`classify` from the exception type. An exception we cannot place is
treated as permanent: it is almost always a bug in the handler, and retrying a bug burns the step's
call budget and delays the operator alert without any chance of success.
"""

from __future__ import annotations

from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Literal

import httpx
import pydantic

from eventstore.masking import masked

#: Why a call failed transiently. ``circuit_open`` and ``retry_budget`` are the agent refusing to call.
TransientKind = Literal["throttled", "timeout", "connection", "server_error", "circuit_open", "retry_budget"]
#: Why a call failed for good.
PermanentKind = Literal["rejected", "validation", "already_undone", "unexpected"]


class PermanentError(Exception):
    """The service said no for good (validation, 4xx): retrying cannot help."""

    retryable = False

    def __init__(self, message: str, *, kind: PermanentKind = "rejected", status: int | None = None) -> None:
        super().__init__(message)
        self.kind: PermanentKind = kind
        self.status = status


class TransientError(Exception):
    """Worth another call later (timeout, connection, 429, 5xx).

    ``retry_after_s`` is the delay the service (``Retry-After``) or the handler suggests before the next
    call; when set it replaces the policy's computed back-off, because the service knows its own load.
    """

    retryable = True

    def __init__(self, message: str, *, retry_after_s: float | None = None, kind: TransientKind = "server_error",
                 status: int | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = None if retry_after_s is None else max(0.0, retry_after_s)
        self.kind: TransientKind = kind
        self.status = status


class CircuitOpenError(TransientError):
    """The dependency's circuit breaker is open: no call was made (fail fast)."""

    def __init__(self, dependency: str, retry_in_s: float) -> None:
        super().__init__(f"circuit breaker for {dependency!r} is open; next probe in {retry_in_s:.2f}s",
                         retry_after_s=retry_in_s, kind="circuit_open")
        self.dependency = dependency


class RetryBudgetExhausted(TransientError):
    """The dependency's retry budget is spent: the retry was not made (fail fast)."""

    def __init__(self, dependency: str) -> None:
        super().__init__(f"retry budget for {dependency!r} is spent", kind="retry_budget")
        self.dependency = dependency


Fault = TransientError | PermanentError


def parse_retry_after(value: str | None, now: datetime | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header: delta-seconds or an HTTP date (RFC 9110 10.2.3).

    A header we cannot read is ignored rather than failing the call: the policy's back-off still applies.
    """
    if value is None or not value.strip():
        return None
    text = value.strip()
    try:
        return max(0.0, float(text))
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(text)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - (now or datetime.now(UTC))).total_seconds())


def classify_status(status: int, *, retry_after_s: float | None = None, detail: str = "") -> Fault | None:
    """The fault an HTTP status means, or None for success (< 400).

    408, 429 and 5xx are transient (a throttle when it is a 429 or carries ``Retry-After``); 409 (a newer
    attempt already reached the service: this attempt is fenced off), 410 (the step was already undone: its
    key is tombstoned) and every other 4xx are permanent. ``Retry-After`` is kept on transient answers only.
    """
    suffix = f": {detail}" if detail else ""
    if status < 400:
        return None
    if status == 429 or (retry_after_s is not None and (status == 408 or status >= 500)):
        # A Retry-After is the service's own recovery timeline: it is pacing us, not down (agents.pace).
        return TransientError(f"throttled ({status}){suffix}", retry_after_s=retry_after_s, kind="throttled",
                              status=status)
    if status == 408:
        return TransientError(f"request timeout (408){suffix}", retry_after_s=retry_after_s, kind="timeout",
                              status=status)
    if status >= 500:
        return TransientError(f"server error {status}{suffix}", retry_after_s=retry_after_s, kind="server_error",
                              status=status)
    # 410: the step's key was undone (tombstoned): a forward call after its undo applies nothing.
    kind: PermanentKind = "validation" if status in (400, 422) else "already_undone" if status == 410 else "rejected"
    return PermanentError(f"refused with {status}{suffix}", kind=kind, status=status)


def classify_response(response: httpx.Response, *, what: str = "") -> Fault | None:
    """:func:`classify_status` for an httpx response, reading its ``Retry-After`` and a bit of its body.

    The body is masked before it is cut (:mod:`eventstore.masking`): a value the step opened that straddles
    the cut would otherwise leave a piece of itself that no longer matches the value."""
    prefix = f"{what}: " if what else ""
    fault = classify_status(response.status_code, retry_after_s=parse_retry_after(response.headers.get("Retry-After")),
                            detail=masked(response.text)[:300])
    if fault is not None:
        fault.args = (prefix + str(fault),)
    return fault


def classify(exc: BaseException) -> Fault:
    """Map any exception a handler raised to a transient or permanent fault (see the module docstring)."""
    if isinstance(exc, TransientError | PermanentError):
        return exc
    fault: Fault
    if isinstance(exc, httpx.HTTPStatusError):
        fault = classify_response(exc.response) or PermanentError(str(exc), kind="unexpected")
    elif isinstance(exc, httpx.TimeoutException | TimeoutError):
        fault = TransientError(f"timed out: {type(exc).__name__}: {exc}", kind="timeout")
    elif isinstance(exc, httpx.TransportError | ConnectionError):
        fault = TransientError(f"{type(exc).__name__}: {exc}", kind="connection")
    elif isinstance(exc, pydantic.ValidationError):
        fault = PermanentError(f"invalid data: ValidationError: {_without_inputs(exc)}", kind="validation")
    elif isinstance(exc, ValueError | TypeError | KeyError):
        fault = PermanentError(f"invalid data: {type(exc).__name__}: {exc}", kind="validation")
    elif isinstance(exc, OSError):
        fault = TransientError(f"{type(exc).__name__}: {exc}", kind="connection")
    else:
        fault = PermanentError(f"unexpected {type(exc).__name__}: {exc}", kind="unexpected")
    fault.__cause__ = exc
    return fault


def _without_inputs(exc: pydantic.ValidationError) -> str:
    """What was wrong, field by field, without the values: pydantic's own text quotes each input, cut in the
    middle when long, so a sealed value would leave its ends there where no mask recognises it."""
    return "; ".join(f"{'.'.join(map(str, error['loc'])) or exc.title}: {error['msg']}"
                     for error in exc.errors(include_url=False, include_input=False))
