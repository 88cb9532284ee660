"""Fake clocks for tests of clock-injected code (breaker, budget, pace, restarts, the agent's retry loop):
time moves only when the test says so, so timing is proven without sleeping and without flakes."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

EPOCH = datetime(2030, 1, 1, tzinfo=UTC)
"""The wall-clock instant a :class:`FakeTime` at 0 stands for."""


class FakeClock:
    """A monotonic clock: call it for the time; ``advance`` it, or set ``now``."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class FakeTime(FakeClock):
    """Both of an agent's clocks, in step: ``monotonic`` seconds, and the wall clock ``wall`` that many seconds
    after :data:`EPOCH`; its ``sleep`` advances them (and is never woken by a drain)."""

    def monotonic(self) -> float:
        return self.now

    def wall(self) -> datetime:
        return EPOCH + timedelta(seconds=self.now)

    def sleep(self, seconds: float) -> bool:
        self.now += seconds
        return False
