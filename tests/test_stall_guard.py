"""A call that blocks past its own timeout ends the process for a restart; one that returns in time does not."""

from __future__ import annotations

import threading

from eventstore.stall import stall_guard


def test_a_call_still_blocked_at_the_limit_gives_up_on_the_process() -> None:
    gave_up = threading.Event()
    with stall_guard(0.05, "a commit that hangs", give_up=gave_up.set):
        assert gave_up.wait(5), "the guard fires while the call is still stuck inside the block"


def test_a_call_that_returns_in_time_leaves_the_process_alone() -> None:
    gave_up = threading.Event()
    with stall_guard(0.2, "a commit that returns", give_up=gave_up.set):
        pass
    assert not gave_up.wait(0.5), "the guard was cancelled when the block ended"
