"""``stepstream up``'s restart policy: a back-off that doubles per recent crash, and giving up on a crash loop."""

from __future__ import annotations

from stepstream.local.restarts import RestartPolicy, RestartSettings
from tests.fakes import FakeClock


def policy(clock: FakeClock, **settings: float) -> RestartPolicy:
    return RestartPolicy(RestartSettings(**settings), clock=clock)


def test_each_crash_within_the_window_doubles_the_delay_up_to_the_maximum() -> None:
    clock = FakeClock(1000.0)
    restarts = policy(clock, max_restarts=10, restart_backoff_s=0.5, restart_max_backoff_s=3)
    delays = []
    for _ in range(5):
        delays.append(restarts.on_death("payments"))
        clock.now += 1
    assert delays == [0.5, 1.0, 2.0, 3.0, 3.0]


def test_a_service_that_dies_more_than_max_restarts_times_within_the_window_is_given_up() -> None:
    clock = FakeClock(1000.0)
    restarts = policy(clock, max_restarts=2, restart_window_s=60)
    assert restarts.on_death("scheduler") is not None
    assert restarts.on_death("scheduler") is not None
    assert restarts.on_death("scheduler") is None, "a third death within 60 s: it keeps crashing"
    assert restarts.recent_deaths("scheduler") == 3


def test_crashes_older_than_the_window_are_forgotten_and_services_are_counted_apart() -> None:
    clock = FakeClock(1000.0)
    restarts = policy(clock, max_restarts=1, restart_window_s=60, restart_backoff_s=0.5)
    assert restarts.on_death("projector") == 0.5
    assert restarts.on_death("supervisor") == 0.5, "another service's crash does not count"
    clock.now += 61
    assert restarts.on_death("projector") == 0.5, "the first crash left the window: back to the first delay"
