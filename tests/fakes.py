"""Fakes for tests of pure logic. Clocks for clock-injected code (breaker, budget, pace, restarts, the agent's
retry loop): time moves only when the test says so, so timing is proven without sleeping and without flakes.
A recording output for a scheduler handling records without a broker: what it would have produced."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from schemas.messages import Message

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


@dataclass
class RecordingOutput:
    """Stands for the scheduler's transactional producer: what a batch sent, as messages and as raw records."""

    sent: list[tuple[str, Message]] = field(default_factory=list)
    raw: list[tuple[str, str | bytes | None, bytes | None, list[tuple[str, bytes]], int | None]] = \
        field(default_factory=list)

    def send(self, topic: str, message: Message, *, key: str | None = None, partition: int | None = None,
             headers: list[tuple[str, bytes]] | None = None) -> None:
        self.sent.append((topic, message))

    def send_raw(self, topic: str, key: str | bytes | None, value: bytes | None,
                 headers: list[tuple[str, bytes]] | None = None, *, partition: int | None = None) -> None:
        self.raw.append((topic, key, value, list(headers or []), partition))
