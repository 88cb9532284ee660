"""schemathesis against the published OpenAPI schema: generated requests to every operation, read and
write, over real stores, a real broker and a running scheduler. No 5xx, and every answer is one the
schema documents."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    status_code_conformance,
)

from projections.lag import LagReader
from projections.store import Positioned, SqliteStore
from stepstream.http.admission import GlobalAdmission
from stepstream.http.app import create_app
from stepstream.http.dependencies import DependencyBoard
from stepstream.http.settings import ApiSettings
from stepstream.http.writer import TaskWriter
from stepstream.http.writes import write_router
from stepstream.presence import Presence
from tests.histories import histories
from tests.system import System
from tests.workflows import REGISTRY

pytestmark = pytest.mark.kafka

TOKEN = {"Authorization": "Bearer schema-token"}


@pytest.fixture
def api_schema(system: System, tmp_path: Path) -> Iterator[schemathesis.Schema]:
    """Reads over a store seeded with many histories; writes decided by a running scheduler (its answers
    checked against its own store), so 201, 200, 409 and 429 paths are reached, not only 202."""
    system.start("projector", "scheduler")
    seeded = SqliteStore(tmp_path / "seeded.db")
    events = histories(40, seed=5, in_flight_every=7, start=datetime.now(UTC) - timedelta(minutes=5))
    seeded.apply_events(system.layout.events, [Positioned(0, i, e) for i, e in enumerate(events)])
    live = SqliteStore(system.store_path)
    api_settings = ApiSettings(tokens={"fuzzer": "schema-token"}, decision_timeout_s=5, max_in_flight=1_000)
    lag = LagReader(system.bootstrap, system.layout.prefix)
    admission = GlobalAdmission(live, lag, system.layout, api_settings.max_in_flight)
    writer = TaskWriter(bootstrap=system.bootstrap, layout=system.layout, store=live, registry=REGISTRY,
                        admission=admission, settings=api_settings)
    board = DependencyBoard(system.bootstrap, system.layout.dependencies)  # as `serve api` follows the reports
    app = create_app(seeded, system.layout, lag, [write_router(writer, api_settings)],
                     Presence.of(REGISTRY, system.bootstrap, system.layout), board)
    try:
        yield schemathesis.openapi.from_asgi("/openapi.json", app)
    finally:
        board.close()
        writer.close()
        live.close()
        seeded.close()


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
def test_generated_requests_get_no_server_error_and_only_documented_answers(case: schemathesis.Case) -> None:
    case.call_and_validate(headers=TOKEN, checks=[not_a_server_error, status_code_conformance,
                                                  content_type_conformance, response_headers_conformance])
