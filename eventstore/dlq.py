"""Dead letters: the original bytes, untouched, plus headers saying why and where from.

The record model of the DLQ topic lives here, with the headers it reads, so that every reader of that
topic (the projector, a rebuild, ``eventstore.dead_letters`` behind the operators' tools) shares one definition.
"""

from __future__ import annotations

import base64
import functools
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from confluent_kafka import Message as KafkaMessage

from eventstore.errors import StepstreamError
from schemas.codec import Codec
from schemas.errors import DecodeError

HEADER_PREFIX = "stepstream.dlq."

# Headers of a replay marker (under HEADER_PREFIX), and the one a replayed copy carries.
REPLAY_OF = "replay.of"
REPLAY_TO = "replay.to"
REPLAY_TIME = "replay.time"
REPLAYED_FROM_HEADER = "stepstream.replayed.from"
# Headers of a discard marker (under HEADER_PREFIX): the dead letter it discards, when, and the proposed data key
# it tombstoned on ``keys`` (its record key; empty when it had none left to shred).
DISCARD_OF = "discard.of"
DISCARD_TIME = "discard.time"
DISCARD_SHREDDED = "discard.shredded"


class InvalidEntry(StepstreamError):
    """Text that should name a dead letter by position and does not; the message shows the text."""


def parse_entry(text: str) -> tuple[int, int]:
    """``PARTITION:OFFSET`` of a dead letter."""
    partition, sep, offset = text.partition(":")
    if not sep or not partition.isdigit() or not offset.isdigit():
        raise InvalidEntry(f"ENTRY {text!r} is not PARTITION:OFFSET (e.g. 0:12)")
    return int(partition), int(offset)


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


@dataclass(frozen=True)
class DeadLetter:
    """One record of the DLQ topic: a dead letter, or a marker about one (``replay_of`` or ``discard_of`` set)."""

    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...]
    timestamp_ms: int

    @classmethod
    def from_message(cls, msg: KafkaMessage) -> DeadLetter:
        _kind, stamp = msg.timestamp()
        return cls(msg.partition(), msg.offset(), _bytes(msg.key()), _bytes(msg.value()),
                   tuple((k, v or b"") for k, v in msg.headers() or []), int(stamp))

    @functools.cached_property
    def info(self) -> dict[str, str]:
        """Our headers (reason, error.class, error.kind, origin.*, consumer.group, time, replay.*), as text."""
        return read_dlq_headers(list(self.headers))

    @property
    def replay_of(self) -> tuple[int, int] | None:
        of = self.info.get(REPLAY_OF)
        return parse_entry(of) if of else None

    @property
    def discard_of(self) -> tuple[int, int] | None:
        of = self.info.get(DISCARD_OF)
        return parse_entry(of) if of else None

    @property
    def is_marker(self) -> bool:
        """A record about a dead letter (its replay or its discard), not a dead letter itself."""
        return self.replay_of is not None or self.discard_of is not None

    @property
    def origin(self) -> tuple[str, int, int] | None:
        info = self.info
        try:
            return info["origin.topic"], int(info["origin.partition"]), int(info["origin.offset"])
        except (KeyError, ValueError):
            return None

    def time_ms(self, header: str) -> int:
        """A time header (ISO 8601, part of the log, so every replay reads the same) in epoch ms; the
        record's own timestamp when it is missing or malformed."""
        try:
            return int(datetime.fromisoformat(self.info[header]).timestamp() * 1000)
        except (KeyError, ValueError):
            return self.timestamp_ms

    @property
    def dead_at_ms(self) -> int:
        return self.time_ms("time")

    @property
    def task_id(self) -> str | None:
        return self.key.decode(errors="replace") if self.key is not None else None

    def message_type(self, codec: Codec) -> str | None:
        try:
            return type(codec.decode(self.value)).__name__
        except DecodeError:
            return None

    def summary(self) -> dict[str, Any]:
        origin = self.origin
        return {
            "entry": f"{self.partition}:{self.offset}", "partition": self.partition, "offset": self.offset,
            "key": self.task_id, "dead_at": _iso(self.dead_at_ms),
            "origin": None if origin is None else {"topic": origin[0], "partition": origin[1], "offset": origin[2]},
            "consumer_group": self.info.get("consumer.group"), "reason": self.info.get("reason"),
            "error_class": self.info.get("error.class"), "error_kind": self.info.get("error.kind"),
            "size": len(self.value or b""),
        }

    def detail(self, codec: Codec) -> dict[str, Any]:
        """Everything about it, for ``dlq show``: headers as text where they are UTF-8, and the value
        decoded to JSON where it is a message, else raw (hex and base64) with the reason it is not."""
        out = self.summary()
        out["headers"] = [{"key": k, **_raw_or_text(v)} for k, v in self.headers]
        if self.value is None:
            out["value"] = None
        else:
            try:
                message = codec.decode(self.value)
                out["value"] = {"type": type(message).__name__, "message": message.model_dump(mode="json")}
            except DecodeError as exc:
                out["value"] = {"undecodable": exc.reason, "kind": exc.kind, "hex": self.value.hex(),
                                "base64": base64.b64encode(self.value).decode()}
        return out


def _bytes(value: bytes | str | None) -> bytes | None:
    return value.encode() if isinstance(value, str) else value


def _iso(stamp_ms: int) -> str:
    return datetime.fromtimestamp(stamp_ms / 1000, UTC).isoformat(timespec="milliseconds")


def _raw_or_text(value: bytes) -> dict[str, str]:
    try:
        return {"text": value.decode()}
    except UnicodeDecodeError:
        return {"hex": value.hex(), "base64": base64.b64encode(value).decode()}
