"""Scheduler settings (``STEPSTREAM_SCHEDULER_*``)."""

from __future__ import annotations

import importlib

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from scheduler.decider import DEFAULT_MAX_IN_FLIGHT
from scheduler.workflow import WorkflowRegistry


class SchedulerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="STEPSTREAM_SCHEDULER_", frozen=True, extra="ignore")

    workflows: str = Field(default="demo.workflows:REGISTRY", pattern=r"^[\w.]+:\w+$",
                           description="module:attribute of the WorkflowRegistry to run")
    max_in_flight: int = Field(default=DEFAULT_MAX_IN_FLIGHT, ge=1, description="admission bound per inbox "
                               "partition (the default's reasoning: scheduler.decider.DEFAULT_MAX_IN_FLIGHT)")
    instance: str | None = Field(default=None, pattern=r"^[\w.-]+$",
                                 description="stable name of this scheduler; a restart fences its predecessor "
                                 "(unset: the lowest slot free on this host, scheduler/instance.py)")

    def load_registry(self) -> WorkflowRegistry:
        module_name, _, attribute = self.workflows.partition(":")
        registry = getattr(importlib.import_module(module_name), attribute)
        if not isinstance(registry, WorkflowRegistry):
            raise TypeError(f"{self.workflows} is a {type(registry).__name__}, not a WorkflowRegistry")
        return registry
