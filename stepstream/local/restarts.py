"""When ``stepstream up`` starts a service that died again, and when it gives up on one that keeps dying.

A crash is usually one bad moment (a broker restart, a killed process): the service is started again after
a back-off that doubles with each crash in the window, so a crash loop does not spin. A service that died
more than ``max_restarts`` times within ``window_s`` is broken, not unlucky: restarting it forever would
hide that, so ``up`` reports it and stops with a non-zero exit, as supervisord's ``startretries`` and
systemd's ``StartLimitBurst`` do.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class RestartSettings(BaseSettings):
    """``STEPSTREAM_UP_*``: how ``stepstream up`` restarts the services it runs."""

    model_config = SettingsConfigDict(env_prefix="STEPSTREAM_UP_", frozen=True, extra="ignore")

    max_restarts: int = Field(default=5, ge=0, description="restarts of one service within the window")
    restart_window_s: float = Field(default=60.0, gt=0)
    restart_backoff_s: float = Field(default=0.5, gt=0, description="the first restart's delay; doubled per crash")
    restart_max_backoff_s: float = Field(default=10.0, gt=0)


@dataclass
class RestartPolicy:
    """Per service, the times it died recently; each new death gets a delay before its restart, or None."""

    settings: RestartSettings
    clock: Callable[[], float] = time.monotonic
    _deaths: dict[str, deque[float]] = field(default_factory=dict)

    def on_death(self, name: str) -> float | None:
        """Record that ``name`` died now: seconds to wait before starting it again, or None to give up."""
        now = self.clock()
        deaths = self._deaths.setdefault(name, deque())
        deaths.append(now)
        while deaths and deaths[0] <= now - self.settings.restart_window_s:
            deaths.popleft()
        if len(deaths) > self.settings.max_restarts:
            return None
        backoff: float = self.settings.restart_backoff_s * 2.0 ** (len(deaths) - 1)
        return min(backoff, self.settings.restart_max_backoff_s)

    def recent_deaths(self, name: str) -> int:
        return len(self._deaths.get(name, ()))
