"""The breaker and retry budget shared by concurrent attempts hold their limits under many threads."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from agents.breaker import BreakerPolicy, CircuitBreaker
from agents.budget import BudgetPolicy, RetryBudget
from agents.dependencies import DependencyRegistry
from agents.policy import DependencyPolicy


def _at_once(threads: int, action: Callable[[], bool]) -> int:
    """Run ``action`` once in each of ``threads`` threads released together; how many returned True."""
    gate = threading.Barrier(threads)

    def run() -> bool:
        gate.wait()
        return action()

    with ThreadPoolExecutor(threads) as pool:
        return sum(pool.map(lambda _: run(), range(threads)))


def test_concurrent_retries_never_spend_more_than_the_budget() -> None:
    budget = RetryBudget(BudgetPolicy(retries_per_window=25, ratio=0.0, window_s=60))
    assert _at_once(64, budget.try_acquire) == 25
    assert budget.remaining() == 0


def test_a_half_open_breaker_admits_exactly_its_probes_to_concurrent_callers() -> None:
    now = [0.0]
    breaker = CircuitBreaker(BreakerPolicy(failure_threshold=1, failure_rate=0.1, open_for_s=1, probes=3),
                             clock=lambda: now[0])
    assert breaker.try_acquire()
    breaker.record_failure()
    now[0] = 2.0  # the cool-down passed: half-open
    assert _at_once(32, breaker.try_acquire) == 3


def test_concurrent_first_uses_of_a_dependency_share_one_breaker_and_one_budget() -> None:
    registry = DependencyRegistry()
    policy = DependencyPolicy()
    seen: list[object] = []
    lock = threading.Lock()

    def get() -> bool:
        dependency = registry.get("orders", policy)
        with lock:
            seen.append(dependency)
        return True

    _at_once(32, get)
    assert len({id(d) for d in seen}) == 1
