"""Agent settings (``STEPSTREAM_AGENT_*``)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from agents.runtime import RetryPolicy


class AgentSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="STEPSTREAM_AGENT_", frozen=True, extra="ignore")

    service_url: str = Field(default="http://127.0.0.1:8765", description="the order service the shipped agents call")
    call_timeout_s: float = Field(default=10.0, gt=0)
    initial_backoff_s: float = Field(default=0.1, gt=0)
    max_backoff_s: float = Field(default=5.0, gt=0)

    def retry_policy(self) -> RetryPolicy:
        return RetryPolicy(initial_backoff_s=self.initial_backoff_s, max_backoff_s=self.max_backoff_s,
                           call_timeout_s=self.call_timeout_s)
