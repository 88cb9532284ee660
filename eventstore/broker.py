"""A real single-node Apache Kafka broker (KRaft combined mode) for development, tests and CI.

The machines this project runs on may have no Docker engine, so the broker runs from the
``org.apache.kafka:kafka_2.13`` jars that Maven fetches from Maven Central into a cache folder shared by
every checkout. Its data and logs live under the project folder so that ``stepstream broker stop`` and
a new start keep the same cluster.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from confluent_kafka.admin import AdminClient

from eventstore.errors import BrokerError

KAFKA_VERSION = "4.1.1"
LOG4J_VERSION = "2.25.3"
SLF4J_VERSION = "2.0.17"
READY_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 30.0

_POM = f"""<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>io.stepstream</groupId><artifactId>local-kafka</artifactId><version>1</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency><groupId>org.apache.kafka</groupId><artifactId>kafka_2.13</artifactId>
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
    if stamp.exists():
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
    stamp.write_text(KAFKA_VERSION)
    return libs


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
    """Start, stop and inspect the broker whose data lives in ``home/broker``."""

    def __init__(self, home: Path, port: int | None = None) -> None:
        self.root = Path(home).resolve() / "broker"
        self.requested_port = port

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
        running = self.status()
        if running is not None:
            _wait_ready(running, proc=None)
            return running
        libs = fetch_jars()
        port, controller_port = self._ports()
        self._write_config(port, controller_port)
        classpath = f"{libs}/*"
        if not (self.data_dir / "meta.properties").exists():
            self._format(classpath)
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        jvm = [
            "java", "-Xms256m", "-Xmx768m", "-XX:+UseG1GC", "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={self.root / 'log4j2.properties'}",
            f"-Dkafka.logs.dir={self.log_file.parent}",
            "-cp", classpath, "kafka.Kafka", str(self._properties),
        ]
        with open(self.log_file.parent / "stdout.log", "ab") as out:
            proc = subprocess.Popen(jvm, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        info = BrokerInfo(pid=proc.pid, port=port)
        self._state_file.write_text(json.dumps({"pid": proc.pid, "port": port}))
        try:
            _wait_ready(info, proc)
        except BrokerError:
            self.stop()
            raise
        return info

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
        controller = int(previous.get("stepstream.controller.port") or free_port())
        return port, controller

    def _write_config(self, port: int, controller_port: int) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        settings = {
            "stepstream.port": port,
            "stepstream.controller.port": controller_port,
            "process.roles": "broker,controller",
            "node.id": 1,
            "controller.quorum.voters": f"1@127.0.0.1:{controller_port}",
            "listeners": f"PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}",
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{port}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
            "log.dirs": self.data_dir,
            "num.partitions": 1,
            "auto.create.topics.enable": "false",
            "offsets.topic.replication.factor": 1,
            "offsets.topic.num.partitions": 10,
            "transaction.state.log.replication.factor": 1,
            "transaction.state.log.min.isr": 1,
            "transaction.state.log.num.partitions": 10,
            "share.coordinator.state.topic.replication.factor": 1,
            "share.coordinator.state.topic.min.isr": 1,
            "group.initial.rebalance.delay.ms": 0,
            "log.retention.hours": -1,
        }
        self._properties.write_text("".join(f"{k}={v}\n" for k, v in settings.items()))
        (self.root / "log4j2.properties").write_text(_LOG4J2.format(log_file=self.log_file))

    def _format(self, classpath: str) -> None:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        result = subprocess.run(
            ["java", f"-Dlog4j2.configurationFile={self.root / 'log4j2.properties'}", "-cp", classpath,
             "kafka.tools.StorageTool", "format", "--cluster-id", cluster_id,
             "--config", str(self._properties), "--ignore-formatted"],
            capture_output=True, text=True, check=False,
        )
        if result.returncode != 0:
            raise BrokerError(f"formatting the KRaft storage failed:\n{result.stdout}\n{result.stderr}")


def _reap(pid: int) -> None:
    """Collect our own child's exit status so it does not linger as a zombie that looks alive."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def _wait_ready(info: BrokerInfo, proc: subprocess.Popen[bytes] | None) -> None:
    """Ready means the admin API answers with this broker in the metadata, not that time has passed."""
    admin = AdminClient(
        {"bootstrap.servers": info.bootstrap_servers, "socket.connection.setup.timeout.ms": 2000, "log_level": 0}
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
