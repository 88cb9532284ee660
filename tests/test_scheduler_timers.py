"""The scheduler's timer queue without a broker: what it sends, when, and what it stops sending.

The decider decides whether a firing starts anything (tests/test_decider_timers.py); the queue's job is to
send each current timer's firing no earlier than its time, again while it stays current (a firing can be
lost), and never one the task has moved past.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta

import pytest

from scheduler.decider import same_timer
from scheduler.timers import TimerQueue
from schemas.avro import utc_millis
from schemas.messages import RetryDue


class Fired:
    """Records firings as they are sent; ``current`` is what the scheduler's state would say."""

    def __init__(self) -> None:
        self.sent: list[tuple[float, RetryDue]] = []
        self.current: dict[str, RetryDue] = {}
        self.failures = 0
        self.moves_on = False  # the task leaves its timer behind once fired, as the decider makes it do
        self.changed = threading.Condition()

    def send(self, _partition: int, due: RetryDue) -> None:
        if self.failures:
            self.failures -= 1
            raise RuntimeError("broker down")
        with self.changed:
            self.sent.append((time.time(), due))
            if self.moves_on:
                self.current.pop(due.task_id, None)
            self.changed.notify_all()

    def is_current(self, _partition: int, due: RetryDue) -> bool:
        current = self.current.get(due.task_id)
        return current is not None and same_timer(current, due)

    def wait_for(self, what: Callable[[], bool], timeout_s: float = 10.0) -> None:
        with self.changed:
            assert self.changed.wait_for(what, timeout=timeout_s), f"not within {timeout_s}s: {self.sent}"


@pytest.fixture
def fired() -> Fired:
    return Fired()


@pytest.fixture
def queue(fired: Fired) -> Iterator[TimerQueue]:
    stop = threading.Event()
    timers = TimerQueue(fired.send, lambda: None, fired.is_current, stop, resend_s=0.3)
    thread = threading.Thread(target=timers.run, daemon=True)
    thread.start()
    yield timers
    stop.set()
    timers.wake()
    thread.join(5)


def timer(task_id: str, in_s: float, attempt: int = 2) -> RetryDue:
    return RetryDue(task_id=task_id, step="pay", attempt=attempt,
                    not_before=utc_millis(datetime.now(UTC) + timedelta(seconds=in_s)))


def arm(queue: TimerQueue, fired: Fired, due: RetryDue) -> None:
    fired.current[due.task_id] = due
    queue.arm(0, due, due.task_id)


def test_a_timer_is_fired_no_earlier_than_its_time_and_again_while_it_stays_current(
        queue: TimerQueue, fired: Fired) -> None:
    due = timer("t1", 0.4)
    arm(queue, fired, due)
    fired.wait_for(lambda: len(fired.sent) >= 2)
    first, second = fired.sent[0][0], fired.sent[1][0]
    assert first >= due.not_before.timestamp()
    assert second - first >= 0.3, "resent after resend_s, in case the first was lost"
    assert all(same_timer(d, due) for _, d in fired.sent)

    fired.current.pop("t1")
    queue.arm(0, None, "t1")
    count = len(fired.sent)
    queue.arm(0, fired_after := timer("t2", 0.5), "t2")
    fired.current["t2"] = fired_after
    fired.wait_for(lambda: any(d.task_id == "t2" for _, d in fired.sent))
    assert [d.task_id for _, d in fired.sent[count:]] == ["t2"], "a timer no longer current is not resent"


def test_a_timer_replaced_or_forgotten_never_fires(queue: TimerQueue, fired: Fired) -> None:
    arm(queue, fired, timer("t1", 0.2, attempt=2))
    arm(queue, fired, replacement := timer("t1", 0.6, attempt=3))
    arm(queue, fired, timer("t3", 0.2))
    queue.forget({"t3"})
    fired.wait_for(lambda: bool(fired.sent))
    assert [d for _, d in fired.sent] == [replacement]
    assert len(queue) == 1


def test_arming_the_same_timer_again_after_each_decision_sends_it_once(queue: TimerQueue, fired: Fired) -> None:
    fired.moves_on = True
    due = timer("t1", 0.2)
    for _ in range(5):  # the scheduler arms the task's current timer after every decision on it
        arm(queue, fired, RetryDue(task_id="t1", step=due.step, attempt=due.attempt, not_before=due.not_before))
    arm(queue, fired, timer("later", 0.5))
    fired.wait_for(lambda: any(d.task_id == "later" for _, d in fired.sent))
    assert [d.task_id for _, d in fired.sent] == ["t1", "later"]


def test_a_firing_that_could_not_be_sent_is_sent_at_the_next_resend(queue: TimerQueue, fired: Fired) -> None:
    fired.failures = 1
    due = timer("t1", 0.1)
    arm(queue, fired, due)
    fired.wait_for(lambda: bool(fired.sent))
    assert fired.sent[0][0] >= due.not_before.timestamp() + 0.3
