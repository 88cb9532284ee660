"""The query API for dashboards: JSON over HTTP (FastAPI, OpenAPI at /openapi.json), the dashboard page
itself (``/``), and Prometheus metrics (``/metrics``), all served from the state store by one process.

Every list is bounded (``limit``), and long ones are keyset-paginated: a response's ``next_cursor``,
passed back as ``cursor``, continues after its last item, stable while new rows arrive. Times are epoch
milliseconds in responses and ISO 8601 in query parameters. Invalid parameters get FastAPI's 422,
whose ``detail[].loc`` names the parameter.
"""

from __future__ import annotations

from collections.abc import Sequence

from fastapi import APIRouter, FastAPI

from eventstore.topics import TopicLayout
from projections.lag import LagReader
from projections.store import Store
from stepstream.http.dashboard import add_dashboard
from stepstream.http.dependencies import DependencyBoard, dependencies_router
from stepstream.http.metrics import metrics_router
from stepstream.http.reads import read_router
from stepstream.presence import Presence


def create_app(store: Store, layout: TopicLayout, lag: LagReader | None = None,
               routers: Sequence[APIRouter] = (), presence: Presence | None = None,
               dependencies: DependencyBoard | None = None) -> FastAPI:
    """The API over ``store``. ``lag`` reads the broker (None: lag endpoints answer 503); ``routers`` add
    endpoints served by the same process (the write side: ``stepstream.http.writes``); ``presence`` says which
    agents have no process running (None: not checked); ``dependencies`` follows the agents' reports on their
    dependencies (None: ``/api/dependencies`` answers 503).

    Only composition lives here (this module's docstring is the OpenAPI description), so each part can be
    read and tested on its own."""
    app = FastAPI(title="stepstream", version="1", summary="Dashboards over the stepstream state store",
                  description=__doc__)
    for router in routers:
        app.include_router(router)
    topics = [layout.events, layout.dlq]
    app.include_router(read_router(store, topics, lag, presence))
    app.include_router(dependencies_router(dependencies))
    app.include_router(metrics_router(store, lag, topics, presence.groups if presence else None))
    add_dashboard(app)
    return app
