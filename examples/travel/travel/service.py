"""The travel service the ``trip`` workflow's agents call: flights, hotels and payments, each with its undo.

It keeps the contract a stepstream agent relies on (what ``agents.http`` sends):

- every call carries ``Idempotency-Key`` (the same across a step's attempts) and ``X-Attempt`` (a fencing
  token): a repeated key is answered with the stored result and applies nothing again; an attempt lower
  than one already seen for the key is refused with 409;
- an undo (``/flights/cancel``, ``/hotels/cancel``, ``/payments/refund``) names the forward key in
  ``X-Undoes-Key``: it releases what that key holds, is safe when the forward call never happened, and
  tombstones the key, so a forward call arriving later applies nothing (410);
- the card ``"declined"`` is refused by ``/payments/charge`` for good (402): the step fails and the task
  is compensated.

``GET /admin/records`` shows what the service holds, what it applied per key, and every effect in order.
State is in memory: a restart forgets it (enough for an example).

Run: ``python -m travel.service --port 8300`` from ``examples/travel``.
"""

from __future__ import annotations

import argparse
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Header, HTTPException

FORWARD = {"flights/book": "flights", "hotels/book": "hotels", "payments/charge": "payments"}
UNDO = {"flights/cancel": "flights", "hotels/cancel": "hotels", "payments/refund": "payments"}
OUTPUT = {"flights": "flight_booking", "hotels": "hotel_booking", "payments": "charge_id"}
DECLINED = "declined"


@dataclass
class Ledger:
    """Everything the service did, under one lock: a forward call and an undo of its key never interleave."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    results: dict[str, dict[str, Any]] = field(default_factory=dict)  # forward key -> its answer
    attempts: dict[str, int] = field(default_factory=dict)  # key -> highest X-Attempt seen
    held: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)  # kind -> forward key -> record
    undone: set[str] = field(default_factory=set)  # forward keys undone (tombstones)
    applied: dict[str, dict[str, int]] = field(default_factory=dict)  # operation -> key -> effects applied
    log: list[dict[str, Any]] = field(default_factory=list)  # every effect, in order

    def fence(self, key: str, attempt: int) -> None:
        if attempt < self.attempts.get(key, 0):
            raise HTTPException(409, f"attempt {attempt} is stale: attempt {self.attempts[key]} already came")
        self.attempts[key] = attempt

    def effect(self, operation: str, key: str, trip_id: str) -> None:
        self.applied.setdefault(operation, {})[key] = self.applied.get(operation, {}).get(key, 0) + 1
        self.log.append({"operation": operation, "key": key, "trip_id": trip_id})


def create_app() -> FastAPI:
    app = FastAPI(title="travel")
    ledger = Ledger()

    def forward(operation: str, body: dict[str, Any], key: str, attempt: int) -> dict[str, Any]:
        kind = FORWARD[operation]
        with ledger.lock:
            ledger.fence(key, attempt)
            if key in ledger.undone:
                raise HTTPException(410, "this booking was already undone: nothing applied")
            if key in ledger.results:
                return ledger.results[key]
            if kind == "payments" and body.get("card") == DECLINED:
                raise HTTPException(402, "card declined")
            trip_id = str(body.get("trip_id", ""))
            answer = {OUTPUT[kind]: f"{kind[:2]}-{uuid.uuid4().hex[:8]}"}
            ledger.held.setdefault(kind, {})[key] = {"trip_id": trip_id, **answer}
            ledger.results[key] = answer
            ledger.effect(operation, key, trip_id)
            return answer

    def undo(operation: str, key: str, attempt: int, undoes: str | None) -> dict[str, Any]:
        if not undoes:
            raise HTTPException(400, "X-Undoes-Key (the forward call's key) is required")
        with ledger.lock:
            ledger.fence(key, attempt)
            ledger.undone.add(undoes)
            record = ledger.held.get(UNDO[operation], {}).pop(undoes, None)
            if record is not None:
                ledger.effect(operation, undoes, record["trip_id"])
            return {"released": record is not None}

    for operation in FORWARD:
        def book(body: dict[str, Any], idempotency_key: str = Header(), x_attempt: int = Header(ge=0),
                 operation: str = operation) -> dict[str, Any]:
            return forward(operation, body, idempotency_key, x_attempt)
        app.post(f"/{operation}")(book)

    for operation in UNDO:
        def cancel(idempotency_key: str = Header(), x_attempt: int = Header(ge=0),
                   x_undoes_key: str | None = Header(default=None), operation: str = operation) -> dict[str, Any]:
            return undo(operation, idempotency_key, x_attempt, x_undoes_key)
        app.post(f"/{operation}")(cancel)

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/admin/records")
    def records(trip_id: str | None = None) -> dict[str, Any]:
        """What is held now, effects applied per operation and key, and every effect in order (of one trip)."""
        def ours(trip: str) -> bool:
            return trip_id is None or trip == trip_id

        with ledger.lock:
            log = [entry for entry in ledger.log if ours(entry["trip_id"])]
            keys = {entry["key"] for entry in log}
            return {"held": {kind: [r for r in held.values() if ours(r["trip_id"])]
                             for kind, held in ledger.held.items()},
                    "applied": {op: {k: n for k, n in counts.items() if k in keys}
                                for op, counts in ledger.applied.items()},
                    "log": log}

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description="the travel example's booking service")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8300)
    args = parser.parse_args()
    uvicorn.run(create_app(), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
