"""Supervisor settings (``STEPSTREAM_SUPERVISOR_*``)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class SupervisorSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="STEPSTREAM_SUPERVISOR_", frozen=True, extra="ignore")

    cadence_s: float = Field(default=5.0, gt=0, description="time between scans")
    window_s: float = Field(default=24 * 3600, gt=0, description="how far back a scan looks for expired steps")
    page_size: int = Field(default=200, ge=1)
    resend_after_s: float = Field(default=30.0, gt=0,
                                  description="wait before asking again for the same attempt (doubles each time)")
    resend_max_s: float = Field(default=600.0, gt=0, description="the longest wait between asks for one attempt")
    session_timeout_ms: int = Field(default=10000, ge=1000, description="how fast a dead leader is replaced")
