"""The write routes: ``POST /api/tasks`` and ``POST /api/tasks/{id}/commands``, behind the bearer token.

They turn the writer's answers into responses, count them (``stepstream_api_writes_total``) and log them;
what an answer is, and why, is the writer's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

import structlog
from fastapi import APIRouter, Depends, HTTPException
from fastapi.responses import JSONResponse
from prometheus_client import Counter

from stepstream.http.auth import BearerTokens, token_holder
from stepstream.http.bodies import CommandRequest, SubmissionRequest
from stepstream.http.settings import ApiSettings
from stepstream.http.writer import Answer, DeliveryFailed, TaskWriter

log = structlog.get_logger("stepstream.api")


ANSWERS = Counter("stepstream_api_writes_total", "Write requests by endpoint and answer", ["endpoint", "answer"])


def write_router(writer: TaskWriter | None, settings: ApiSettings) -> APIRouter:
    """The write endpoints. Without a writer (no token configured, so no Kafka client either) every write
    is refused by the token check before it could need one."""
    router = APIRouter(tags=["writes"], route_class=BearerTokens(settings).route_class(settings.max_body_bytes))
    unavailable: dict[int | str, dict[str, Any]] = {
        400: {"description": "the body is not JSON"},
        413: {"description": "the body is larger than STEPSTREAM_API_MAX_BODY_BYTES, or than Kafka takes"},
        503: {"description": "Kafka did not take the message; retry after Retry-After"}}

    @router.post("/api/tasks", status_code=201, responses={
        200: {"description": "a repeat of a known submission: nothing new submitted"},
        202: {"description": "on the log, the scheduler has not answered yet"},
        401: {"description": "no valid bearer token: nothing submitted"},
        403: {"description": "the submitter named is not the token holder's: nothing submitted"},
        409: {"description": "the task id exists with other data: nothing submitted"},
        429: {"description": "admission control refused the task: retry after Retry-After, same task id"},
        **unavailable,
    }, description="Submit a task; the answer is the scheduler's decision (or 202 if it takes longer). "
                   "A 422 names the field at fault (`input.amount`); one the scheduler decided "
                   "(a version it does not run, an input it refuses) has the reason as `detail`. "
                   "Workflows and their `input`:\n\n" + "\n".join(
                       f"- {line}" for line in (writer.registry.describe_inputs() if writer else [])))
    def submit_task(request: SubmissionRequest, who: Annotated[str, Depends(token_holder)]) -> JSONResponse:
        """Submit a task; the answer is the scheduler's decision (or 202 if it takes longer)."""
        answer = _guard(lambda: _require(writer).submit(request, who), settings)
        ANSWERS.labels("submit", str(answer.status_code)).inc()
        log.info("submission answered", task_id=request.task_id, workflow=request.workflow, by=who,
                 status=answer.status_code)
        return answer

    @router.post("/api/tasks/{task_id}/commands", responses={
        202: {"description": "on the log, the scheduler has not answered yet"},
        401: {"description": "no valid bearer token: nothing sent"},
        404: {"description": "no such task in the state store"},
        409: {"description": "the scheduler refused the command (the reason says why)"},
        **unavailable,
    })
    def command_task(task_id: str, request: CommandRequest, who: Annotated[str, Depends(token_holder)]) -> JSONResponse:
        """An operator command (resubmit, compensate, cancel, retry-compensation, try-now); the operator is
        the token's name."""
        answer = _guard(lambda: _require(writer).command(task_id, request, who), settings)
        ANSWERS.labels("command", str(answer.status_code)).inc()
        log.info("operator command answered", task_id=task_id, action=request.action, by=who,
                 status=answer.status_code)
        return answer

    return router


def _require(writer: TaskWriter | None) -> TaskWriter:
    if writer is None:
        raise HTTPException(503, "writes are not configured in this process")
    return writer


def _guard(call: Callable[[], Answer], settings: ApiSettings) -> JSONResponse:
    try:
        return call().response()
    except DeliveryFailed as exc:
        if exc.too_large:
            return JSONResponse({"task_id": exc.task_id, "detail": f"too large for the event log: {exc}"}, 413)
        log.warning("message not delivered", task_id=exc.task_id, error=str(exc))
        return JSONResponse({"task_id": exc.task_id, "location": f"/api/tasks/{exc.task_id}",
                             "detail": f"the event log did not acknowledge the message ({exc}); it may still "
                                       "arrive: retry with the same task_id (and command_id), never a new one"},
                            503, {"Retry-After": str(settings.retry_after_s)})
