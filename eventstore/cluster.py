"""A local KRaft cluster of several brokers from the same Maven-fetched jars, on 127.0.0.1.

Each node is broker and controller (combined mode), with its own folder ``home/broker-N``; the controller
quorum is every node. Internal topics get three replicas and ``min.insync.replicas`` 2 once there are
three nodes (``eventstore.broker.min_insync_replicas``), so tests and users can stop or SIGKILL a broker and
see that nothing acknowledged is lost and writes go on. The plan (ports, cluster id) is kept in
``home/cluster.json`` so a restarted node comes back at the same address.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from eventstore.broker import BrokerInfo, LocalBroker, NodePlan, free_port, new_cluster_id, wait_ready
from eventstore.errors import BrokerError


class LocalCluster:
    """Start, stop and SIGKILL the nodes of the cluster whose data lives under ``home``."""

    def __init__(self, home: Path, nodes: int = 3) -> None:
        if nodes < 1:
            raise BrokerError("a cluster needs at least one node")
        self.home = Path(home).resolve()
        self.nodes = [LocalBroker(self.home, node=plan) for plan in self._plan(nodes)]

    @property
    def bootstrap_servers(self) -> str:
        return ",".join(f"127.0.0.1:{node.requested_port}" for node in self.nodes)

    def node(self, node_id: int) -> LocalBroker:
        return self.nodes[node_id - 1]

    def start(self) -> list[BrokerInfo]:
        """Launch every node, then wait for each: no node serves before a quorum of controllers is up."""
        launched = [node.launch() for node in self.nodes]
        try:
            for node, (info, proc) in zip(self.nodes, launched, strict=True):
                wait_ready(info, proc, login=node.sasl_client_config())
        except BrokerError:
            self.stop()
            raise
        return [info for info, _proc in launched]

    def stop(self) -> None:
        """Stop every node at once: one by one, the last ones would wait for a controller quorum that the
        first ones took away (each then sits out its whole shutdown timeout)."""
        with ThreadPoolExecutor(len(self.nodes)) as pool:
            list(pool.map(LocalBroker.stop, self.nodes))

    def _plan(self, nodes: int) -> list[NodePlan]:
        """The cluster's ports and id: read from ``cluster.json`` if this home has one of this size."""
        path = self.home / "cluster.json"
        try:
            saved = json.loads(path.read_text())
            if len(saved["ports"]) == nodes:
                return self._plans(saved["cluster_id"], {int(n): p for n, p in saved["ports"].items()},
                                   {int(n): p for n, p in saved["controller_ports"].items()})
        except (OSError, ValueError, KeyError):
            pass
        ports = {n: free_port() for n in range(1, nodes + 1)}
        controllers = {n: free_port() for n in range(1, nodes + 1)}
        cluster_id = new_cluster_id()
        self.home.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"cluster_id": cluster_id, "ports": ports, "controller_ports": controllers}))
        return self._plans(cluster_id, ports, controllers)

    @staticmethod
    def _plans(cluster_id: str, ports: dict[int, int], controllers: dict[int, int]) -> list[NodePlan]:
        return [NodePlan(node_id=n, port=ports[n], quorum=controllers, cluster_id=cluster_id) for n in sorted(ports)]
