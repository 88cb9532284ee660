"""The README's main job: start the local broker, create the topics, append and replay a sample stream."""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

from confluent_kafka.admin import AdminClient
from rich.console import Console
from rich.table import Table

from eventstore.broker import LocalBroker
from eventstore.producer import EventProducer
from eventstore.replay import ReplayReader
from eventstore.settings import KafkaSettings
from eventstore.topics import TopicLayout, ensure_topics
from schemas.messages import Event, StepStarted, StepSucceeded, TaskAccepted, TaskCompleted, new_id, now


def _sample_history(task_id: str) -> list[Event]:
    common: dict[str, Any] = {"task_id": task_id, "workflow": "orders", "workflow_version": 1, "causation_id": new_id()}
    events: list[Event] = [TaskAccepted(sequence=1, input={"sku": "A-1", "qty": 2}, input_digest="demo", **common)]
    for index, step in enumerate(("reserve", "charge", "ship")):
        attempt_id = f"{task_id}:{step}:1"
        events.append(StepStarted(sequence=len(events) + 1, step=step, step_index=index, attempt=1,
                                  attempt_id=attempt_id, complete_by=now(), calls_allowed=3, **common))
        events.append(StepSucceeded(sequence=len(events) + 1, step=step, attempt_id=attempt_id,
                                    output={"ok": True}, calls=1, **common))
    events.append(TaskCompleted(sequence=len(events) + 1, output={"status": "shipped"}, **common))
    return events


def run_demo(tasks: int = 20) -> int:
    console = Console()
    settings = KafkaSettings()
    if settings.bootstrap_servers:
        bootstrap = settings.bootstrap_servers
        console.print(f"using the cluster at {bootstrap}")
    else:
        broker = LocalBroker(settings.home)
        started = time.monotonic()
        info = broker.start()
        bootstrap = info.bootstrap_servers
        console.print(f"local Kafka {info.bootstrap_servers} (pid {info.pid}) ready in "
                      f"{time.monotonic() - started:.1f}s; log: {broker.log_file}")
    layout = TopicLayout.from_settings(settings)
    created = ensure_topics(AdminClient({"bootstrap.servers": bootstrap}), layout.core_specs())
    console.print(f"topics: {', '.join(s.name for s in layout.core_specs())}"
                  f" ({len(created)} created now)")

    run_id = new_id()[:8]
    producer = EventProducer(bootstrap)
    appended = 0
    started = time.monotonic()
    for i in range(tasks):
        for event in _sample_history(f"demo-{run_id}-{i:03d}"):
            producer.send(layout.events, event)
            appended += 1
    producer.flush()
    console.print(f"appended {appended} events for {tasks} tasks in {time.monotonic() - started:.2f}s")

    started = time.monotonic()
    reader = ReplayReader(bootstrap, layout.events)
    histories: dict[str, list[str]] = defaultdict(list)
    for record in reader:
        if record.message.task_id.startswith(f"demo-{run_id}-"):
            histories[record.message.task_id].append(type(record.message).__name__)
    console.print(f"replayed {reader.stats.records} events from {layout.events} "
                  f"in {time.monotonic() - started:.2f}s")

    table = Table(title=f"replayed histories of this run ({len(histories)} tasks, first 5 shown)")
    table.add_column("task")
    table.add_column("events, in order")
    for task_id in sorted(histories)[:5]:
        table.add_row(task_id, " → ".join(histories[task_id]))
    console.print(table)
    in_order = all(len(h) == 8 and h[0] == "TaskAccepted" and h[-1] == "TaskCompleted" for h in histories.values())
    console.print("every task's history came back complete and in order" if in_order and len(histories) == tasks
                  else "[red]some histories are incomplete[/red]")
    return 0 if in_order and len(histories) == tasks else 1
