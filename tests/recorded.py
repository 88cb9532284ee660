"""Recorded task histories: the files in ``tests/histories/`` and how a state is written down in them.

A recording is one JSON object per line, one task each: its id, workflow and version, its events exactly as
they stood on ``events`` (Avro single-object bytes, base64, with the type name for people reading the file),
and the state the scheduler folded from them when it was recorded. Keeping the bytes rather than a JSON
rendering of the models means a replay reads them as a restoring scheduler does, through the codec and every
stored writer schema, so a schema change that could no longer read an old event fails too.
"""

from __future__ import annotations

import base64
import dataclasses
import json
from collections.abc import Iterable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

from scheduler.decider import TaskState
from schemas.codec import default_codec
from schemas.messages import Event

HISTORIES = Path(__file__).parent / "histories"


@dataclasses.dataclass(frozen=True)
class RecordedTask:
    task_id: str
    workflow: str
    workflow_version: int
    events: tuple[bytes, ...]
    state: dict[str, Any]

    def decoded(self) -> list[Event]:
        """The events as a restoring scheduler reads them (any stored writer schema, resolved to today's)."""
        codec = default_codec()
        events = [codec.decode(value) for value in self.events]
        if not all(isinstance(event, Event) for event in events):
            raise ValueError(f"{self.task_id}: a recorded message is not an event")
        return events  # type: ignore[return-value]


def state_document(state: TaskState) -> dict[str, Any]:
    """A state as plain JSON values, so a recorded one compares with today's fold field by field."""
    return json.loads(json.dumps(dataclasses.asdict(state), default=_plain))  # type: ignore[no-any-return]


DERIVED = frozenset({"first_started_at"})
"""Fields added to the state after recordings were made whose value the fold derives from events those
recordings already hold (``first_started_at``: the step's first ``StepStarted``), so an old history folds
into a value for them that its recording could not show."""


def as_recorded(today: Any, recorded: Any) -> Any:
    """Today's state document in the shape of a recording made before fields were added to the state: a field
    the recording lacks is left out when it holds an empty value (None, 0, empty) -- what an old history folds
    into, since it has no event that could set it -- or is one of ``DERIVED``, and kept otherwise, so the
    comparison shows it."""
    if isinstance(today, dict) and isinstance(recorded, dict):
        return {key: as_recorded(value, recorded[key]) if key in recorded else value
                for key, value in today.items()
                if key in recorded or (key not in DERIVED and value not in (None, 0, "", [], {}))}
    if isinstance(today, list) and isinstance(recorded, list) and len(today) == len(recorded):
        return [as_recorded(t, r) for t, r in zip(today, recorded, strict=True)]
    return today


def _plain(value: object) -> object:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, frozenset):
        return sorted(value)
    raise TypeError(f"{type(value).__name__} has no JSON form in a recorded state")


def dump(tasks: Iterable[RecordedTask], path: Path) -> int:
    """Write ``tasks`` to ``path``, one line each; returns how many."""
    lines = [json.dumps({
        "task_id": task.task_id, "workflow": task.workflow, "workflow_version": task.workflow_version,
        "events": [{"type": type(event).__name__, "avro": base64.b64encode(value).decode()}
                   for value, event in zip(task.events, task.decoded(), strict=True)],
        "state": task.state,
    }, sort_keys=True) for task in tasks]
    path.write_text("".join(f"{line}\n" for line in lines))
    return len(lines)


def load(path: Path) -> Iterator[RecordedTask]:
    for line in path.read_text().splitlines():
        row = json.loads(line)
        yield RecordedTask(row["task_id"], row["workflow"], row["workflow_version"],
                           tuple(base64.b64decode(e["avro"]) for e in row["events"]), row["state"])


def recordings() -> list[Path]:
    return sorted(HISTORIES.glob("*.jsonl"))
