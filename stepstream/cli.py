"""``stepstream``: one thin command in front of every service and tool.

Each sub-command parses its arguments and calls into the package that owns the work.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from eventstore.errors import StepstreamError
from eventstore.settings import KafkaSettings


def _broker(args: argparse.Namespace) -> int:
    from eventstore.broker import LocalBroker

    settings = KafkaSettings()
    broker = LocalBroker(settings.home, port=args.port)
    if args.action == "start":
        info = broker.start()
        print(f"broker running: pid {info.pid}, bootstrap {info.bootstrap_servers}, log {broker.log_file}")
        return 0
    if args.action == "stop":
        print("broker stopped" if broker.stop() else "broker was not running")
        return 0
    running = broker.status()
    if running is None:
        print("broker not running")
        return 3
    print(f"broker running: pid {running.pid}, bootstrap {running.bootstrap_servers}, log {broker.log_file}")
    return 0


def _topics(_args: argparse.Namespace) -> int:
    from confluent_kafka.admin import AdminClient

    from eventstore.topics import TopicLayout, ensure_topics

    settings = KafkaSettings()
    layout = TopicLayout.from_settings(settings)
    created = ensure_topics(AdminClient({"bootstrap.servers": settings.resolved_bootstrap()}),
                            layout.core_specs(), settings.replication_factor)
    print(f"created: {', '.join(created)}" if created else "all topics exist")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from stepstream.demo import run_demo

    return run_demo(tasks=args.tasks)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stepstream", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    broker = commands.add_parser("broker", help="the local single-node Kafka broker (KRaft)")
    broker.add_argument("action", choices=["start", "stop", "status"])
    broker.add_argument("--port", type=int, default=None, help="listener port (default: free, then kept)")
    broker.set_defaults(func=_broker)

    topics = commands.add_parser("topics", help="create the topic layout")
    topics.add_argument("action", choices=["create"])
    topics.set_defaults(func=_topics)

    demo = commands.add_parser("demo", help="run the demo on the local broker")
    demo.add_argument("--tasks", type=int, default=20)
    demo.set_defaults(func=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except StepstreamError as exc:
        print(f"stepstream: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
