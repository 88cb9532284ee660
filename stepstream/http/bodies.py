"""The bodies the write endpoints take: a submission and an operator command, each with its idempotency key.

Declared as models so FastAPI validates them and the OpenAPI schema documents them, apart from the
routes and the writer that both use them.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from schemas.messages import OperatorAction


class SubmissionRequest(BaseModel):
    """A task to run. ``task_id`` is the idempotency key: send the same one again to retry safely."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"workflow": "orders", "input": {"order_id": "o-1", "sku": "A-1", "qty": 1, "amount": 10,
                                         "card_token": "tok_4242"},
         "task_id": "order-o-1"}]})

    workflow: str = Field(min_length=1, max_length=200)
    version: int | None = Field(default=None, ge=1, description="workflow version; omitted: the latest")
    input: dict[str, Any]
    task_id: str | None = Field(default=None, min_length=1, max_length=200, description="default: a new id")
    submitter: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_-]{1,100}$",
                                  description="the private reply topic that gets progress updates: the token "
                                              "holder's own (the default); another name is refused (403)")


class CommandRequest(BaseModel):
    """An operator command on one task. ``command_id`` is its idempotency key (default: a new one)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"action": "compensate", "command_id": "undo-order-o-1"}]})

    action: OperatorAction
    step: str | None = Field(default=None, min_length=1, max_length=200,
                             description="resubmit / retry-compensation / try-now: the step (default: "
                                         "the failed one, for try-now the waiting one)")
    command_id: str | None = Field(default=None, min_length=1, max_length=200)
