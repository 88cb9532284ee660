"""The scheduler's changelog: its records carry every field of a task's state, unreadable ones are named, sensitive
outputs stay sealed in it, and a fold of the events past a checkpoint onto the records gives the full fold.

Pure: no broker (the restarts over a real broker are in tests/test_scheduler_restore.py).
"""

from __future__ import annotations

import dataclasses
import random
from datetime import UTC, datetime

import orjson
import pytest

from scheduler.changelog import (
    SavedTask,
    UnreadableRecord,
    decode_checkpoint,
    decode_task,
    encode_checkpoint,
    encode_task,
)
from scheduler.decider import StepState, TaskState, fold
from scheduler.quarantine import PartitionFold, Quarantine
from scheduler.sealing import EventSealer
from schemas.codec import default_codec
from schemas.messages import Event
from schemas.sealed import SEALED, TaskKey
from schemas.states import FINAL, StepStatus, TaskStatus
from tests.histories import history
from tests.recorded import load, recordings
from tests.test_quarantine import again
from tests.test_sensitive_inputs import KEYRING, REGISTRY

START = datetime(2026, 12, 1, tzinfo=UTC)
RECORDED = [task for path in recordings() for task in load(path)]


def test_every_recorded_state_and_its_settled_form_read_back_equal_from_a_changelog_record() -> None:
    for task in RECORDED:
        state = fold(task.decoded())
        assert state is not None
        forms = [state, state.settled()] if state.status in FINAL else [state]
        for form in forms:
            saved = SavedTask(form, None, form.sequence + 1)
            assert decode_task(encode_task(saved)) == saved, task.task_id


def test_a_record_carries_every_field_of_the_state_whatever_fields_it_has() -> None:
    state = fold(RECORDED[0].decoded())
    assert state is not None
    document = orjson.loads(encode_task(SavedTask(state, None, 1)))
    assert document["v"] == 1
    assert set(document["task"]["state"]) == {f.name for f in dataclasses.fields(TaskState)}
    assert set(document["task"]["state"]["steps"][0]) == {f.name for f in dataclasses.fields(StepState)}


def test_a_quarantine_without_a_state_reads_back() -> None:
    quarantine = Quarantine("t1", "StepSucceeded at 0:7 does not fold", "orders", 1, 9, "m-1", unfolded_sequence=7,
                            recorded=True)
    saved = SavedTask(None, quarantine, 10)
    assert decode_task(encode_task(saved)) == saved


def test_a_record_of_another_version_or_missing_a_field_is_unreadable_and_says_which_version() -> None:
    state = fold(RECORDED[0].decoded())
    assert state is not None
    document = orjson.loads(encode_task(SavedTask(state, None, 1)))
    with pytest.raises(UnreadableRecord, match="version 2"):
        decode_task(orjson.dumps({**document, "v": 2}))
    del document["task"]["state"]["input_digest"]
    with pytest.raises(UnreadableRecord, match="input_digest"):
        decode_task(orjson.dumps(document))
    with pytest.raises(UnreadableRecord, match="not JSON"):
        decode_task(b"\x00garbage")
    assert decode_checkpoint(encode_checkpoint(1234)) == 1234


def test_a_marked_step_output_is_sealed_in_the_record_and_opens_back_with_the_tasks_key() -> None:
    sealer = EventSealer(REGISTRY, KEYRING)
    key = TaskKey.generate()
    state = TaskState(task_id="t1", workflow="pay", workflow_version=1, status=TaskStatus.RUNNING, sequence=3,
                      input={"order_id": "o-1"}, input_digest="d", submitter=None, reply_topic=None,
                      steps=(StepState("charge", StepStatus.SUCCEEDED, attempt=1,
                                       output={"card_ref": "ref-9", "amount": 5}),),
                      current_step=None)
    record = encode_task(SavedTask(sealer.seal_state(state, key), None, 1))
    assert b"ref-9" not in record, "a marked output never reaches the changelog in clear"
    saved = decode_task(record).state
    assert saved is not None and saved.steps[0].output is not None
    assert SEALED in saved.steps[0].output["card_ref"] and saved.steps[0].output["amount"] == 5
    assert sealer.open_state(saved, key) == state
    assert sealer.open_state(saved, None) == saved, "an erased task's values stay sealed"


def histories_of(count: int, seed: int) -> list[list[Event]]:
    rng = random.Random(seed)
    return [history(f"task-{seed}-{i}", rng, START, in_flight=i % 3 == 0) for i in range(count)]


def tail_fold(tasks: list[list[Event]], cut: int) -> PartitionFold:
    """Each task saved after its first ``cut`` events (the last of them written with the record, so after the
    checkpoint), the rest of its events folded onto the record as a restore does."""
    codec = default_codec()
    saved: dict[str, TaskState] = {}
    reflected: dict[str, tuple[int, int]] = {}
    tail: list[Event] = []
    for events in tasks:
        head = events[:cut]
        state = fold(head)
        assert state is not None
        saved[state.task_id] = state.settled() if state.status in FINAL else state
        reflected[state.task_id] = (head[-1].sequence, state.sequence)
        tail += events[cut - 1:]
    partition = PartitionFold(codec, lambda event: event, saved, {}, reflected.get)
    for offset, event in enumerate(tail):
        partition.add(event.task_id.encode(), codec.encode(event), f"0:{offset}")
    return partition


def test_events_past_the_checkpoint_folded_onto_the_records_give_the_state_of_the_full_fold() -> None:
    tasks = histories_of(60, seed=5)
    partition = tail_fold(tasks, cut=2)
    for events in tasks:
        full = fold(events)
        assert full is not None
        assert partition.tasks[full.task_id] == (full.settled() if full.status in FINAL else full)
    assert partition.quarantined == {}
    assert partition.touched == {events[0].task_id for events in tasks if len(events) > 2}


def test_an_event_a_record_already_reflects_is_not_folded_twice_but_a_foreign_duplicate_is_quarantined() -> None:
    codec = default_codec()
    events = histories_of(1, seed=7)[0]
    state = fold(events)
    assert state is not None
    task = state.task_id
    partition = PartitionFold(codec, lambda event: event, {task: state}, {}, {task: (len(events), state.sequence)}.get)
    partition.add(task.encode(), codec.encode(events[-1]), "0:0")
    assert partition.tasks[task] == state and task not in partition.touched

    partition.add(task.encode(), codec.encode(again(events[-1], state.sequence + 1)), "0:1")
    assert task in partition.quarantined and task not in partition.tasks

