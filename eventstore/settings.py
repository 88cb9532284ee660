"""One frozen settings object for every service, read from ``STEPSTREAM_*`` environment variables.

Frozen so that a running service cannot drift from the configuration it logged at start.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

# Defined beside the client configurations that read them (``eventstore.kafka_config`` imports them from
# there, so that this module, which asks kafka_config whether the cluster answers, is not imported back);
# named here too, where every service finds its settings.
from eventstore.kafka_settings import ConsumerSettings, KafkaSecuritySettings

__all__ = ["ConsumerSettings", "KafkaSecuritySettings", "KafkaSettings", "ObservabilitySettings", "default_home"]

HOME_NAME = ".stepstream"
CHECKOUT = Path(__file__).resolve().parent.parent  # the project's folder, when it runs from a checkout


def default_home(cwd: Path | None = None, checkout: Path = CHECKOUT) -> Path:
    """The project folder when STEPSTREAM_HOME is not set, found the way git finds ``.git``: ``.stepstream``
    in the nearest of the working directory and its parents that has one, or is a project's root (has a
    ``pyproject.toml``); else the one of the checkout this code runs from, if it exists (an editable install
    used from outside any project); else ``./.stepstream``, to be created. Without this, a command run from
    another directory looked in a folder that does not exist, reported the local broker as not running and
    advised starting a second one."""
    here = (cwd or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / HOME_NAME).is_dir() or (folder / "pyproject.toml").is_file():
            return folder / HOME_NAME
    if (checkout / "pyproject.toml").is_file() and (checkout / HOME_NAME).is_dir():
        return checkout / HOME_NAME
    return here / HOME_NAME


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
        default_factory=default_home,
        description="Project folder for the local broker's data, logs and the embedded state store.",
    )
    connect_timeout_s: float = Field(default=5.0, gt=0, description="how long a command waits for the cluster")

    def resolved_bootstrap(self) -> str:
        """The configured cluster, else the local broker this project folder runs."""
        if self.bootstrap_servers:
            return self.bootstrap_servers
        from eventstore.broker import LocalBroker
        from eventstore.errors import KafkaUnreachable

        running = LocalBroker(self.home).status()
        if running is None:
            raise KafkaUnreachable(
                f"no Kafka cluster configured (STEPSTREAM_BOOTSTRAP_SERVERS) and no local broker running in "
                f"{self.home.resolve()}: start it with `stepstream broker start`"
            )
        return running.bootstrap_servers

    def reachable_bootstrap(self) -> str:
        """``resolved_bootstrap``, checked to answer within ``connect_timeout_s``: for commands and clients that
        should say at once that the cluster is down rather than hang in librdkafka's reconnects. (Services
        do not check: a broker that is down is a pause for them, not an end.)"""
        from eventstore.kafka_config import check_reachable

        bootstrap = self.resolved_bootstrap()
        where = "STEPSTREAM_BOOTSTRAP_SERVERS" if self.bootstrap_servers else f"the local broker of {self.home}"
        check_reachable(bootstrap, self.connect_timeout_s, where)
        return bootstrap


class ObservabilitySettings(BaseSettings):
    """Logs and the Prometheus endpoint of a service process."""

    model_config = SettingsConfigDict(env_prefix="STEPSTREAM_", frozen=True, extra="ignore")

    log_level: str = Field(default="INFO", pattern=r"^(DEBUG|INFO|WARNING|ERROR)$")
    log_json: bool = True
    metrics_port: int | None = Field(default=None, ge=0, le=65535, description="serve /metrics on this port")
