"""Who is there to take an agent's requests: the members of each agent's consumer group, as the broker sees
them now.

A request handed to an agent nobody runs waits ``queued`` until its start-by passes, and nothing else says
why. The group's members are the answer at once: an agent process joins its group when it starts and leaves
it when it drains (or, killed, when its session times out), so zero members means no process of that agent
is running. Read at scrape and request time, cached briefly as the lag is (``projections.lag``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient

from eventstore.kafka_config import connection_config, kafka_error


class AgentGroups:
    """Members per agent; ``groups`` maps each agent's name to its consumer group's."""

    def __init__(self, bootstrap: str, groups: Mapping[str, str], *, cache_s: float = 2.0,
                 timeout_s: float = 5.0) -> None:
        self.groups = dict(groups)
        self.cache_s = cache_s
        self.timeout_s = timeout_s
        self._admin = AdminClient(connection_config(bootstrap))
        self._lock = threading.Lock()
        self._cached: tuple[float, dict[str, int]] | None = None

    def members(self) -> dict[str, int]:
        """How many consumers each agent's group has (0: none running, or the group never existed)."""
        with self._lock:
            if self._cached is not None and time.monotonic() - self._cached[0] < self.cache_s:
                return self._cached[1]
            deadline = time.monotonic() + self.timeout_s
            while True:
                try:
                    counts = self._described()
                    break
                except KafkaException as exc:
                    # A group's coordinator moves or loads (a fresh broker creating its offsets topic, a broker
                    # restarting): the broker says so and answers a moment later.
                    if not _coordinator_moving(exc) or time.monotonic() >= deadline:
                        raise
                    time.sleep(0.1)
            self._cached = (time.monotonic(), counts)
            return counts

    def _described(self) -> dict[str, int]:
        if not self.groups:
            return {}
        futures = self._admin.describe_consumer_groups(list(set(self.groups.values())),
                                                       request_timeout=self.timeout_s)
        return {agent: self._count(futures[group]) for agent, group in sorted(self.groups.items())}

    def _count(self, future: Future[Any]) -> int:
        try:
            description = future.result(self.timeout_s)
        except KafkaException as exc:  # a broker that says so rather than describing an empty group
            error = kafka_error(exc)
            if error is not None and error.code() == KafkaError.GROUP_ID_NOT_FOUND:
                return 0
            raise
        return len(description.members or [])


_COORDINATOR_MOVING = frozenset({KafkaError.NOT_COORDINATOR, KafkaError.COORDINATOR_NOT_AVAILABLE,
                                 KafkaError.COORDINATOR_LOAD_IN_PROGRESS})


def _coordinator_moving(exc: KafkaException) -> bool:
    error = kafka_error(exc)
    return error is not None and error.code() in _COORDINATOR_MOVING
