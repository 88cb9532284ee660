"""Agents that call an HTTP service, and how they read its answers.

Timeouts, connection errors, 408, 429 and 5xx are transient; a 409 means a newer attempt already
reached the service (fencing), a 410 that the step was already undone (its key is tombstoned), and every
other 4xx is a permanent refusal. ``Retry-After`` (seconds or an
HTTP date) is passed on. The classification itself lives in :mod:`agents.faults`.

A request that dies on a reused keep-alive connection before any answer (``RemoteProtocolError``: the
service closed the idle connection as we sent on it) is sent again once, at once, on a fresh connection:
it is the pool's mishap, not the service's failure, and the idempotency key makes it safe.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx
from prometheus_client import Counter

from agents.call import AgentHandler, Call
from agents.faults import TransientError, classify_response
from eventstore.tracing import current_headers

KEEPALIVE_RESENDS = Counter("stepstream_agent_keepalive_resends_total",
                            "Requests sent again at once because a reused keep-alive connection died before any answer")


def request_body(step_input: dict[str, Any]) -> dict[str, Any]:
    """The task's input with the outputs of the steps done so far (a later step may need an earlier id)."""
    body: dict[str, Any] = {}
    for output in (step_input.get("steps") or {}).values():
        if isinstance(output, dict):
            body.update(output)
    body.update(step_input.get("task") or {})
    return body


def request_headers(call: Call) -> dict[str, str]:
    """The idempotency key and fencing token of every call; an undo also names the forward key it fences.
    The call's span rides along (``traceparent``) so the service's span joins the task's trace."""
    headers = {"Idempotency-Key": call.idempotency_key, "X-Attempt": str(call.attempt), **current_headers()}
    request = call.request
    if request.undoes_key is not None:
        headers["X-Undoes-Key"] = request.undoes_key
        if request.undoes_attempt is not None:
            headers["X-Undoes-Attempt"] = str(request.undoes_attempt)
    return headers


def pooled_client(connections: int) -> httpx.Client:
    """A client for many calls at once from many threads (httpx.Client is thread-safe).

    It keeps up to ``connections`` keep-alive connections, one per call in flight, so concurrent calls
    neither queue for a connection nor pay a TCP handshake each.
    """
    return httpx.Client(limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections))


def http_handler(base_url: str, path: str, client: httpx.Client | None = None, *, method: str = "POST",
                 headers: Mapping[str, str] | None = None, max_timeout_s: float | None = None) -> AgentHandler:
    """A handler that sends the step's data to ``base_url/path`` (``method``, POST by default) with the
    idempotency key and attempt, plus ``headers`` of its own; each call's timeout is the time the attempt
    has left, capped at ``max_timeout_s``."""
    http = client or httpx.Client()
    url = f"{base_url.rstrip('/')}/{path.lstrip('/')}"
    fixed = dict(headers or {})

    def send(request: Call, timeout: float) -> httpx.Response:
        return http.request(method, url, json=request_body(request.request.input),
                            headers={**fixed, **request_headers(request)}, timeout=timeout)

    def call(request: Call) -> dict[str, Any]:
        timeout = request.timeout_s if max_timeout_s is None else min(request.timeout_s, max_timeout_s)
        try:
            try:
                response = send(request, timeout)
            except httpx.RemoteProtocolError:
                # The service closed a pooled keep-alive connection as we reused it: the request died before
                # any answer. The pool has dropped that connection, so this goes out on a fresh one; the
                # idempotency key makes a second send safe, and it is not a failure of the service.
                KEEPALIVE_RESENDS.inc()
                response = send(request, timeout)
        except httpx.TimeoutException as exc:
            raise TransientError(f"{path}: timed out after {timeout:.1f}s", kind="timeout") from exc
        except httpx.TransportError as exc:
            raise TransientError(f"{path}: {type(exc).__name__}: {exc}", kind="connection") from exc
        fault = classify_response(response, what=path)
        if fault is not None:
            raise fault
        try:
            body = response.json()
        except ValueError as exc:
            # The effect may have landed; a retry with the same idempotency key replays the stored result.
            raise TransientError(f"{path}: unreadable answer ({response.status_code})", kind="server_error") from exc
        return body if isinstance(body, dict) else {"result": body}

    return call
