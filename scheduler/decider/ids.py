"""The derived identifiers of the decider: event ids, attempt locks, idempotency keys, submission digests.

All are pure functions of a task's own data, so deciding the same command again yields the same ids;
the agents and the scheduler service build the same keys from here, so they live apart from any handler.
"""

from __future__ import annotations

import hashlib
import uuid
from typing import Any

import orjson

_EVENT_IDS = uuid.uuid5(uuid.NAMESPACE_URL, "urn:stepstream:event")


def event_id(task_id: str, sequence: int) -> str:
    """uuid5(task id, sequence): unique within the log (a task's sequence numbers never repeat) and the same
    every time the same decision is made again."""
    return uuid.uuid5(_EVENT_IDS, f"{task_id}\x00{sequence}").hex


def input_digest(workflow: str, version: int | None, input: dict[str, Any]) -> str:
    """SHA-256 of the immutable submission data in canonical JSON, to tell a repeat from a contradiction.

    ``decide`` always passes the pinned version, so a repeat that asks for "latest" (``None``) after a
    newer version was registered still matches the task it repeats.
    """
    canonical = orjson.dumps(
        {"workflow": workflow, "workflow_version": version, "input": input}, option=orjson.OPT_SORT_KEYS
    )
    return hashlib.sha256(canonical).hexdigest()


def attempt_id(task_id: str, step: str, attempt: int) -> str:
    """The lock of one attempt (``locked_by``): results and recoveries naming another one change nothing."""
    return f"{task_id}:{step}:{attempt}"


def compensation_attempt_id(task_id: str, step: str, attempt: int) -> str:
    """The lock of one compensation attempt; ``undo`` keeps it apart from every forward attempt id."""
    return f"{task_id}:{step}:undo:{attempt}"


def idempotency_key(task_id: str, step: str) -> str:
    """The key the remote service deduplicates a step's calls by: the same across all its attempts."""
    return f"{task_id}:{step}"


def compensation_idempotency_key(task_id: str, step: str) -> str:
    """The key of a step's compensating call: stable across its attempts, distinct from the step's own."""
    return f"{task_id}:{step}:undo"
