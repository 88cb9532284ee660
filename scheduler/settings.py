"""Scheduler settings (``STEPSTREAM_SCHEDULER_*``)."""

from __future__ import annotations

import importlib

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from eventstore.errors import StepstreamError
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
        """The registry ``workflows`` names; WorkflowsUnloadable, in one line that says how to fix it, when
        its module does not import or holds no such registry (a newcomer's first mistake, not a traceback)."""
        module_name, _, attribute = self.workflows.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise WorkflowsUnloadable(
                f"workflows {self.workflows}: cannot import {module_name} ({exc}); it must be importable from "
                "the project folder (the one holding stepstream.toml, where stepstream runs) or from PYTHONPATH"
            ) from None
        registry = getattr(module, attribute, None)
        if not isinstance(registry, WorkflowRegistry):
            raise WorkflowsUnloadable(f"workflows {self.workflows}: {module_name}.{attribute} is "
                                      f"{type(registry).__name__}, not a WorkflowRegistry")
        return registry


class WorkflowsUnloadable(StepstreamError):
    """The configured workflows (STEPSTREAM_SCHEDULER_WORKFLOWS, or a project's ``workflows``) cannot be
    loaded: the message names the setting's value and what to do."""
