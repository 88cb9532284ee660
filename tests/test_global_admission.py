"""The API's global admission estimate over a real SQLite store: what it counts and when it forgets."""

from __future__ import annotations

import random
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from eventstore.topics import TopicLayout
from projections.store import Positioned, SqliteStore
from schemas.messages import TaskAccepted
from stepstream.http.admission import GlobalAdmission
from tests.histories import history

LAYOUT = TopicLayout(prefix="adm.", partitions=3)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SqliteStore]:
    opened = SqliteStore(tmp_path / "state.db")
    try:
        yield opened
    finally:
        opened.close()


def _accept(store: SqliteStore, task_id: str, offset: int) -> None:
    accepted = TaskAccepted(task_id=task_id, sequence=1, workflow="orders", workflow_version=1, causation_id="c",
                            input={}, input_digest="d")
    store.apply_events(LAYOUT.events, [Positioned(0, offset, accepted)])


def test_tasks_let_through_count_until_the_store_shows_them_so_a_burst_cannot_overshoot(store: SqliteStore) -> None:
    live = history("live-1", random.Random(1), datetime.now(UTC) - timedelta(minutes=1), in_flight=True)
    store.apply_events(LAYOUT.events, [Positioned(0, i, e) for i, e in enumerate(live)])
    admission = GlobalAdmission(store, None, LAYOUT, bound=3, refresh_s=0)  # re-read on every call
    assert admission.refuse("a") is None
    assert admission.refuse("b") is None
    refusal = admission.refuse("c")
    assert refusal is not None and "about 3 tasks" in refusal and "limit is 3" in refusal
    # "a" is decided and projected: counted once (as live), not twice.
    _accept(store, "a", 100)
    assert admission.refuse("c") is not None
    admission.release("b")  # the scheduler refused it: it will not be in flight
    assert admission.refuse("c") is None


def test_a_task_let_through_but_never_seen_is_forgotten_after_a_while(store: SqliteStore) -> None:
    now = [100.0]
    admission = GlobalAdmission(store, None, LAYOUT, bound=1, refresh_s=0, forget_after_s=300, clock=lambda: now[0])
    assert admission.refuse("lost") is None
    now[0] += 299
    assert admission.refuse("next") is not None, "still counted within forget_after_s"
    now[0] += 2
    assert admission.refuse("next") is None, "forgotten past it"
