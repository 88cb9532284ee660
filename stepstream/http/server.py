"""``stepstream serve api``: the HTTP app (``stepstream.http.app``) on a uvicorn server that drains on SIGTERM
like every service, with the write side only when tokens and a Kafka cluster are configured.
"""

from __future__ import annotations

import socket
import sys
import threading
from types import FrameType
from typing import TYPE_CHECKING, Any

import structlog

from eventstore.errors import KafkaUnreachable
from eventstore.health import HEALTH
from eventstore.logs import configure_logging
from eventstore.settings import ConsumerSettings, KafkaSettings, ObservabilitySettings
from eventstore.shutdown import GracefulShutdown
from eventstore.topics import TopicLayout
from eventstore.tracing import configure_tracing
from projections.settings import StoreSettings
from stepstream.errors import UsageError
from stepstream.http.settings import ApiSettings

if TYPE_CHECKING:
    from projections.lag import LagReader
    from projections.store import Store
    from stepstream.http.writer import TaskWriter
    from stepstream.presence import Presence


def serve_api(*, host: str | None, port: int | None) -> int:
    """Serve the API, the dashboard and /metrics until SIGTERM/SIGINT (uvicorn drains open requests)."""
    import uvicorn

    from eventstore.dead_letters import DeadLetters
    from projections.lag import LagReader
    from stepstream.http.app import create_app
    from stepstream.http.dead_letters import dead_letter_routers
    from stepstream.http.dependencies import DependencyBoard
    from stepstream.http.probes import probes_router
    from stepstream.http.writes import write_router

    # Armed before anything connects, as in every service: a SIGTERM during start-up is a stop, not a kill.
    stop = GracefulShutdown(ConsumerSettings().drain_timeout_s).install().event
    settings = ApiSettings()
    observability = ObservabilitySettings()
    configure_logging(observability.log_level, observability.log_json)
    configure_tracing("api")  # FastAPI then traces each request
    structlog.get_logger("stepstream.api").info("service starting", service="api")
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host or settings.host, settings.port if port is None else port))
    except OSError as exc:
        raise UsageError(f"--port {port if port is not None else settings.port}: cannot listen: {exc}") from exc
    kafka = KafkaSettings()
    layout = TopicLayout.from_settings(kafka)
    try:
        lag: LagReader | None = LagReader(kafka.resolved_bootstrap(), layout.prefix)
    except KafkaUnreachable as exc:  # no cluster configured and no local broker: serve the store anyway
        print(f"stepstream: lag is not measured, writes are off: {exc}", file=sys.stderr)
        lag = None
    store = StoreSettings().open(kafka.home)
    if settings.tokens and lag is None:
        store.close()
        raise UsageError("STEPSTREAM_API_TOKENS: the write endpoints need a Kafka cluster "
                         "(STEPSTREAM_BOOTSTRAP_SERVERS, or `stepstream broker start`)")
    # No token, no writes: the API then serves the store without any Kafka client of the write side.
    writer = _task_writer(kafka, layout, store, lag, settings) if settings.tokens and lag is not None else None
    board: DependencyBoard | None = None
    try:
        # Listen before announcing the address: a client that reads it and connects at once is queued, not
        # refused, while the app is still starting.
        listener.listen(2048)
        bound_host, bound_port = listener.getsockname()[:2]
        print(f"api listening on http://{bound_host}:{bound_port} (store {store.describe()})", file=sys.stderr,
              flush=True)
        probes = probes_router(store, layout.events, stop, HEALTH if writer is not None else None)
        routers = [write_router(writer, settings), probes]
        if lag is not None:  # a cluster to read dead letters and the agents' reports from
            routers += dead_letter_routers(DeadLetters(kafka.resolved_bootstrap(), layout.dlq, layout.keys), settings)
            board = DependencyBoard(kafka.resolved_bootstrap(), layout.dependencies)
        app = create_app(store, layout, lag, routers, _presence(kafka, layout) if lag is not None else None, board)
        server = _draining_server_class()(uvicorn.Config(app, log_level="warning", access_log=False))
        # uvicorn installs its own handlers when it runs; a signal that came before that stops it all the same.

        def stop_server() -> None:
            stop.wait()
            server.should_exit = True

        threading.Thread(target=stop_server, name="api-stop", daemon=True).start()
        server.run(sockets=[listener])
    finally:
        if board is not None:
            board.close()
        if writer is not None:
            writer.close()
        store.close()
    return 0


def _draining_server_class() -> type[Any]:
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """Drains on SIGTERM/SIGINT and then exits 0, like every stepstream service: uvicorn would raise the
        signal again after its graceful shutdown, and the process would look killed to its supervisor."""

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            super().handle_exit(sig, frame)
            self._captured_signals.clear()

    return DrainingServer


def _presence(kafka: KafkaSettings, layout: TopicLayout) -> Presence | None:
    """The agents of the workflows the scheduler runs (same setting) and their groups; None, said on stderr,
    when those workflows cannot be loaded: the store is served all the same."""
    from scheduler.settings import SchedulerSettings, WorkflowsUnloadable
    from stepstream.presence import Presence

    try:
        registry = SchedulerSettings().load_registry()
    except WorkflowsUnloadable as exc:
        print(f"stepstream: agents are not checked: {exc}", file=sys.stderr)
        return None
    return Presence.of(registry, kafka.resolved_bootstrap(), layout)


def _task_writer(kafka: KafkaSettings, layout: TopicLayout, store: Store, lag: LagReader,
                 settings: ApiSettings) -> TaskWriter:
    """The write side, checking submissions against the workflows the scheduler runs (same setting)."""
    from scheduler.settings import SchedulerSettings
    from schemas.sealed import EncryptionSettings
    from stepstream.http.admission import GlobalAdmission
    from stepstream.http.writer import TaskWriter

    admission = GlobalAdmission(store, lag, layout, settings.max_in_flight, settings.admission_refresh_s)
    return TaskWriter(bootstrap=kafka.resolved_bootstrap(), layout=layout, store=store,
                      registry=SchedulerSettings().load_registry(), admission=admission, settings=settings,
                      keyring=EncryptionSettings().keyring())
