"""Agent settings (``STEPSTREAM_AGENT_*``).

The retry numbers here are the base of the central policy: they apply to every dependency unless the
policy file (``STEPSTREAM_AGENT_POLICY_FILE``) says otherwise, so a deployment without a policy file
keeps working as configured by environment alone.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from agents.policy import DependencyPolicy, FilePolicy, PolicyProvider, StaticPolicy
from agents.retry import RetryPolicy


class AgentSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="STEPSTREAM_AGENT_", frozen=True, extra="ignore")

    service_url: str | None = Field(default=None, description="the base URL an HTTP agent calls, over the one its "
                                    "project declares (`stepstream up` sets it to where it started the service)")
    service_urls: dict[str, str] = Field(default_factory=dict, description="per agent name, the base URL it calls, "
                                         "over service_url (JSON; `stepstream up` sets it for its agent host)")
    call_timeout_s: float = Field(default=10.0, gt=0)
    initial_backoff_s: float = Field(default=0.1, gt=0)
    max_backoff_s: float = Field(default=5.0, gt=0)
    policy_file: Path | None = Field(default=None, description="central fault policy (TOML or JSON), hot-reloaded")
    concurrency: int = Field(default=32, ge=1, le=1024,
                             description="attempts in flight per agent process (those of one task run in order)")
    policy_poll_s: float = Field(default=1.0, gt=0, description="how often the policy file is checked for changes")
    linger_ms: int = Field(default=10, ge=0, le=1000,
                           description="how long the agents' answers wait to be sent together (librdkafka's linger)")

    def url_for(self, agent: str) -> str | None:
        """The base URL the HTTP agent ``agent`` calls instead of the one its project declares, if any."""
        return self.service_urls.get(agent, self.service_url)

    def retry_policy(self) -> RetryPolicy:
        return RetryPolicy(initial_backoff_s=self.initial_backoff_s, max_backoff_s=self.max_backoff_s,
                           call_timeout_s=self.call_timeout_s)

    def base_policy(self) -> DependencyPolicy:
        """The built-in defaults with this environment's retry settings applied."""
        return DependencyPolicy(retry=self.retry_policy())

    def policy_provider(self) -> PolicyProvider:
        """The policy file, watched for changes, over the environment's settings; or those settings alone."""
        if self.policy_file is None:
            return StaticPolicy(self.base_policy())
        return FilePolicy(self.policy_file, base=self.base_policy(), poll_interval_s=self.policy_poll_s)
