"""Dead letters: the original bytes, untouched, plus headers saying why and where from."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

HEADER_PREFIX = "stepstream.dlq."


def dlq_headers(*, reason: str, error_class: str, kind: str, topic: str, partition: int, offset: int,
                group: str, original: list[tuple[str, bytes]] | None = None) -> list[tuple[str, bytes]]:
    ours = {
        "reason": reason[:4000],
        "error.class": error_class,
        "error.kind": kind,
        "origin.topic": topic,
        "origin.partition": str(partition),
        "origin.offset": str(offset),
        "consumer.group": group,
        "time": datetime.now(UTC).isoformat(),
    }
    return [*(original or []), *((HEADER_PREFIX + k, v.encode()) for k, v in ours.items())]


def read_dlq_headers(headers: list[tuple[str, bytes]] | None) -> dict[str, Any]:
    """The reason headers of a dead letter, without the prefix, as text."""
    return {k[len(HEADER_PREFIX):]: v.decode() for k, v in headers or [] if k.startswith(HEADER_PREFIX)}
