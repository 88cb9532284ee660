"""The dashboard page (``/``) and its static files, which read the JSON endpoints like any client.

The files ship with this package (package data), next to the app that serves them. The page carries the
task states (``schemas.states.TaskStatus``) so the script draws a tile for each state the server knows
instead of keeping its own list.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

from schemas.states import TaskStatus

DASHBOARD = Path(__file__).parent / "dashboard"


def page() -> str:
    """``index.html`` with the task states in its ``data-task-states`` attribute, as a JSON list."""
    states = html.escape(json.dumps([status.value for status in TaskStatus]))
    return (DASHBOARD / "index.html").read_text(encoding="utf-8").replace("{{task_states}}", states)


def add_dashboard(app: FastAPI) -> None:
    """Serve the page at ``/`` and its script and style under ``/static``."""
    body = page()

    @app.get("/", include_in_schema=False)
    def dashboard() -> HTMLResponse:
        return HTMLResponse(body)

    app.mount("/static", StaticFiles(directory=DASHBOARD), name="static")
