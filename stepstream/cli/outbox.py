"""``stepstream outbox install|relay|status``: the transactional outbox (``stepstream.client.outbox``) of an
application's PostgreSQL database, from the command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import orjson
import psycopg

from eventstore.errors import InfrastructureError
from eventstore.health import serve_health
from stepstream.client.outbox import (
    TABLE,
    InvalidOutboxInput,
    OutboxRelay,
    OutboxSettings,
    backlog,
    install,
    load_settings,
    log,
)

EXIT_INVALID = 2


def add_parsers(commands: Any) -> None:
    """``stepstream outbox install|relay|status``."""
    outbox = commands.add_parser("outbox", help="the transactional outbox of an application's PostgreSQL database")
    actions = outbox.add_subparsers(dest="action", required=True)
    actions.add_parser("install", help="create the outbox table (idempotent)").set_defaults(
        func=_configured("install", _install))
    relay = actions.add_parser("relay", help="relay outbox rows to inbox until SIGTERM (or --once)")
    relay.add_argument("--once", action="store_true", help="relay what is pending now, then exit")
    relay.set_defaults(func=_configured("relay", _relay))
    status = actions.add_parser("status", help="unsent rows and the age of the oldest")
    status.add_argument("--json", action="store_true")
    status.set_defaults(func=_configured("status", _status))


def _configured(action: str, run: Callable[[argparse.Namespace, OutboxSettings, str], int],
                ) -> Callable[[argparse.Namespace], int]:
    """``run`` with the settings and the database they name; invalid settings exit 2 naming the field
    (before anything connects)."""

    def invoke(args: argparse.Namespace) -> int:
        try:
            settings = load_settings()
            dsn = settings.resolved_dsn()
        except InvalidOutboxInput as exc:
            print(f"stepstream outbox {action}: invalid {exc}", file=sys.stderr)
            return EXIT_INVALID
        return run(args, settings, dsn)

    return invoke


def _connect(dsn: str) -> psycopg.Connection[Any]:
    try:
        return psycopg.connect(dsn, autocommit=True)
    except psycopg.OperationalError as exc:
        raise InfrastructureError(f"outbox database unavailable: {exc}") from exc


def _install(_args: argparse.Namespace, settings: OutboxSettings, dsn: str) -> int:
    with _connect(dsn) as conn:
        install(conn, settings.db_schema)
    print(f"outbox table {settings.db_schema}.{TABLE} ready")
    return 0


def _status(args: argparse.Namespace, settings: OutboxSettings, dsn: str) -> int:
    with _connect(dsn) as conn:
        current = backlog(conn, settings.db_schema)
    oldest = current.oldest.isoformat() if current.oldest else None
    if args.json:
        print(orjson.dumps({"pending": current.pending, "oldest": oldest}).decode())
    else:
        print(f"{current.pending} pending" + (f", oldest enqueued {oldest}" if oldest else ""))
    return 0


def _relay(args: argparse.Namespace, settings: OutboxSettings, dsn: str) -> int:
    # Signals before connecting (a SIGTERM during start-up drains too), as every service process does.
    from eventstore.logs import configure_logging
    from eventstore.settings import ConsumerSettings, KafkaSettings, ObservabilitySettings
    from eventstore.shutdown import GracefulShutdown
    from eventstore.topics import TopicLayout

    stop = GracefulShutdown(ConsumerSettings().drain_timeout_s).install().event
    observability = ObservabilitySettings()
    configure_logging(observability.log_level, observability.log_json)
    if observability.metrics_port is not None:
        serve_health(observability.metrics_port)
    log.info("service starting", service="outbox relay")
    kafka = KafkaSettings()
    layout = TopicLayout.from_settings(kafka)
    with OutboxRelay(settings, bootstrap=kafka.resolved_bootstrap(), topic=layout.inbox, keys_topic=layout.keys,
                     dsn=dsn, stop=stop) as relay:
        if args.once:
            relay.drain()
        else:
            relay.run()
        print(f"relayed {relay.relayed}")
    return 0
