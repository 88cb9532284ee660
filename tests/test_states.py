"""Task and step states are spelt once (``schemas.states``): every list of them is derived from there, and a
reply topic written before the spelling was unified still reads."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import pytest
from fastapi import FastAPI
from pydantic import ValidationError

from projections.migrations import MIGRATIONS
from projections.store import _FAILED, _IN_PROGRESS, SqliteStore
from schemas.codec import default_codec
from schemas.messages import StatusUpdate
from schemas.states import PROGRESS, TaskStatus
from stepstream.cli.tasks import TASK_STATES
from stepstream.http.dashboard import page
from stepstream.http.reads import read_router

STATES = [status.value for status in TaskStatus]


def test_the_cli_the_api_and_the_dashboard_offer_the_task_states_in_one_order(tmp_path: Path) -> None:
    app = FastAPI()
    app.include_router(read_router(SqliteStore(tmp_path / "state.db"), [], None))
    parameter = next(p for p in app.openapi()["paths"]["/api/tasks"]["get"]["parameters"] if p["name"] == "state")
    enum = app.openapi()["components"]["schemas"][parameter["schema"]["anyOf"][0]["$ref"].rsplit("/", 1)[-1]]
    found = re.search(r'data-task-states="([^"]*)"', page())
    assert found is not None
    assert list(TASK_STATES) == enum["enum"] == json.loads(html.unescape(found.group(1))) == STATES


@pytest.mark.parametrize(("written", "read"), [("received", "accepted"), ("failed", "error"),
                                               ("accepted", "accepted"), ("step_failed", "step_failed")])
def test_a_reply_topic_update_in_a_former_spelling_reads_as_the_task_status(written: str, read: str) -> None:
    codec = default_codec()
    old = StatusUpdate(task_id="t", status="accepted").model_copy(update={"status": written})  # as once written
    decoded = codec.decode(codec.encode(old))
    assert isinstance(decoded, StatusUpdate) and decoded.status == read


def test_a_reply_topic_update_names_a_task_status_or_a_step_outcome() -> None:
    assert {"completed", "compensation_failed", "step_succeeded", "step_compensated"} <= PROGRESS
    with pytest.raises(ValidationError):
        StatusUpdate(task_id="t", status="succeeded")


def test_the_stores_step_status_conditions_are_the_partial_indexes_word_for_word() -> None:
    migrations = "".join(sql if isinstance(sql, str) else "".join(sql.values()) for _version, sql in MIGRATIONS)
    assert f"where {_IN_PROGRESS};" in migrations
    assert f"where {_FAILED};" in migrations
