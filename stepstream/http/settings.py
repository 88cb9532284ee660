"""The HTTP front's settings (``STEPSTREAM_API_*``): where it listens, its tokens and its bounds.

Kept apart from the app so the CLI (``stepstream up`` picks the port) reads them without loading FastAPI.
"""

from __future__ import annotations

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class ApiSettings(BaseSettings):
    """Where ``stepstream serve api`` listens (``STEPSTREAM_API_*``)."""

    model_config = SettingsConfigDict(env_prefix="STEPSTREAM_API_", frozen=True, extra="ignore")

    host: str = Field(default="127.0.0.1", description="interface to listen on")
    port: int = Field(default=8780, ge=0, le=65535, description="0: any free port (printed at start)")
    tokens: dict[str, SecretStr] = Field(
        default_factory=dict, description="bearer tokens of the write endpoints, by who holds them, as JSON "
                                          '({"shop": "...", "alice": "..."}); none: writes are refused (401)')
    max_in_flight: int = Field(default=12_000, ge=1, description="global bound: tasks in flight or waiting on "
                               "inbox past which submissions get 429; the default is the scheduler's per-partition "
                               "bound (2,000) times the default 6 partitions, so the API refuses before a "
                               "scheduler partition has to")
    retry_after_s: int = Field(default=5, ge=1, description="Retry-After of a 429 or 503")
    decision_timeout_s: float = Field(default=5.0, gt=0, description="how long a write waits for the "
                                                                     "scheduler's answer before a 202")
    delivery_timeout_s: float = Field(default=10.0, gt=0, description="how long a write waits for Kafka's "
                                                                      "acknowledgement before a 503")
    admission_refresh_s: float = Field(default=1.0, gt=0, description="how often the global estimate is read")
    max_body_bytes: int = Field(default=1_000_000, ge=1024, description="largest write request body (Kafka's "
                                                                        "default message size is about 1 MB)")
