"""A real single-node Apache Kafka broker (KRaft combined mode) for development, tests and CI.

The machines this project runs on may have no Docker engine, so the broker runs from the
``org.apache.kafka:kafka_2.13`` jars that Maven fetches from Maven Central into a cache folder shared by
every checkout. Its data and logs live under the project folder so that ``stepstream broker stop`` and
a new start keep the same cluster.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from confluent_kafka.admin import AdminClient

from eventstore.errors import BrokerError

KAFKA_VERSION = "4.1.1"
LOG4J_VERSION = "2.25.3"
SLF4J_VERSION = "2.0.17"
READY_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 30.0
STANDARD_AUTHORIZER = "org.apache.kafka.metadata.authorizer.StandardAuthorizer"
_SASL_USER = re.compile(r"^[A-Za-z0-9._-]+$")

_POM = f"""<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>io.stepstream</groupId><artifactId>local-kafka</artifactId><version>1</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency><groupId>org.apache.kafka</groupId><artifactId>kafka_2.13</artifactId>
      <version>{KAFKA_VERSION}</version></dependency>
    <dependency><groupId>org.apache.kafka</groupId><artifactId>kafka-tools</artifactId>
      <version>{KAFKA_VERSION}</version></dependency>
    <dependency><groupId>org.slf4j</groupId><artifactId>slf4j-api</artifactId>
      <version>{SLF4J_VERSION}</version></dependency>
    <dependency><groupId>org.apache.logging.log4j</groupId><artifactId>log4j-slf4j2-impl</artifactId>
      <version>{LOG4J_VERSION}</version></dependency>
    <dependency><groupId>org.apache.logging.log4j</groupId><artifactId>log4j-core</artifactId>
      <version>{LOG4J_VERSION}</version></dependency>
  </dependencies>
</project>
"""

_JARS_ID = hashlib.sha256(_POM.encode()).hexdigest()[:16]
"""What the cache's stamp holds: a cache fetched for another list of jars is fetched again."""

_LOG4J2 = """status = warn
appender.file.type = File
appender.file.name = file
appender.file.fileName = {log_file}
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.file.ref = file
logger.kafka.name = org.apache.kafka
logger.kafka.level = WARN
logger.state.name = state.change.logger
logger.state.level = WARN
"""


def jar_cache_dir() -> Path:
    """Jars are shared by every checkout on the machine, so a second clone does not fetch them again."""
    root = os.environ.get("STEPSTREAM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "stepstream"
    )
    return Path(root) / f"kafka-{KAFKA_VERSION}"


def fetch_jars() -> Path:
    """Fetch the broker's jars with Maven once; later calls return the cached folder at once."""
    cache = jar_cache_dir()
    libs = cache / "libs"
    stamp = cache / ".complete"
    if stamp.exists() and stamp.read_text() == _JARS_ID:
        return libs
    if shutil.which("mvn") is None:
        raise BrokerError("Maven (mvn) is needed to fetch the Kafka jars; install it, or use Docker")
    cache.mkdir(parents=True, exist_ok=True)
    (cache / "pom.xml").write_text(_POM)
    staging = cache / "libs.partial"
    shutil.rmtree(staging, ignore_errors=True)
    result = subprocess.run(
        ["mvn", "-q", "-B", "-f", str(cache / "pom.xml"), "dependency:copy-dependencies",
         f"-DoutputDirectory={staging}", "-DincludeScope=runtime"],
        capture_output=True, text=True, check=False,
    )
    if result.returncode != 0:
        raise BrokerError(f"Maven could not fetch the Kafka jars:\n{result.stdout}\n{result.stderr}")
    # The old slf4j 1.7 API that kafka pulls in would shadow the 2.x binding log4j needs.
    for stale in staging.glob("slf4j-api-1.*.jar"):
        stale.unlink()
    shutil.rmtree(libs, ignore_errors=True)
    staging.rename(libs)
    stamp.write_text(_JARS_ID)
    return libs


def run_kafka_tool(main_class: str, *args: str, timeout_s: float = 120.0) -> str:
    """Run one of Kafka's own command-line tools (``org.apache.kafka.tools...``) from the same jars as the
    broker and return what it printed: the yardstick our own figures (consumer lag) are checked against."""
    result = subprocess.run(["java", "-Xmx256m", "-cp", f"{fetch_jars()}/*", main_class, *args],
                            capture_output=True, text=True, timeout=timeout_s, check=False)
    if result.returncode != 0:
        raise BrokerError(f"{main_class} {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
    return result.stdout


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _pid_is_broker(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"kafka.Kafka" in cmdline


@dataclass(frozen=True)
class BrokerInfo:
    pid: int
    port: int

    @property
    def bootstrap_servers(self) -> str:
        return f"127.0.0.1:{self.port}"


class LocalBroker:
    """Start, stop and inspect the broker whose data lives in ``home/broker``.

    With ``sasl_users`` (name -> password) both listeners speak SASL_PLAINTEXT with the PLAIN mechanism (the
    users are the JAAS config in ``server.properties``) and the StandardAuthorizer denies whatever no ACL
    allows. ``super_users`` bypass the ACLs; the first of them is the broker's own identity (inter-broker
    and controller connections) and the one the readiness check logs in as. Without users the broker is
    PLAINTEXT with no authorizer.
    """

    def __init__(self, home: Path, port: int | None = None, *, sasl_users: Mapping[str, str] | None = None,
                 super_users: Sequence[str] = (), node: NodePlan | None = None) -> None:
        self.node = node
        self.root = Path(home).resolve() / (f"broker-{node.node_id}" if node else "broker")
        self.requested_port = node.port if node else port
        self.sasl_users = dict(sasl_users or {})
        self.super_users = list(super_users)
        if self.sasl_users:
            _check_sasl_users(self.sasl_users, self.super_users)
        elif self.super_users:
            raise BrokerError("super_users need sasl_users: a PLAINTEXT broker has no authorizer")

    def sasl_client_config(self, user: str | None = None) -> dict[str, Any]:
        """librdkafka properties to log in as ``user`` (default: the first super user); empty without SASL."""
        if not self.sasl_users:
            return {}
        name = user or self.super_users[0]
        return {"security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "PLAIN", "sasl.username": name,
                "sasl.password": self.sasl_users[name]}

    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    @property
    def log_file(self) -> Path:
        return self.root / "logs" / "server.log"

    @property
    def _state_file(self) -> Path:
        return self.root / "broker.json"

    @property
    def _properties(self) -> Path:
        return self.root / "server.properties"

    def status(self) -> BrokerInfo | None:
        """The running broker of this folder, or None. A stale state file (dead pid) reads as None."""
        try:
            state = json.loads(self._state_file.read_text())
        except (OSError, ValueError):
            return None
        info = BrokerInfo(pid=int(state["pid"]), port=int(state["port"]))
        return info if _pid_is_broker(info.pid) else None

    def start(self) -> BrokerInfo:
        """Idempotent: a broker already running here is returned as it is."""
        info, proc = self.launch()
        try:
            wait_ready(info, proc, login=self.sasl_client_config())
        except BrokerError:
            self.stop()
            raise
        return info

    def launch(self) -> tuple[BrokerInfo, subprocess.Popen[bytes] | None]:
        """Start the JVM without waiting for it to serve (a cluster's nodes wait for each other's quorum);
        a broker already running here is returned with no process of ours."""
        running = self.status()
        if running is not None:
            return running, None
        libs = fetch_jars()
        port, controller_port = self._ports()
        self._write_config(port, controller_port)
        classpath = f"{libs}/*"
        if not (self.data_dir / "meta.properties").exists():
            self._format(classpath)
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        jvm = [
            "java", "-Xms256m", "-Xmx768m", "-XX:+UseG1GC", "-XX:TieredStopAtLevel=1", "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={self.root / 'log4j2.properties'}",
            f"-Dkafka.logs.dir={self.log_file.parent}",
            "-cp", classpath, "kafka.Kafka", str(self._properties),
        ]
        with open(self.log_file.parent / "stdout.log", "ab") as out:
            proc = subprocess.Popen(jvm, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        info = BrokerInfo(pid=proc.pid, port=port)
        self._state_file.write_text(json.dumps({"pid": proc.pid, "port": port}))
        return info, proc

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> bool:
        """SIGTERM, wait for a clean shutdown, SIGKILL only past the timeout. False if none was running."""
        running = self.status()
        if running is None:
            self._state_file.unlink(missing_ok=True)
            return False
        os.kill(running.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while _pid_is_broker(running.pid) and time.monotonic() < deadline:
            _reap(running.pid)
            time.sleep(0.1)
        if _pid_is_broker(running.pid):
            os.kill(running.pid, signal.SIGKILL)
            _reap(running.pid)
        self._state_file.unlink(missing_ok=True)
        return True

    def kill(self) -> None:
        """SIGKILL, for fault-injection tests: no clean shutdown, the log must recover on restart."""
        running = self.status()
        if running is not None:
            os.kill(running.pid, signal.SIGKILL)
            while _pid_is_broker(running.pid):
                _reap(running.pid)
                time.sleep(0.05)
        self._state_file.unlink(missing_ok=True)

    def _ports(self) -> tuple[int, int]:
        """Keep the ports of an earlier start so clients reconnect to the same address after a restart."""
        previous: dict[str, str] = {}
        if self._properties.exists():
            for line in self._properties.read_text().splitlines():
                key, _, value = line.partition("=")
                previous[key] = value
        if self.requested_port:
            port = self.requested_port
        elif "stepstream.port" in previous:
            port = int(previous["stepstream.port"])
        else:
            port = free_port()
        if self.node is not None:
            return port, self.node.quorum[self.node.node_id]
        controller = int(previous.get("stepstream.controller.port") or free_port())
        return port, controller

    def _write_config(self, port: int, controller_port: int) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        node_id, quorum = (self.node.node_id, self.node.quorum) if self.node else (1, {1: controller_port})
        replicas = len(quorum)
        settings = {
            "stepstream.port": port,
            "stepstream.controller.port": controller_port,
            "process.roles": "broker,controller",
            "node.id": node_id,
            "controller.quorum.voters": ",".join(f"{n}@127.0.0.1:{p}" for n, p in sorted(quorum.items())),
            "listeners": f"PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}",
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{port}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
            "log.dirs": self.data_dir,
            "num.partitions": 1,
            "auto.create.topics.enable": "false",
            # On a cluster of three or more, production defaults: three copies, a write on two of them.
            "default.replication.factor": min(replicas, 3),
            "min.insync.replicas": min_insync_replicas(replicas),
            "offsets.topic.replication.factor": min(replicas, 3),
            "offsets.topic.num.partitions": 10,
            "transaction.state.log.replication.factor": min(replicas, 3),
            "transaction.state.log.min.isr": min_insync_replicas(replicas),
            "transaction.state.log.num.partitions": 10,
            # A transaction left open past its timeout (10 s: a producer hung or SIGKILLed) is aborted within a
            # second of it, not up to ten (the default scan interval): read_committed readers move on sooner.
            "transaction.abort.timed.out.transaction.cleanup.interval.ms": 1000,
            "share.coordinator.state.topic.replication.factor": min(replicas, 3),
            "share.coordinator.state.topic.min.isr": min_insync_replicas(replicas),
            "group.initial.rebalance.delay.ms": 0,
            "log.retention.hours": -1,
        }
        if replicas > 1:
            # A SIGKILLed node's partitions (and the coordinators on it) move once the controller fences it, after
            # broker.session.timeout.ms without its heartbeat: 4.5 s instead of 9, well inside the 10 s transaction
            # timeout, so a transaction caught by the kill still commits or aborts in its process instead of being
            # aborted by its coordinator and its producer fenced. (A single node fences nobody else.)
            settings.update({"broker.session.timeout.ms": 4500, "broker.heartbeat.interval.ms": 1000})
        if self.sasl_users:
            settings.update(self._sasl_settings(port, controller_port))
        self._properties.write_text("".join(f"{k}={v}\n" for k, v in settings.items()))
        (self.root / "log4j2.properties").write_text(_LOG4J2.format(log_file=self.log_file))

    def _sasl_settings(self, port: int, controller_port: int) -> dict[str, object]:
        """SASL_PLAINTEXT/PLAIN on both listeners, the KRaft StandardAuthorizer, deny without an ACL.

        The controller listener authenticates too: left PLAINTEXT, its ANONYMOUS principal would have to be
        a super user, and anyone reaching the controller port could then change ACLs.
        """
        broker_user = self.super_users[0]
        jaas = ("org.apache.kafka.common.security.plain.PlainLoginModule required "
                f'username="{broker_user}" password="{self.sasl_users[broker_user]}" '
                + " ".join(f'user_{name}="{password}"' for name, password in self.sasl_users.items()) + ";")
        return {
            "listeners": f"SASL_PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}",
            "advertised.listeners": f"SASL_PLAINTEXT://127.0.0.1:{port}",
            "inter.broker.listener.name": "SASL_PLAINTEXT",
            "listener.security.protocol.map": "CONTROLLER:SASL_PLAINTEXT,SASL_PLAINTEXT:SASL_PLAINTEXT",
            "sasl.enabled.mechanisms": "PLAIN",
            "sasl.mechanism.inter.broker.protocol": "PLAIN",
            "sasl.mechanism.controller.protocol": "PLAIN",
            "listener.name.sasl_plaintext.plain.sasl.jaas.config": jaas,
            "listener.name.controller.plain.sasl.jaas.config": jaas,
            "authorizer.class.name": STANDARD_AUTHORIZER,
            "allow.everyone.if.no.acl.found": "false",
            "super.users": ";".join(f"User:{name}" for name in self.super_users),
        }

    def _format(self, classpath: str) -> None:
        cluster_id = self.node.cluster_id if self.node else new_cluster_id()
        result = subprocess.run(
            ["java", f"-Dlog4j2.configurationFile={self.root / 'log4j2.properties'}", "-cp", classpath,
             "kafka.tools.StorageTool", "format", "--cluster-id", cluster_id,
             "--config", str(self._properties), "--ignore-formatted"],
            capture_output=True, text=True, check=False,
        )
        if result.returncode != 0:
            raise BrokerError(f"formatting the KRaft storage failed:\n{result.stdout}\n{result.stderr}")


def new_cluster_id() -> str:
    """A random KRaft cluster id, never starting with '-': ``kafka-storage format --cluster-id -Vx...`` takes
    such an id for an option and fails (one id in 64 did). Kafka's own ``Uuid.randomUuid`` skips them too."""
    while (cluster_id := base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")).startswith("-"):
        pass
    return cluster_id


def min_insync_replicas(replicas: int) -> int:
    """Two copies must take a write (acks=all) once there are three: one broker may fail without losing
    an acknowledged record or stopping writes. Fewer brokers cannot afford it."""
    return 2 if replicas >= 3 else 1


@dataclass(frozen=True)
class NodePlan:
    """One node of a local KRaft cluster: its id, its client port, and every node's controller port."""

    node_id: int
    port: int
    quorum: Mapping[int, int]
    cluster_id: str


def _reap(pid: int) -> None:
    """Collect our own child's exit status so it does not linger as a zombie that looks alive."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def _check_sasl_users(users: Mapping[str, str], super_users: Sequence[str]) -> None:
    """Names and passwords go into a quoted JAAS string in a properties file: keep them unambiguous there."""
    for name, password in users.items():
        if not _SASL_USER.match(name):
            raise BrokerError(f"SASL user name {name!r}: letters, digits, '.', '_' and '-' only")
        if not password or any(c in password for c in '"\\') or not password.isprintable():
            raise BrokerError(f"SASL password of {name!r}: printable, without quotes or backslashes")
    if not super_users:
        raise BrokerError("a SASL broker needs a super user (the broker's own identity and the admin)")
    unknown = [name for name in super_users if name not in users]
    if unknown:
        raise BrokerError(f"super users without a password in sasl_users: {', '.join(unknown)}")


def wait_ready(info: BrokerInfo, proc: subprocess.Popen[bytes] | None,
                login: Mapping[str, Any] | None = None) -> None:
    """Ready means the admin API answers with this broker in the metadata, not that time has passed."""
    admin = AdminClient(
        {"bootstrap.servers": info.bootstrap_servers, "socket.connection.setup.timeout.ms": 2000, "log_level": 0,
         **(login or {})}
    )
    deadline = time.monotonic() + READY_TIMEOUT_S
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise BrokerError(f"the broker exited with {proc.returncode} while starting; see its log")
        try:
            metadata = admin.list_topics(timeout=2)
            if metadata.brokers:
                return
        except Exception as exc:
            last_error = exc
        time.sleep(0.2)
    raise BrokerError(f"the broker at {info.bootstrap_servers} was not ready in {READY_TIMEOUT_S}s: {last_error}")
