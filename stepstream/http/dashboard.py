"""The dashboard page (``/``) and its static files, which read the JSON endpoints like any client.

The files ship with this package (package data), next to the app that serves them.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

DASHBOARD = Path(__file__).parent / "dashboard"


def add_dashboard(app: FastAPI) -> None:
    """Serve the page at ``/`` and its script and style under ``/static``."""

    @app.get("/", include_in_schema=False)
    def dashboard() -> FileResponse:
        return FileResponse(DASHBOARD / "index.html")

    app.mount("/static", StaticFiles(directory=DASHBOARD), name="static")
