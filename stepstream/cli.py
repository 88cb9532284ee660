"""``stepstream``: one thin command in front of every service and tool.

Each sub-command parses its arguments and calls into the package that owns the work.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from confluent_kafka import KafkaException

from eventstore import dlq_tools
from eventstore.errors import KafkaUnreachable, StepstreamError
from eventstore.kafka_config import kafka_reason
from eventstore.settings import KafkaSettings
from projections import commands as projection_commands
from schemas.sealed import SealingError
from stepstream import operator, outbox, submit_cli
from stepstream.http import server

EXIT_UNAVAILABLE = 69  # sysexits' EX_UNAVAILABLE: the Kafka cluster did not answer


def _broker(args: argparse.Namespace) -> int:
    from eventstore.broker import LocalBroker

    settings = KafkaSettings()
    if args.nodes < 1:
        raise SystemExit("stepstream broker: --nodes must be at least 1")
    if args.nodes > 1:
        return _cluster(args, settings)
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


def _cluster(args: argparse.Namespace, settings: KafkaSettings) -> int:
    """``broker ACTION --nodes N``: the same, for a local cluster of N brokers (``eventstore.cluster``)."""
    from eventstore.cluster import LocalCluster

    cluster = LocalCluster(settings.home, args.nodes)
    if args.action == "start":
        cluster.start()
        print(f"cluster of {args.nodes} brokers running: bootstrap {cluster.bootstrap_servers}; use it with "
              f"STEPSTREAM_BOOTSTRAP_SERVERS={cluster.bootstrap_servers} STEPSTREAM_REPLICATION_FACTOR="
              f"{min(args.nodes, 3)}")
        return 0
    if args.action == "stop":
        cluster.stop()
        print("cluster stopped")
        return 0
    running = {node.node.node_id: node.status() for node in cluster.nodes if node.node is not None}
    for node_id, info in running.items():
        print(f"broker {node_id}: " + (f"running, pid {info.pid}, 127.0.0.1:{info.port}" if info else "not running"))
    return 0 if all(running.values()) else 3


def _topics(_args: argparse.Namespace) -> int:
    from confluent_kafka.admin import AdminClient

    from eventstore.kafka_config import connection_config
    from eventstore.topics import TopicLayout, ensure_topics

    settings = KafkaSettings()
    layout = TopicLayout.from_settings(settings)
    created = ensure_topics(AdminClient(connection_config(settings.reachable_bootstrap())),
                            layout.core_specs(), settings.replication_factor)
    print(f"created: {', '.join(created)}" if created else "all topics exist")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from demo.run import run_demo

    if args.tasks < 1:
        raise SystemExit("stepstream demo: --tasks must be at least 1")
    return run_demo(tasks=args.tasks)


def _up(args: argparse.Namespace) -> int:
    from stepstream.up import run_up

    return run_up(service_port=args.service_port)


def _run(args: argparse.Namespace) -> int:
    from stepstream import services

    if args.service == "agent":
        if not args.name:
            raise SystemExit("stepstream run agent: NAME is required (e.g. inventory, payments, shipping)")
        return services.run_agent(args.name)
    if args.name:
        raise SystemExit(f"stepstream run {args.service}: takes no NAME")
    runners: dict[str, Callable[[], int]] = {
        "scheduler": services.run_scheduler,
        "projector": services.run_projector,
        "supervisor": services.run_supervisor,
    }
    return runners[args.service]()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stepstream", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    broker = commands.add_parser("broker", help="the local single-node Kafka broker (KRaft)")
    broker.add_argument("action", choices=["start", "stop", "status"])
    broker.add_argument("--port", type=int, default=None, help="listener port (default: free, then kept)")
    broker.add_argument("--nodes", type=int, default=1, help="brokers in the local cluster (3: replicated, "
                                                            "min.insync.replicas 2)")
    broker.set_defaults(func=_broker)

    topics = commands.add_parser("topics", help="create the topic layout")
    topics.add_argument("action", choices=["create"])
    topics.set_defaults(func=_topics)

    run = commands.add_parser("run", help="run one service in the foreground (SIGTERM drains it)")
    run.add_argument("service", choices=["scheduler", "agent", "projector", "supervisor"])
    run.add_argument("name", nargs="?", help="the agent's name, for `run agent`")
    run.set_defaults(func=_run)

    up = commands.add_parser("up", help="run a whole local system until SIGTERM/Ctrl-C")
    up.add_argument("--service-port", type=int, default=None, help="port of the demo's order service")
    up.set_defaults(func=_up)

    submit_cli.add_parsers(commands)
    operator.add_parsers(commands)
    projection_commands.add_parsers(commands)
    server.add_parsers(commands)
    dlq_tools.add_parsers(commands)
    outbox.add_parsers(commands)

    demo = commands.add_parser("demo", help="submit a batch of orders to a local system with faults on")
    demo.add_argument("--tasks", type=int, default=20)
    demo.set_defaults(func=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    if not (sys.argv[1:] if argv is None else argv):  # no command: the list of them, not argparse's one-liner
        parser.print_help(sys.stderr)
        return 2
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except KafkaUnreachable as exc:
        print(f"stepstream: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except (StepstreamError, SealingError) as exc:  # a missing or wrong encryption key too: one line, no key
        print(f"stepstream: {exc}", file=sys.stderr)
        return 1
    except KafkaException as exc:  # a broker lost mid-command: its reason, not a librdkafka traceback
        print(f"stepstream: Kafka: {kafka_reason(exc)}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except KeyboardInterrupt:
        return 130
