"""The order-processing backend that stepstream's agents call over HTTP in the demo and the tests.

It is a *real* remote service (a uvicorn process, real sockets), not a mock: agents exercise their
timeouts, retries, Retry-After handling, idempotency keys and fencing tokens against it, and tests
assert on what it actually did. Three resources, each with a forward action and its compensation:

=====================  ======================  ======================================
forward                compensation            effect
=====================  ======================  ======================================
``inventory/reserve``  ``inventory/release``   reservation ``reserved`` -> ``released``
``payments/charge``    ``payments/refund``     charge ``captured`` -> ``refunded``
``shipping/create``    ``shipping/cancel``     shipment ``created`` -> ``cancelled``
=====================  ======================  ======================================

Request contract (every operation, ``POST /<operation>`` with a JSON object body):

- ``Idempotency-Key`` header, stable across every attempt of a step; ``X-Attempt`` header, the
  attempt number, a non-negative integer used as a fencing token. Missing or invalid -> 400 naming
  the header.
- The body must carry ``order_id``; ``qty`` (if present) must be a positive integer, ``amount`` (if
  present) a non-negative number, ``card_token`` (if present) a non-empty string, which a charge keeps
  with its record and says back in its answer (the card it charged, as payment APIs echo the payment
  method). Violations are permanent errors: 422. A card on the service's block list (a token holding
  ``blocked``) is refused with 422 ``card_blocked`` naming the token, as payment rails do: what a
  service says back is no place for a sealed value to leave the agent in clear.
- A key already applied for that operation returns the stored result (200, header
  ``Idempotent-Replayed: true``) and applies nothing. The same key with a *different* body is a
  client bug and answers 422 ``idempotency_key_reused`` (as Stripe does), never a silent replay.
- Fencing: the highest ``X-Attempt`` seen per (operation, key) is recorded on receipt; a lower
  attempt gets 409 ``stale_attempt``, both on receipt and again just before the side effect (so a
  slow old attempt cannot act after a newer one arrived while it was delayed).
- Compensations undo whatever the forward action left for that order (or the resource named by
  ``reservation_id`` / ``charge_id`` / ``shipment_id``); with nothing to undo they succeed with an
  empty list, because a compensation must be safe to run whether or not the forward step landed.
- Undo fences the forward key: a compensation may name the forward step's key in ``X-Undoes-Key``
  (and its highest attempt in ``X-Undoes-Attempt``). On receipt the service records a *tombstone*
  for that key; from then on every forward call with it is refused with 410 ``already_undone`` and
  applies nothing (even a replay of a result stored before the undo). Both the tombstone and the
  forward side effect are decided under the one lock, so a forward call either landed before the undo
  (and the undo releases it) or is refused: an attempt still in flight when its step was undone can
  never leave anything held.

Faults (``PUT /admin/faults``) are decided on receipt, before any side effect: a failed request
applies nothing. Randomness comes from one ``random.Random(seed)`` that draws a fixed number of
values per faulted request, so a test that replays the same request sequence sees the same faults.
A per-operation fault configuration *replaces* the global one for that operation.
Latency deliberately does not watch for disconnects: if the client gives up during the delay the
effect still lands, which is the "unknown outcome" case agents must survive by retrying with the
same key. ``hang`` is the opposite: it holds the request until the client disconnects (or
``hang_max_s``) and applies nothing.

Run: ``python -m demo.orders_service --host 127.0.0.1 --port 8080 [--seed 0] [--state-file PATH]``.
With ``--state-file`` every applied effect, idempotency result, tombstone and fencing high-water mark is
journaled (``demo.orders_journal``: a line of what changed, fsync'd as a group commit) before the response
is sent, so a restarted service keeps deduplicating; the state file is the snapshot the journal folds into.
Request/outcome counters ride along in the journal lines of their key and at shutdown (a SIGKILL may lose
the last few counts, never an effect).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import logging
import os
import random
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Literal, get_args

import orjson
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from demo.orders_journal import Changes, Journal, delta
from eventstore.tracing import configure_tracing

log = logging.getLogger("stepstream.orders_service")

Operation = Literal[
    "inventory/reserve",
    "inventory/release",
    "payments/charge",
    "payments/refund",
    "shipping/create",
    "shipping/cancel",
]
OPERATIONS: tuple[Operation, ...] = get_args(Operation)

#: forward operation -> its compensating operation.
COMPENSATIONS: dict[Operation, Operation] = {
    "inventory/reserve": "inventory/release",
    "payments/charge": "payments/refund",
    "shipping/create": "shipping/cancel",
}
#: compensating operation -> the forward operation whose keys it tombstones.
FORWARD_OF: dict[Operation, Operation] = {undo: forward for forward, undo in COMPENSATIONS.items()}

IDEMPOTENCY_HEADER = "Idempotency-Key"
ATTEMPT_HEADER = "X-Attempt"
UNDOES_HEADER = "X-Undoes-Key"
UNDOES_ATTEMPT_HEADER = "X-Undoes-Attempt"
REPLAYED_HEADER = "Idempotent-Replayed"
MAX_KEY_LENGTH = 255
STATE_FILE_VERSION = 1
#: Status logged for a hung request whose client went away (nginx's convention); nobody reads the body.
CLIENT_GONE = 499

JSON = dict[str, Any]


class FaultConfig(BaseModel):
    """One fault configuration, global (``operation`` null) or for one operation.

    Strict (``extra="forbid"``) so a typo such as ``error_rat`` is a 422 naming the field rather
    than a silently fault-free run that makes a resilience test pass for the wrong reason.
    """

    model_config = ConfigDict(extra="forbid")

    operation: Operation | None = None
    latency_ms: int = Field(default=0, ge=0, le=600_000)
    #: Each request's latency is drawn uniformly from [latency_ms, latency_ms + latency_jitter_ms]: a spread
    #: straddling a caller's timeout makes some calls land after the caller gave up (an unknown outcome).
    latency_jitter_ms: int = Field(default=0, ge=0, le=600_000)
    error_rate: float = Field(default=0.0, ge=0.0, le=1.0)
    throttle_rate: float = Field(default=0.0, ge=0.0, le=1.0)
    retry_after_s: int = Field(default=1, ge=0, le=3600)
    permanent_error_rate: float = Field(default=0.0, ge=0.0, le=1.0)
    hang: bool = False
    hang_max_s: float = Field(default=300.0, gt=0.0, le=3600.0)
    fail_next: int = Field(default=0, ge=0)
    #: The first ``throttle_first`` requests of each idempotency key are refused with ``throttle_status`` and
    #: ``Retry-After: retry_after_s`` (as payment rails pace a new payout), the next ones served.
    throttle_first: int = Field(default=0, ge=0)
    throttle_status: Literal[429, 503] = 429


class ResetRequest(BaseModel):
    """Optional body of ``POST /admin/reset``: a new seed for the fault RNG."""

    model_config = ConfigDict(extra="forbid")

    seed: int | None = None


@dataclass
class FaultSlot:
    """A stored configuration plus the remaining ``fail_next`` budget, which requests consume."""

    config: FaultConfig
    fail_remaining: int

    def view(self) -> JSON:
        data = self.config.model_dump()
        data["fail_next"] = self.fail_remaining
        return data


@dataclass(frozen=True)
class Failure:
    """An injected failure: the response to send instead of doing the work."""

    status: int
    body: JSON
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class FaultDecision:
    """Everything decided on receipt for one request, executed afterwards (sleeping, hanging)."""

    hang_max_s: float | None = None
    latency_s: float = 0.0
    failure: Failure | None = None


class ProblemError(Exception):
    """A request the service refuses; carries the HTTP status and JSON body to answer with."""

    def __init__(self, status: int, error: str, detail: str, **extra: Any) -> None:
        super().__init__(detail)
        self.status = status
        self.body: JSON = {"error": error, "detail": detail, **extra}


def _now() -> float:
    return time.time()


def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


def _body_hash(body: JSON) -> str:
    return hashlib.sha256(orjson.dumps(body, option=orjson.OPT_SORT_KEYS)).hexdigest()


def _json_response(status: int, body: Any, headers: Mapping[str, str] | None = None) -> Response:
    return Response(
        content=orjson.dumps(body), status_code=status, media_type="application/json", headers=dict(headers or {})
    )


def _bump(counter: dict[str, dict[str, int]], op: str, key: str) -> None:
    per_op = counter.setdefault(op, {})
    per_op[key] = per_op.get(key, 0) + 1


class OrdersState:
    """All durable state: counters, fencing marks, idempotency results, effects and resources.

    Plain dicts so the whole thing serialises to one JSON document for the state file.
    """

    def __init__(self) -> None:
        self.requests: dict[str, dict[str, int]] = {}
        # Per operation and key, each request's X-Attempt and arrival time, in the order they arrived.
        self.arrivals: dict[str, dict[str, list[JSON]]] = {}
        self.applied: dict[str, dict[str, int]] = {}
        self.outcomes: dict[str, dict[str, dict[str, int]]] = {}
        self.highest_attempt: dict[str, dict[str, int]] = {}
        self.results: dict[str, dict[str, JSON]] = {}
        self.effects: list[JSON] = []
        self.reservations: dict[str, JSON] = {}
        self.charges: dict[str, JSON] = {}
        self.shipments: dict[str, JSON] = {}
        #: forward operation -> undone idempotency key -> who undid it: later forward calls are refused.
        self.tombstones: dict[str, dict[str, JSON]] = {}
        #: What changed since the last journal line (``demo.orders_journal``), and the first effect not in one.
        self.changes = Changes()
        self.effects_journaled = 0

    def to_json(self) -> JSON:
        return {
            "version": STATE_FILE_VERSION,
            "requests": self.requests,
            "arrivals": self.arrivals,
            "applied": self.applied,
            "outcomes": self.outcomes,
            "highest_attempt": self.highest_attempt,
            "results": self.results,
            "effects": self.effects,
            "reservations": self.reservations,
            "charges": self.charges,
            "shipments": self.shipments,
            "tombstones": self.tombstones,
        }

    @classmethod
    def from_json(cls, data: JSON) -> OrdersState:
        if data.get("version") != STATE_FILE_VERSION:
            raise ValueError(f"unsupported state file version {data.get('version')!r}")
        state = cls()
        state.requests = data["requests"]
        state.arrivals = data.get("arrivals", {})  # absent from files written before it was recorded
        state.applied = data["applied"]
        state.outcomes = data["outcomes"]
        state.highest_attempt = data["highest_attempt"]
        state.results = data["results"]
        state.effects = data["effects"]
        state.reservations = data["reservations"]
        state.charges = data["charges"]
        state.shipments = data["shipments"]
        state.tombstones = data.get("tombstones", {})  # absent from files written before undo fencing
        state.effects_journaled = len(state.effects)
        return state

    def record_outcome(self, op: str, key: str, outcome: str) -> None:
        per_key = self.outcomes.setdefault(op, {}).setdefault(key, {})
        per_key[outcome] = per_key.get(outcome, 0) + 1
        self.changes.keyed.add((op, key))


# --------------------------------------------------------------------------------------------------
# Business validation and side effects (pure functions of state + request)
# --------------------------------------------------------------------------------------------------


def _order_id(body: JSON) -> str:
    value = body.get("order_id")
    if isinstance(value, bool) or not isinstance(value, str | int) or value == "":
        detail = "order_id is required (non-empty string or integer)"
        raise ProblemError(422, "validation_error", detail, field="order_id")
    return str(value)


def validate_body(body: JSON) -> str:
    """Check the fields the service relies on; return the order id. Raises 422 (permanent) on bad data."""
    order_id = _order_id(body)
    if "qty" in body:
        qty = body["qty"]
        if isinstance(qty, bool) or not isinstance(qty, int) or qty <= 0:
            raise ProblemError(422, "validation_error", "qty must be a positive integer", field="qty")
    if "amount" in body:
        amount = body["amount"]
        if isinstance(amount, bool) or not isinstance(amount, int | float) or amount < 0:
            raise ProblemError(422, "validation_error", "amount must be a non-negative number", field="amount")
    if "card_token" in body and (not isinstance(body["card_token"], str) or not body["card_token"]):
        # A sealed envelope arriving here means an agent failed to open it: refused, never charged, and the
        # answer does not repeat the value.
        raise ProblemError(422, "validation_error", "card_token must be a non-empty string", field="card_token")
    if "blocked" in body.get("card_token", ""):
        raise ProblemError(422, "card_blocked", f"card {body['card_token']} is blocked", field="card_token")
    return order_id


def _undo(
    resources: dict[str, JSON],
    body: JSON,
    order_id: str,
    id_field: str,
    live_status: str,
    undone_status: str,
    key: str,
) -> list[str]:
    """Move the live resources of this order (or the one named by ``id_field``) to ``undone_status``."""
    named = body.get(id_field)
    if named is not None:
        resource = resources.get(str(named))
        if resource is None:
            return []
        if resource["order_id"] != order_id:
            raise ProblemError(422, "validation_error", f"{id_field} {named} belongs to another order", field=id_field)
        candidates = [resource]
    else:
        candidates = [r for r in resources.values() if r["order_id"] == order_id]
    undone: list[str] = []
    for resource in candidates:
        if resource["status"] == live_status:
            resource["status"] = undone_status
            resource[f"{undone_status}_by"] = key
            resource[f"{undone_status}_at"] = _now()
            undone.append(resource[id_field])
    return undone


def apply_operation(state: OrdersState, op: Operation, body: JSON, order_id: str, key: str) -> JSON:
    """Perform the side effect of ``op`` on ``state`` and return the result to store and answer; the
    resources it created or undid are marked changed (journaled with the response)."""
    result = _apply(state, op, body, order_id, key)
    table, id_field, undone_field = RESOURCES_OF[op]
    touched = result.get(undone_field, []) if undone_field else [result[id_field]]
    state.changes.resources.update((table, rid) for rid in touched)
    return result


#: operation -> (its resource table, the id field of a created resource, the result's list of undone ids)
RESOURCES_OF: dict[Operation, tuple[str, str, str | None]] = {
    "inventory/reserve": ("reservations", "reservation_id", None),
    "inventory/release": ("reservations", "reservation_id", "released"),
    "payments/charge": ("charges", "charge_id", None),
    "payments/refund": ("charges", "charge_id", "refunded"),
    "shipping/create": ("shipments", "shipment_id", None),
    "shipping/cancel": ("shipments", "shipment_id", "cancelled"),
}


def _apply(state: OrdersState, op: Operation, body: JSON, order_id: str, key: str) -> JSON:
    if op == "inventory/reserve":
        reservation_id = _new_id("res")
        state.reservations[reservation_id] = {
            "reservation_id": reservation_id,
            "order_id": order_id,
            "sku": body.get("sku"),
            "qty": body.get("qty", 1),
            "status": "reserved",
            "reserved_by": key,
            "reserved_at": _now(),
        }
        return {"reservation_id": reservation_id, "order_id": order_id, "status": "reserved"}
    if op == "inventory/release":
        released = _undo(state.reservations, body, order_id, "reservation_id", "reserved", "released", key)
        return {"order_id": order_id, "released": released, "status": "released" if released else "nothing_to_release"}
    if op == "payments/charge":
        charge_id = _new_id("ch")
        state.charges[charge_id] = {
            "charge_id": charge_id,
            "order_id": order_id,
            "amount": body.get("amount", 0),
            "currency": body.get("currency", "EUR"),
            "card_token": body.get("card_token"),
            "status": "captured",
            "captured_by": key,
            "captured_at": _now(),
        }
        echoed = {"card_token": body["card_token"]} if "card_token" in body else {}
        return {"charge_id": charge_id, "order_id": order_id, "status": "captured", **echoed}
    if op == "payments/refund":
        refunded = _undo(state.charges, body, order_id, "charge_id", "captured", "refunded", key)
        amount = sum(state.charges[c]["amount"] for c in refunded)
        return {
            "order_id": order_id,
            "refund_id": _new_id("re") if refunded else None,
            "refunded": refunded,
            "amount": amount,
            "status": "refunded" if refunded else "nothing_to_refund",
        }
    if op == "shipping/create":
        shipment_id = _new_id("shp")
        state.shipments[shipment_id] = {
            "shipment_id": shipment_id,
            "order_id": order_id,
            "address": body.get("address"),
            "status": "created",
            "created_by": key,
            "created_at": _now(),
        }
        return {"shipment_id": shipment_id, "order_id": order_id, "status": "created"}
    if op == "shipping/cancel":
        cancelled = _undo(state.shipments, body, order_id, "shipment_id", "created", "cancelled", key)
        return {
            "order_id": order_id,
            "cancelled": cancelled,
            "status": "cancelled" if cancelled else "nothing_to_cancel",
        }
    raise AssertionError(f"unknown operation {op}")  # pragma: no cover - Operation is exhaustive


# --------------------------------------------------------------------------------------------------
# The service: request pipeline, faults, admin
# --------------------------------------------------------------------------------------------------


def _parse_headers(request: Request) -> tuple[str, int]:
    key = request.headers.get(IDEMPOTENCY_HEADER)
    if key is None or not key.strip():
        raise ProblemError(400, "missing_header", f"{IDEMPOTENCY_HEADER} header is required", header=IDEMPOTENCY_HEADER)
    if len(key) > MAX_KEY_LENGTH:
        raise ProblemError(
            400, "invalid_header", f"{IDEMPOTENCY_HEADER} longer than {MAX_KEY_LENGTH}", header=IDEMPOTENCY_HEADER
        )
    raw_attempt = request.headers.get(ATTEMPT_HEADER)
    if raw_attempt is None or not raw_attempt.strip():
        raise ProblemError(400, "missing_header", f"{ATTEMPT_HEADER} header is required", header=ATTEMPT_HEADER)
    try:
        attempt = int(raw_attempt.strip())
    except ValueError:
        attempt = -1
    if attempt < 0:
        raise ProblemError(
            400, "invalid_header", f"{ATTEMPT_HEADER} must be a non-negative integer", header=ATTEMPT_HEADER
        )
    return key, attempt


def _parse_undoes(request: Request, op: Operation) -> tuple[str, int | None] | None:
    """The forward key (and highest attempt) a compensating call undoes, if it names one."""
    key = request.headers.get(UNDOES_HEADER)
    if key is None:
        return None
    if op not in FORWARD_OF:
        raise ProblemError(400, "invalid_header", f"{UNDOES_HEADER} is for compensating operations only",
                           header=UNDOES_HEADER)
    if not key.strip() or len(key) > MAX_KEY_LENGTH:
        raise ProblemError(400, "invalid_header", f"{UNDOES_HEADER} must be a key of 1 to {MAX_KEY_LENGTH} "
                           "characters", header=UNDOES_HEADER)
    raw = request.headers.get(UNDOES_ATTEMPT_HEADER)
    if raw is None:
        return key, None
    try:
        attempt = int(raw.strip())
    except ValueError:
        attempt = -1
    if attempt < 1:
        raise ProblemError(400, "invalid_header", f"{UNDOES_ATTEMPT_HEADER} must be a positive integer",
                           header=UNDOES_ATTEMPT_HEADER)
    return key, attempt


class OrdersService:
    """Owns the state, the fault configuration and the seeded RNG; serves every request.

    One asyncio lock guards all of it. Critical sections never await, except the state-file write
    that must finish before a response confirms an effect, so hanging or slow requests (which sleep
    outside the lock) never block others.
    """

    def __init__(self, *, seed: int = 0, state_file: Path | None = None, hang_poll_s: float = 0.05) -> None:
        self.seed = seed
        self.state_file = state_file
        self.hang_poll_s = hang_poll_s
        self.rng = random.Random(seed)
        self.lock = asyncio.Lock()
        self.global_fault: FaultSlot | None = None
        self.op_faults: dict[Operation, FaultSlot] = {}
        self.in_flight = 0
        self.peak_in_flight = 0  # the most requests handled at once since start or reset
        self.shutting_down = False
        self.started_at = _now()
        self.journal = Journal(state_file) if state_file is not None else None
        self.state = self._load()

    # ---- persistence -------------------------------------------------------------------------

    def _load(self) -> OrdersState:
        if self.journal is None:
            return OrdersState()
        # A corrupt file fails start-up loudly: silently starting empty would break dedup.
        tables = self.journal.load()
        state = OrdersState() if tables is None else OrdersState.from_json(tables)
        self.journal.compact(state.to_json())  # the journal folded in: start from a snapshot alone
        return state

    def persist(self) -> None:
        """Journal what changed since the last write (if there is a state file). Called under the lock,
        before the response that confirms it is sent."""
        state = self.state
        if self.journal is not None and (state.changes or state.effects_journaled < len(state.effects)):
            self.journal.append(delta(state.to_json(), state.changes, state.effects_journaled))
            if self.journal.wants_compaction():
                self.journal.compact(state.to_json())
        state.changes = Changes()
        state.effects_journaled = len(state.effects)

    # ---- faults ------------------------------------------------------------------------------

    def _slot_for(self, op: Operation) -> FaultSlot | None:
        return self.op_faults.get(op, self.global_fault)

    def decide_faults(self, op: Operation, seen: int = 1) -> FaultDecision:
        """Decide, on receipt, what goes wrong with this request, the ``seen``-th of its key. Caller holds
        the lock."""
        slot = self._slot_for(op)
        if slot is None:
            return FaultDecision()
        cfg = slot.config
        latency_s = cfg.latency_ms / 1000.0
        if cfg.hang:
            return FaultDecision(hang_max_s=cfg.hang_max_s, latency_s=latency_s)
        if seen <= cfg.throttle_first:
            paced = Failure(cfg.throttle_status, {"error": "throttled", "detail": f"request {seen} of this key: "
                            "come back later", "retry_after_s": cfg.retry_after_s},
                            {"Retry-After": str(cfg.retry_after_s)})
            return FaultDecision(latency_s=latency_s, failure=paced)
        if slot.fail_remaining > 0:
            slot.fail_remaining -= 1
            injected = Failure(503, {"error": "unavailable", "detail": "injected failure (fail_next)"})
            return FaultDecision(latency_s=latency_s, failure=injected)
        # Always three draws, in a fixed order, so the sequence does not depend on which rates are set.
        permanent_draw, throttle_draw, error_draw = self.rng.random(), self.rng.random(), self.rng.random()
        failure: Failure | None = None
        if permanent_draw < cfg.permanent_error_rate:
            failure = Failure(422, {"error": "rejected", "detail": "injected permanent error"})
        elif throttle_draw < cfg.throttle_rate:
            failure = Failure(
                429,
                {"error": "throttled", "detail": "injected throttling", "retry_after_s": cfg.retry_after_s},
                {"Retry-After": str(cfg.retry_after_s)},
            )
        elif error_draw < cfg.error_rate:
            failure = Failure(503, {"error": "unavailable", "detail": "injected transient error"})
        if cfg.latency_jitter_ms:  # drawn last, and only when asked for, so seeded runs without it stay the same
            latency_s += self.rng.uniform(0, cfg.latency_jitter_ms) / 1000.0
        return FaultDecision(latency_s=latency_s, failure=failure)

    def set_faults(self, config: FaultConfig) -> JSON:
        slot = FaultSlot(config=config, fail_remaining=config.fail_next)
        if config.operation is None:
            self.global_fault = slot
        else:
            self.op_faults[config.operation] = slot
        return slot.view()

    def clear_faults(self, op: Operation | None) -> None:
        if op is None:
            self.global_fault = None
            self.op_faults.clear()
        else:
            self.op_faults.pop(op, None)

    def faults_view(self) -> JSON:
        return {
            "global": self.global_fault.view() if self.global_fault else None,
            "operations": {op: slot.view() for op, slot in self.op_faults.items()},
        }

    # ---- request pipeline --------------------------------------------------------------------

    def _check_fence(self, op: Operation, key: str, attempt: int) -> None:
        highest = self.state.highest_attempt.get(op, {}).get(key)
        if highest is not None and attempt < highest:
            raise ProblemError(
                409,
                "stale_attempt",
                f"attempt {attempt} is older than attempt {highest} already seen for this key",
                attempt=attempt,
                highest_attempt=highest,
            )

    def _check_tombstone(self, op: Operation, key: str) -> None:
        """A forward call whose key was undone applies nothing, whenever it arrives."""
        tombstone = self.state.tombstones.get(op, {}).get(key)
        if tombstone is not None:
            raise ProblemError(410, "already_undone", f"{op} with this key was undone by {tombstone['undo_key']}: "
                               "a forward call after its undo applies nothing", undone_at=tombstone["at"])

    def _bury(self, op: Operation, undo_key: str, undoes: tuple[str, int | None]) -> None:
        """Record that ``undo_key`` undoes the forward key ``undoes`` names (caller holds the lock)."""
        forward_key, forward_attempt = undoes
        graves = self.state.tombstones.setdefault(FORWARD_OF[op], {})
        if forward_key not in graves:
            graves[forward_key] = {"undo_key": undo_key, "highest_attempt": forward_attempt, "at": _now()}
            self.state.changes.tombstones.add((FORWARD_OF[op], forward_key))
            self.persist()

    async def handle(self, op: Operation, request: Request) -> Response:
        """Headers -> count -> body -> fence (and tombstone) -> faults -> (hang|latency) -> fence again ->
        tombstone -> dedup -> apply."""
        try:
            key, attempt = _parse_headers(request)
            undoes = _parse_undoes(request, op)
        except ProblemError as problem:
            return _json_response(problem.status, problem.body)
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            status, body, headers = await self._handle_keyed(op, key, attempt, undoes, request)
        except ProblemError as problem:
            status, body, headers = problem.status, problem.body, {}
        finally:
            self.in_flight -= 1
        async with self.lock:
            self.state.record_outcome(op, key, "disconnected" if status == CLIENT_GONE else str(status))
        if self.journal is not None:
            await self.journal.durable()  # whatever this answer rests on (its own lines, or others') is on disk
        return _json_response(status, body, headers)

    async def _handle_keyed(
        self, op: Operation, key: str, attempt: int, undoes: tuple[str, int | None] | None, request: Request
    ) -> tuple[int, Any, Mapping[str, str]]:
        async with self.lock:
            _bump(self.state.requests, op, key)
            self.state.arrivals.setdefault(op, {}).setdefault(key, []).append({"attempt": attempt, "at": _now()})
            self.state.changes.keyed.add((op, key))
        raw = await request.body()
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise ProblemError(422, "invalid_body", f"body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise ProblemError(422, "invalid_body", "body must be a JSON object")
        # An undo needs only the order (and the resource ids it names): it must succeed whether or not the
        # forward call ever landed, even when that call was refused for its quantity or amount.
        order_id = _order_id(body) if op in FORWARD_OF else validate_body(body)

        async with self.lock:
            self._check_fence(op, key, attempt)
            self._check_tombstone(op, key)
            if undoes is not None:
                self._bury(op, key, undoes)
            marks = self.state.highest_attempt.setdefault(op, {})
            if attempt > marks.get(key, -1):
                marks[key] = attempt
                self.state.changes.keyed.add((op, key))
                self.persist()
            decision = self.decide_faults(op, self.state.requests[op][key])

        if decision.hang_max_s is not None:
            outcome = await self._hang(request, decision.hang_max_s)
            if outcome == "disconnected":
                return CLIENT_GONE, {"error": "client_gone", "detail": "client disconnected during hang"}, {}
            if outcome == "shutdown":
                return 503, {"error": "shutting_down", "detail": "service stopping; hung request released"}, {}
            return 504, {"error": "hang_timeout", "detail": "injected hang ended without a result"}, {}
        if decision.latency_s > 0:
            await asyncio.sleep(decision.latency_s)
        if decision.failure is not None:
            return decision.failure.status, decision.failure.body, decision.failure.headers

        digest = _body_hash(body)
        async with self.lock:
            self._check_fence(op, key, attempt)
            self._check_tombstone(op, key)
            stored = self.state.results.get(op, {}).get(key)
            if stored is not None:
                if stored["body_hash"] != digest:
                    raise ProblemError(
                        422,
                        "idempotency_key_reused",
                        f"{IDEMPOTENCY_HEADER} {key!r} was already used for {op} with a different body",
                    )
                return 200, stored["result"], {REPLAYED_HEADER: "true"}
            result = apply_operation(self.state, op, body, order_id, key)
            at = _now()
            self.state.results.setdefault(op, {})[key] = {
                "result": result,
                "body_hash": digest,
                "attempt": attempt,
                "at": at,
            }
            _bump(self.state.applied, op, key)
            self.state.changes.keyed.add((op, key))
            self.state.effects.append(
                {
                    "seq": len(self.state.effects) + 1,
                    "operation": op,
                    "idempotency_key": key,
                    "attempt": attempt,
                    "order_id": order_id,
                    "request": body,
                    "result": result,
                    "at": at,
                }
            )
            self.persist()
        return 200, result, {REPLAYED_HEADER: "false"}

    async def _hang(self, request: Request, max_s: float) -> Literal["disconnected", "shutdown", "expired"]:
        """Hold the request open, applying nothing, until the client disconnects or ``max_s`` passes.

        Also ends at shutdown, so SIGTERM drains promptly instead of waiting for uvicorn to cancel it.
        """
        deadline = time.monotonic() + max_s
        while time.monotonic() < deadline and not self.shutting_down:
            if await request.is_disconnected():
                return "disconnected"
            await asyncio.sleep(self.hang_poll_s)
        return "shutdown" if self.shutting_down else "expired"

    # ---- admin -------------------------------------------------------------------------------

    def calls_view(self) -> JSON:
        return {
            "requests": self.state.requests,
            "applied": self.state.applied,
            "outcomes": self.state.outcomes,
            "in_flight": self.in_flight,
            "peak_in_flight": self.peak_in_flight,
        }

    def records_view(self, order_id: str | None) -> JSON:
        def keep(item: JSON) -> bool:
            return order_id is None or item.get("order_id") == order_id

        return {
            "effects": [e for e in self.state.effects if keep(e)],
            "reservations": {k: v for k, v in self.state.reservations.items() if keep(v)},
            "charges": {k: v for k, v in self.state.charges.items() if keep(v)},
            "shipments": {k: v for k, v in self.state.shipments.items() if keep(v)},
            "tombstones": self.state.tombstones,
        }

    def reset(self, seed: int | None) -> None:
        if seed is not None:
            self.seed = seed
        self.rng = random.Random(self.seed)
        self.state = OrdersState()
        self.clear_faults(None)
        self.peak_in_flight = self.in_flight
        if self.journal is not None:
            self.journal.compact(self.state.to_json())


def create_app(*, seed: int = 0, state_file: Path | None = None) -> FastAPI:
    """Build the FastAPI app around one ``OrdersService`` (state lives as long as the app)."""
    service = OrdersService(seed=seed, state_file=state_file)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        # Flush counters that were updated since the last effect write, and leave a snapshot alone.
        async with service.lock:
            service.persist()
            if service.journal is not None:
                service.journal.compact(service.state.to_json())
                service.journal.close()

    app = FastAPI(title="stepstream orders service", version="1", lifespan=lifespan)
    app.state.service = service

    def make_endpoint(op: Operation) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            return await service.handle(op, request)

        endpoint.__name__ = op.replace("/", "_")
        return endpoint

    for op in OPERATIONS:
        app.add_api_route(f"/{op}", make_endpoint(op), methods=["POST"], name=op, response_class=Response)

    @app.get("/health")
    async def health() -> JSON:
        return {"status": "ok", "pid": os.getpid(), "started_at": service.started_at, "seed": service.seed}

    @app.get("/admin/calls")
    async def admin_calls() -> Response:
        async with service.lock:
            return _json_response(200, service.calls_view())

    @app.get("/admin/arrivals")
    async def admin_arrivals() -> Response:
        """Per operation and idempotency key, each request's attempt and arrival time, in arrival order."""
        async with service.lock:
            return _json_response(200, service.state.arrivals)

    @app.get("/admin/records")
    async def admin_records(order_id: str | None = None) -> Response:
        async with service.lock:
            return _json_response(200, service.records_view(order_id))

    @app.get("/admin/faults")
    async def get_faults() -> JSON:
        async with service.lock:
            return service.faults_view()

    @app.put("/admin/faults")
    async def put_faults(config: FaultConfig) -> JSON:
        async with service.lock:
            service.set_faults(config)
            return service.faults_view()

    @app.delete("/admin/faults")
    async def delete_faults(operation: Operation | None = None) -> JSON:
        async with service.lock:
            service.clear_faults(operation)
            return service.faults_view()

    @app.post("/admin/reset")
    async def admin_reset(reset: ResetRequest | None = None) -> JSON:
        async with service.lock:
            service.reset(reset.seed if reset else None)
            return {"status": "reset", "seed": service.seed}

    return app


def main(argv: list[str] | None = None) -> None:
    """Entry point: ``python -m demo.orders_service --host 127.0.0.1 --port N [--state-file PATH]``."""
    parser = argparse.ArgumentParser(prog="python -m demo.orders_service", description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--seed", type=int, default=0, help="seed of the fault RNG (reproducible faults)")
    parser.add_argument("--state-file", type=Path, default=None, help="persist effects and dedup results here")
    parser.add_argument("--log-level", default="warning")
    parser.add_argument("--access-log", action="store_true")
    parser.add_argument(
        "--graceful-shutdown-s", type=float, default=2.0, help="on SIGTERM, wait this long for in-flight requests"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper())
    configure_tracing("orders-service")  # FastAPI continues each caller's traceparent in a server span
    app = create_app(seed=args.seed, state_file=args.state_file)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=args.access_log,
        timeout_graceful_shutdown=max(1, round(args.graceful_shutdown_s)),
        lifespan="on",
    )
    # uvicorn re-raises a captured SIGTERM/SIGINT after its graceful shutdown, which would end the
    # process with -15; the design wants exit 0 after a drain. This handler turns that re-raise (or a
    # signal that arrives before uvicorn installs its own) into a clean exit.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_cleanly)
    _Server(config, on_exit=lambda: setattr(app.state.service, "shutting_down", True)).run()


class _Server(uvicorn.Server):
    """uvicorn's server, telling the service when shutdown starts so hung requests end first."""

    def __init__(self, config: uvicorn.Config, *, on_exit: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._on_exit()
        super().handle_exit(sig, frame)


def _exit_cleanly(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)


if __name__ == "__main__":
    main()
