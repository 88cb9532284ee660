"""Dead letters for the console: one inspected (``GET /api/dlq/{partition}/{offset}``), one replayed after a
fix (``POST .../replay``) and one discarded for good (``POST .../discard``), both behind an operator's bearer
token, as ``stepstream dlq show``, ``dlq replay`` and ``dlq discard`` do.

They read the DLQ topic itself (``eventstore.dead_letters``): the store's ``dlq_entries`` rows list the dead
letters, but the message, its headers and its value are only on the log. A replay or a discard is recorded
there too (a marker the projector turns into ``replayed_at`` or ``discarded_at``), so the list shows it once
the projector has read it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

import structlog
from fastapi import APIRouter, Depends, HTTPException, Path, Query

from eventstore.dead_letters import DeadLetters, DlqToolError
from stepstream.http.auth import BearerTokens, token_holder
from stepstream.http.settings import ApiSettings

log = structlog.get_logger("stepstream.api")

Partition = Annotated[int, Path(ge=0, le=2**31 - 1, description="the dead letter's partition of the DLQ topic")]
Offset = Annotated[int, Path(ge=0, le=2**63 - 1, description="its offset there")]


def dead_letter_routers(dead_letters: DeadLetters, settings: ApiSettings) -> list[APIRouter]:
    """The read route, open like every read, and the replay, under the write side's tokens."""
    reads = APIRouter(tags=["operators"])
    writes = APIRouter(tags=["writes"], route_class=BearerTokens(settings).route_class(settings.max_body_bytes))

    @reads.get("/api/dlq/{partition}/{offset}", responses={404: {"description": "no dead letter there"},
                                                           503: {"description": "the broker did not answer"}})
    def dead_letter(partition: Partition, offset: Offset) -> dict[str, Any]:
        """One dead letter: its reason, origin, headers (text where UTF-8) and its value decoded (or raw, with
        why it does not decode)."""
        try:
            return dead_letters.fetch(partition, offset).detail(dead_letters.codec)
        except DlqToolError as exc:
            raise HTTPException(404, str(exc)) from exc

    @writes.post("/api/dlq/{partition}/{offset}/replay", responses={
        401: {"description": "no valid bearer token: nothing replayed"},
        404: {"description": "no dead letter there"},
        409: {"description": "already replayed (force=true replays it again), or discarded"},
        503: {"description": "Kafka did not take the replay"}})
    def replay(partition: Partition, offset: Offset, who: Annotated[str, Depends(token_holder)],
               force: Annotated[bool, Query(description="replay again one already replayed")] = False,
               ) -> dict[str, Any]:
        """Re-publish the dead letter to its origin topic and partition (key, value and headers as they were),
        and record the replay on the DLQ topic."""
        outcome = _answer(lambda: dead_letters.replay([(partition, offset)], force=force), partition, offset)
        log.info("dead letter replayed", entry=f"{partition}:{offset}", to=outcome["replayed_to"], by=who)
        return outcome

    @writes.post("/api/dlq/{partition}/{offset}/discard", responses={
        401: {"description": "no valid bearer token: nothing discarded"},
        404: {"description": "no dead letter there"},
        409: {"description": "discarded or replayed already"},
        503: {"description": "Kafka did not take the discard"}})
    def discard(partition: Partition, offset: Offset, who: Annotated[str, Depends(token_holder)]) -> dict[str, Any]:
        """Give the dead letter up for good: a sealed submission's proposed data key is tombstoned on ``keys``
        (``shredded`` names its record), and the discard is recorded; it is never replayed afterwards."""
        outcome = _answer(lambda: dead_letters.discard([(partition, offset)]), partition, offset)
        log.info("dead letter discarded", entry=f"{partition}:{offset}", shredded=outcome["shredded"], by=who)
        return outcome

    return [reads, writes]


def _answer(act: Callable[[], list[dict[str, Any]]], partition: int, offset: int) -> dict[str, Any]:
    """The outcome of acting on one dead letter, its refusals as HTTP errors: none there (404), skipped with
    the reason (409), Kafka did not take it (503)."""
    try:
        outcome = act()[0]
    except DlqToolError as exc:  # about the entry (ENTRY ...: none there, a marker, no origin), or Kafka's
        raise HTTPException(404 if str(exc).startswith("ENTRY") else 503, str(exc)) from exc
    if outcome["skipped"]:
        raise HTTPException(409, f"{partition}:{offset}: {outcome['skipped']}")
    return outcome
