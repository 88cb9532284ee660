"""State store settings (``STEPSTREAM_STORE_*``)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class StoreSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="STEPSTREAM_STORE_", frozen=True, extra="ignore")

    path: Path | None = Field(default=None, description="SQLite file; default: <STEPSTREAM_HOME>/state.db")

    def sqlite_path(self, home: Path) -> Path:
        return self.path or home / "state.db"
