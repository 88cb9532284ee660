"""What the supervisor already asked for, so a lagging projection does not multiply recovery requests.

After a ``RecoverStep`` the expired attempt stays ``processing`` in the state store until the scheduler has
read the request and the projector has written its answer. While the projection lags, every scan finds the
same attempt again; asking each time (every cadence) once sent 8,752 requests for 643 timeouts, each one
more message for the scheduler to read and ignore. So each attempt is asked again only after a back-off
that doubles with every ask (``first_s``, 2 x, 4 x ... up to ``max_s``): a request lost with a leader that
died, or dropped by a scheduler crash, is still asked again, while a long lag costs a handful of requests,
not one per scan.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class _Asked:
    at: float
    times: int


class RecoveryAsks:
    """Attempt id -> when it was last asked and how often. Not thread-safe: the scan loop owns it."""

    def __init__(self, first_s: float, max_s: float) -> None:
        self.first_s = first_s
        self.max_s = max(first_s, max_s)
        self._asked: dict[str, _Asked] = {}

    def due(self, attempt_id: str, now: float) -> bool:
        """Ask for ``attempt_id`` now? Yes the first time, then once its back-off has passed."""
        asked = self._asked.get(attempt_id)
        return asked is None or now - asked.at >= self.backoff_s(asked.times)

    def backoff_s(self, times: int) -> float:
        """The wait after the ``times``-th request before the next one."""
        return float(min(self.max_s, self.first_s * 2 ** min(times - 1, 30)))

    def asked(self, attempt_id: str, now: float) -> None:
        previous = self._asked.get(attempt_id)
        self._asked[attempt_id] = _Asked(now, 1 if previous is None else previous.times + 1)

    def keep_only(self, attempt_ids: set[str]) -> None:
        """Forget the attempts a whole scan no longer found: recovered, or out of the window."""
        self._asked = {a: asked for a, asked in self._asked.items() if a in attempt_ids}

    def __len__(self) -> int:
        return len(self._asked)
