"""One frozen settings object for every service, read from ``STEPSTREAM_*`` environment variables.

Frozen so that a running service cannot drift from the configuration it logged at start.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class KafkaSettings(BaseSettings):
    """Where the cluster is and how this deployment names its topics."""

    model_config = SettingsConfigDict(env_prefix="STEPSTREAM_", frozen=True, extra="ignore")

    bootstrap_servers: str = Field(
        default="",
        description="Kafka bootstrap servers; empty means the local broker started by `stepstream broker`.",
    )
    topic_prefix: str = Field(default="stepstream.", pattern=r"^[A-Za-z0-9._-]*$")
    partitions: int = Field(default=6, ge=1, le=1000)
    replication_factor: int = Field(default=1, ge=1)
    home: Path = Field(
        default=Path(".stepstream"),
        description="Project folder for the local broker's data, logs and the embedded state store.",
    )

    def resolved_bootstrap(self) -> str:
        """The configured cluster, else the local broker this project folder runs."""
        if self.bootstrap_servers:
            return self.bootstrap_servers
        from eventstore.broker import LocalBroker

        running = LocalBroker(self.home).status()
        if running is None:
            raise RuntimeError(
                "no Kafka cluster configured (STEPSTREAM_BOOTSTRAP_SERVERS) and the local broker "
                "is not running: start it with `stepstream broker start`"
            )
        return running.bootstrap_servers


class ConsumerSettings(BaseSettings):
    """Knobs of the consumer runtime; tests shorten the timeouts."""

    model_config = SettingsConfigDict(env_prefix="STEPSTREAM_CONSUMER_", frozen=True, extra="ignore")

    batch_size: int = Field(default=500, ge=1)
    poll_timeout_s: float = Field(default=0.5, gt=0)
    drain_timeout_s: float = Field(default=30.0, gt=0)
    commit_interval_ms: int = Field(default=1000, ge=10)
    lag_interval_s: float = Field(default=5.0, gt=0)
    retry_initial_backoff_s: float = Field(default=0.2, gt=0)
    retry_max_backoff_s: float = Field(default=10.0, gt=0)
    session_timeout_ms: int = Field(default=10000, ge=1000)


class ObservabilitySettings(BaseSettings):
    """Logs and the Prometheus endpoint of a service process."""

    model_config = SettingsConfigDict(env_prefix="STEPSTREAM_", frozen=True, extra="ignore")

    log_level: str = Field(default="INFO", pattern=r"^(DEBUG|INFO|WARNING|ERROR)$")
    log_json: bool = True
    metrics_port: int | None = Field(default=None, ge=0, le=65535, description="serve /metrics on this port")
