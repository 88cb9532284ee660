"""Every recorded history still folds, with today's decider, into the state it had when it was recorded.

The recordings (``tests/histories/*.jsonl``, made by ``python -m tests.record_histories``) are histories of
real runs: tasks of a system that is live today, whose scheduler will fold exactly these events again at its
next restore. A change to ``evolve`` or to the schemas that would refuse one of them, or fold it into
another state, would strand or change a running task; this is where it shows, before a release does.
"""

from __future__ import annotations

import pytest

from demo.workflows import REGISTRY
from scheduler.decider import fold
from schemas.messages import Event, TaskQuarantined, TaskRejected, TaskReleased
from tests.recorded import RecordedTask, as_recorded, load, recordings, state_document

RECORDED = [task for path in recordings() for task in load(path)]


def test_there_are_recordings_to_replay() -> None:
    assert RECORDED, "tests/histories holds the recordings; make them with python -m tests.record_histories"


@pytest.mark.parametrize("task", RECORDED, ids=[task.task_id for task in RECORDED])
def test_a_recorded_history_folds_into_its_recorded_state(task: RecordedTask) -> None:
    state = fold(task.decoded())
    assert state is not None
    assert as_recorded(state_document(state), task.state) == task.state


def test_the_recordings_cover_every_workflow_version_and_every_event_the_scheduler_writes() -> None:
    versions = {(task.workflow, task.workflow_version) for task in RECORDED}
    assert versions == {(w.name, w.version) for w in REGISTRY.workflows()}
    recorded = {type(event) for task in RECORDED for event in task.decoded()}
    # Not in a demo run: a rejection needs the in-flight bound reached (tests/test_decider.py has them), a
    # quarantine a history that does not fold (tests/test_quarantine.py poisons one and releases it).
    unrecorded = {TaskRejected, TaskQuarantined, TaskReleased}
    assert _events() - unrecorded <= recorded, sorted(c.__name__ for c in _events() - unrecorded - recorded)


def _events() -> set[type[Event]]:
    found: set[type[Event]] = set()
    pending = list(Event.__subclasses__())
    while pending:
        cls = pending.pop()
        found.add(cls)
        pending.extend(cls.__subclasses__())
    return found
