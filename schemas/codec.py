"""Avro single-object encoding (magic ``C3 01`` + 8-byte writer fingerprint + Avro binary body).

The fingerprint makes every message self-describing, so any reader with the schema folder can decode
what any writer version produced, without a schema registry service.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastavro import schemaless_reader, schemaless_writer
from pydantic import ValidationError

from schemas.avro import NAMESPACE, avro_schema, from_record, json_fields, to_record
from schemas.errors import DecodeError, SchemaError
from schemas.messages import MESSAGE_TYPES, Message
from schemas.registry import SchemaRegistry, SchemaVersion

MAGIC = b"\xc3\x01"
HEADER_SIZE = len(MAGIC) + 8


@dataclass(frozen=True)
class _Binding:
    model: type[Message]
    latest: SchemaVersion
    json_names: frozenset[str]
    # The model's validator itself: ``model_validate`` is a Python wrapper around it, a tenth of a decode.
    validate: Callable[[Any], Message]


class Codec:
    """Encodes models with their newest stored schema; decodes any stored version into the model."""

    def __init__(self, registry: SchemaRegistry | None = None,
                 models: tuple[type[Message], ...] = MESSAGE_TYPES) -> None:
        self.registry = registry or SchemaRegistry()
        self._by_model: dict[type[Message], _Binding] = {}
        self._by_name: dict[str, _Binding] = {}
        for model in models:
            full_name = f"{NAMESPACE}.{model.__name__}"
            latest = self.registry.latest(full_name)
            if latest.schema != avro_schema(model):
                raise SchemaError(
                    f"{model.__name__} changed since schema v{latest.version} was frozen: "
                    "run `python -m schemas.freeze` to store a new version"
                )
            binding = _Binding(model, latest, json_fields(model), model.__pydantic_validator__.validate_python)
            self._by_model[model] = binding
            self._by_name[full_name] = binding

    def encode(self, message: Message) -> bytes:
        binding = self._by_model[type(message)]
        out = io.BytesIO()
        out.write(MAGIC)
        out.write(binding.latest.fingerprint)
        schemaless_writer(out, binding.latest.parsed, to_record(message, binding.json_names))
        return out.getvalue()

    def decode(self, data: bytes | None) -> Message:
        """Raises DecodeError, whose ``kind`` says why: corrupt, unknown_schema or schema_invalid."""
        if data is None or len(data) < HEADER_SIZE or not data.startswith(MAGIC):
            raise DecodeError("not Avro single-object encoded (missing C3 01 header)", "corrupt")
        writer = self.registry.by_fingerprint.get(data[2:HEADER_SIZE])
        if writer is None:
            raise DecodeError(f"unknown writer schema fingerprint {data[2:HEADER_SIZE].hex()}", "unknown_schema")
        binding = self._by_name.get(writer.full_name)
        if binding is None:
            raise DecodeError(f"{writer.full_name} is not a message this service reads", "unknown_schema")
        body = io.BytesIO(data)
        body.seek(HEADER_SIZE)
        try:
            record: Any = schemaless_reader(body, writer.parsed, binding.latest.parsed)
        except Exception as exc:
            raise DecodeError(f"corrupt Avro body for {writer.full_name}: {exc!r}", "corrupt") from exc
        if body.tell() != len(data):
            raise DecodeError(f"{len(data) - body.tell()} trailing bytes after the Avro body", "corrupt")
        try:
            return binding.validate(from_record(record, binding.json_names))
        except (ValidationError, ValueError) as exc:
            raise DecodeError(f"schema-invalid {writer.full_name}: {exc}", "schema_invalid") from exc


_default: Codec | None = None


def default_codec() -> Codec:
    """One codec per process: building it parses every stored schema."""
    global _default
    if _default is None:
        _default = Codec()
    return _default
