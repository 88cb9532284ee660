"""How each Kafka client of this process authenticates (``STEPSTREAM_KAFKA_*``) and how the consumer runtime
consumes (``STEPSTREAM_CONSUMER_*``): what ``eventstore.kafka_config`` builds every client's configuration
from. A module of its own so that the configurations depend on these settings and nothing depends back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class KafkaSecuritySettings(BaseSettings):
    """How every Kafka client of this process authenticates (``STEPSTREAM_KAFKA_*``); see docs/acls.md.

    PLAINTEXT (the default) adds nothing to a client's configuration. A SASL protocol needs a mechanism, a
    user name and a password; SASL settings under a protocol without SASL are refused rather than ignored,
    so a forgotten ``STEPSTREAM_KAFKA_SECURITY_PROTOCOL`` cannot silently connect unauthenticated.
    """

    model_config = SettingsConfigDict(env_prefix="STEPSTREAM_KAFKA_", frozen=True, extra="ignore")

    security_protocol: Literal["PLAINTEXT", "SASL_PLAINTEXT", "SASL_SSL", "SSL"] = "PLAINTEXT"
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = None
    sasl_username: str | None = None
    sasl_password: SecretStr | None = None
    ssl_ca_location: Path | None = Field(default=None, description="CA bundle (PEM) that signed the brokers' certs")

    @field_validator("security_protocol", "sasl_mechanism", mode="before")
    @classmethod
    def _upper(cls, value: object) -> object:
        return value.upper() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _consistent(self) -> KafkaSecuritySettings:
        protocol = self.security_protocol
        sasl = protocol.startswith("SASL_")
        given = {"STEPSTREAM_KAFKA_SASL_MECHANISM": self.sasl_mechanism,
                 "STEPSTREAM_KAFKA_SASL_USERNAME": self.sasl_username,
                 "STEPSTREAM_KAFKA_SASL_PASSWORD": self.sasl_password}
        for variable, value in given.items():
            if sasl and not value:
                raise ValueError(f"{variable} is required when STEPSTREAM_KAFKA_SECURITY_PROTOCOL is {protocol}")
            if not sasl and value:
                raise ValueError(f"{variable} is set but STEPSTREAM_KAFKA_SECURITY_PROTOCOL is {protocol}: "
                                 "use SASL_PLAINTEXT or SASL_SSL")
        if self.ssl_ca_location is not None and not protocol.endswith("SSL"):
            raise ValueError(f"STEPSTREAM_KAFKA_SSL_CA_LOCATION is set but STEPSTREAM_KAFKA_SECURITY_PROTOCOL is "
                             f"{protocol}: use SSL or SASL_SSL")
        return self

    def client_config(self) -> dict[str, Any]:
        """The librdkafka properties; empty for PLAINTEXT, so such clients are configured as before."""
        if self.security_protocol == "PLAINTEXT":
            return {}
        config: dict[str, Any] = {"security.protocol": self.security_protocol}
        if self.sasl_mechanism is not None:
            config["sasl.mechanism"] = self.sasl_mechanism
            config["sasl.username"] = self.sasl_username
            config["sasl.password"] = self.sasl_password.get_secret_value() if self.sasl_password else ""
        if self.ssl_ca_location is not None:
            config["ssl.ca.location"] = str(self.ssl_ca_location)
        return config


class ConsumerSettings(BaseSettings):
    """Knobs of the consumer runtime; tests shorten the timeouts."""

    model_config = SettingsConfigDict(env_prefix="STEPSTREAM_CONSUMER_", frozen=True, extra="ignore")

    batch_size: int = Field(default=500, ge=1)
    batch_interval_ms: int = Field(default=100, ge=0,
                                   description="how long a batch may keep growing while messages keep arriving")
    poll_timeout_s: float = Field(default=0.5, gt=0)
    drain_timeout_s: float = Field(default=30.0, gt=0)
    commit_interval_ms: int = Field(default=1000, ge=10)
    lag_interval_s: float = Field(default=5.0, gt=0)
    retry_initial_backoff_s: float = Field(default=0.2, gt=0)
    retry_max_backoff_s: float = Field(default=10.0, gt=0)
    session_timeout_ms: int = Field(default=10000, ge=1000)
    transaction_timeout_s: float = Field(
        default=10.0, gt=0,
        description="exactly-once: the transaction timeout (``transaction.timeout.ms``; Kafka Streams' default too) "
                    "and each transactional call's own timeout. A transaction left open by a process that hangs or "
                    "dies is aborted by its coordinator after this long, so read_committed readers of the partitions "
                    "it wrote wait that long at most, not the 60 s librdkafka's default would hold them")
    commit_stall_s: float = Field(
        default=15.0, gt=0,
        description="how long one call into librdkafka's transactions (send offsets, commit, abort, init) may block "
                    "before the process exits 75 for a restart (eventstore.stall); above ``transaction_timeout_s``, "
                    "which each call is given, so only a hang fires it, and short, because while a process hangs "
                    "its group's rebalances wait for it")
