"""What an agent process tells operators about each dependency it calls, every few seconds: the record on the
``dependencies`` topic (compacted, keyed by agent, dependency and process), read by the API for the console.

A snapshot is a report on live state, not a fact of any task's history: nothing is decided from it and no
projection is built from it, so it is JSON (orjson), for the people and tools that read it, rather than Avro.
``version`` lets a reader refuse a shape it does not know instead of misreading it.
"""

from __future__ import annotations

from typing import Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field

from schemas.messages import Timestamp


class DependencySnapshot(BaseModel):
    """One dependency of one agent in one process, over the last ``window_s`` seconds (rates) and now (state)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: Literal[1] = 1
    agent: str = Field(min_length=1)
    dependency: str = Field(min_length=1)
    instance: str = Field(min_length=1, description="the process: host and pid")
    at: Timestamp
    interval_s: float = Field(gt=0, description="how often this process reports: older than 3 of them is stale")
    window_s: float = Field(ge=0, description="the span the rates and latencies are measured over")
    calls_per_s: float = Field(ge=0)
    throttles_per_s: float = Field(ge=0, description="answers asking us to slow down (429, Retry-After)")
    failures_per_s: float = Field(ge=0, description="transient failures other than throttles")
    refusals_per_s: float = Field(ge=0, description="permanent failures: the service refused the request")
    latency_p50_ms: float | None = Field(default=None, ge=0, description="of calls; None: no call in the window")
    latency_p99_ms: float | None = Field(default=None, ge=0)
    breaker: Literal["closed", "half_open", "open"] | None = Field(default=None, description="None: no breaker")
    budget_remaining: float | None = Field(default=None, description="retries still allowed; None: no budget")
    in_use: float = Field(ge=0, description="attempts in flight, on average over the window")
    concurrency: int | None = Field(default=None, ge=1, description="attempts this agent runs at once, at most")
    calls_total: int = Field(ge=0)

    @property
    def key(self) -> str:
        return f"{self.agent}/{self.dependency}/{self.instance}"

    def encode(self) -> bytes:
        return orjson.dumps(self.model_dump(mode="json"))

    @classmethod
    def decode(cls, value: bytes) -> DependencySnapshot:
        return cls.model_validate(orjson.loads(value))

