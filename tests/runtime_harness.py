"""Runs a ConsumerRuntime in a background thread for in-process tests."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from eventstore.runtime import ConsumerRuntime, Handler
from eventstore.settings import ConsumerSettings
from eventstore.topics import TopicLayout

FAST = ConsumerSettings(poll_timeout_s=0.1, commit_interval_ms=100, lag_interval_s=0.2,
                        retry_initial_backoff_s=0.05, retry_max_backoff_s=0.3, session_timeout_ms=6000)


@contextmanager
def running(bootstrap: str, layout: TopicLayout, topic: str, handler: Handler, *,
            kind: type[ConsumerRuntime] = ConsumerRuntime, group_id: str | None = None,
            **kwargs: Any) -> Iterator[ConsumerRuntime]:
    """A runtime of a group of its own, or of ``group_id`` (a second member joining a running one's group)."""
    runtime = kind(bootstrap=bootstrap, group_id=group_id or f"g-{uuid.uuid4().hex}", topics=[topic],
                   handler=handler, dlq_topic=layout.dlq, settings=FAST, **kwargs)
    errors: list[BaseException] = []

    def target() -> None:
        try:
            runtime.run()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    try:
        yield runtime
    finally:
        runtime.stop()
        thread.join(timeout=30)
        assert not thread.is_alive(), "runtime did not stop"
        if errors:
            raise errors[0]
