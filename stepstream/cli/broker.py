"""``stepstream broker start|stop|status`` (the local broker, or a local cluster with ``--nodes``) and
``stepstream topics create`` (the topic layout on the configured cluster)."""

from __future__ import annotations

import argparse

from eventstore.settings import KafkaSettings


def add_parsers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    broker = commands.add_parser("broker", help="the local single-node Kafka broker (KRaft)")
    broker.add_argument("action", choices=["start", "stop", "status"])
    broker.add_argument("--port", type=int, default=None, help="listener port (default: free, then kept)")
    broker.add_argument("--nodes", type=int, default=1, help="brokers in the local cluster (3: replicated, "
                                                            "min.insync.replicas 2)")
    broker.set_defaults(func=_broker)

    topics = commands.add_parser("topics", help="create the topic layout")
    topics.add_argument("action", choices=["create"])
    topics.set_defaults(func=_topics)


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
