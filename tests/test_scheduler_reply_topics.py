"""A submitter's reply topic is made before the scheduler produces anything for the command that may answer on
it. Made lazily with the status update, a creation that failed (a timeout under load) raised after the command's
events were already in the transaction, and the runtime's retry of the command sent them a second time."""

from __future__ import annotations

from typing import Any

import pytest

from eventstore.errors import InfrastructureError
from eventstore.partitioning import partition_of
from eventstore.runtime import Record
from eventstore.topics import TopicLayout, TopicSpec
from scheduler.decider import Limits
from scheduler.service import Scheduler
from schemas.messages import Event, StatusUpdate, SubmitTask
from tests.fakes import RecordingOutput
from tests.workflows import REGISTRY


def test_a_reply_topic_that_cannot_be_made_fails_the_command_before_its_output_so_its_retry_sends_each_event_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    layout = TopicLayout(prefix="replies.", partitions=3)
    made = Scheduler(bootstrap="127.0.0.1:9", layout=layout, registry=REGISTRY, limits=Limits())
    made._known_topics.update(layout.agent(agent) for agent in REGISTRY.agents)  # no broker: made "at start"
    attempts: list[str] = []

    def ensure_topics(_admin: Any, specs: list[TopicSpec], _replication: int = 1) -> list[str]:
        attempts.extend(spec.name for spec in specs)
        if len(attempts) == 1:
            raise InfrastructureError(f"creating topic {specs[0].name} failed: timed out")
        return [spec.name for spec in specs]

    monkeypatch.setattr("scheduler.service.ensure_topics", ensure_topics)
    command = SubmitTask(task_id="t-1", workflow="orders", workflow_version=1, submitter="shop",
                         input={"order_id": "t-1", "sku": "A-1", "qty": 1, "amount": 10})
    record = Record(layout.inbox, partition_of(command.task_id, layout.partitions), 0, command.task_id, command, [])
    output = RecordingOutput()

    with pytest.raises(InfrastructureError):
        made.handle(record, output)  # type: ignore[arg-type]
    assert output.sent == [], "nothing of the command is produced before its reply topic exists"
    made.handle(record, output)  # type: ignore[arg-type]  # the runtime retries the same record

    assert attempts == [layout.status("shop")] * 2
    events = [message for topic, message in output.sent if topic == layout.events]
    assert isinstance(events[0], Event)
    assert [e.sequence for e in events if isinstance(e, Event)] == list(range(1, len(events) + 1))
    assert [m.status for t, m in output.sent if t == layout.status("shop") and isinstance(m, StatusUpdate)] == \
        ["accepted"]
