"""Derives an Avro schema from a pydantic model, and converts between the two.

The pydantic model is what code uses; the Avro schema is what the wire carries. Deriving one from the
other keeps them from drifting; the frozen ``.avsc`` files under ``schemas/avro`` keep every version that
was ever written, so old data stays readable.
"""

from __future__ import annotations

import types
import typing
from datetime import UTC, datetime
from typing import Any, Union

import orjson
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from schemas.errors import SchemaError

NAMESPACE = "stepstream"

_PRIMITIVES: dict[Any, str] = {str: "string", int: "long", float: "double", bool: "boolean", bytes: "bytes"}
_TIMESTAMP = {"type": "long", "logicalType": "timestamp-millis"}
# Arbitrary JSON objects (task input, step output) travel as a JSON string: Avro has no "any".
_JSON = {"type": "string", "stepstream.json": True}


def _is_json_object(annotation: Any) -> bool:
    return typing.get_origin(annotation) is dict and typing.get_args(annotation)[1] is Any


def _avro_type(annotation: Any) -> Any:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:  # an optional Timestamp: the validator is pydantic's, the type is the first arg
        return _avro_type(args[0])
    if origin in (Union, types.UnionType):
        non_null = [a for a in args if a is not type(None)]
        if len(non_null) != 1 or len(args) != 2:
            raise SchemaError(f"only Optional[X] unions are supported, not {annotation}")
        return ["null", _avro_type(non_null[0])]
    if annotation in _PRIMITIVES:
        return _PRIMITIVES[annotation]
    if annotation is datetime:
        return dict(_TIMESTAMP)
    if _is_json_object(annotation):
        return dict(_JSON)
    if origin is list:
        return {"type": "array", "items": _avro_type(args[0])}
    if origin is dict and args[0] is str:
        return {"type": "map", "values": _avro_type(args[1])}
    if origin is typing.Literal and all(isinstance(a, str) for a in args):
        return "string"
    raise SchemaError(f"no Avro mapping for {annotation}")


def _field_schema(name: str, field: FieldInfo) -> dict[str, Any]:
    schema: dict[str, Any] = {"name": name, "type": _avro_type(field.annotation)}
    if field.description:
        schema["doc"] = field.description
    if not field.is_required() and field.default_factory is None:
        default = field.default
        if isinstance(schema["type"], list):
            if default is not None:
                raise SchemaError(f"{name}: an optional field must default to None")
        elif isinstance(default, (str, int, float, bool)) or default is None:
            pass
        else:
            raise SchemaError(f"{name}: default {default!r} cannot be written as an Avro default")
        schema["default"] = default
    elif field.default_factory in (list, dict):
        # An empty array or map: a reader of data written before the field existed needs the default (Avro
        # drops defaults from the canonical form, so adding one leaves the fingerprint as it was).
        schema["default"] = field.default_factory()  # type: ignore[call-arg]
    return schema


def avro_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The Avro record schema of a model's current shape."""
    return {
        "type": "record",
        "name": model.__name__,
        "namespace": NAMESPACE,
        "doc": (model.__doc__ or "").strip().splitlines()[0] if model.__doc__ else "",
        "fields": [_field_schema(name, field) for name, field in model.model_fields.items()],
    }


def json_fields(model: type[BaseModel]) -> frozenset[str]:
    """Fields carried as JSON strings, which the codec dumps and loads around Avro."""
    return frozenset(
        name
        for name, field in model.model_fields.items()
        if _is_json_object(field.annotation)
        or any(_is_json_object(a) for a in typing.get_args(field.annotation))
    )


def to_record(message: BaseModel, json_names: frozenset[str]) -> dict[str, Any]:
    record = message.__dict__.copy()  # the field values as they are; dict(model) costs 40x more
    for name in json_names:
        value = record[name]
        if value is not None:
            record[name] = orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()
    return record


def from_record(record: dict[str, Any], json_names: frozenset[str]) -> dict[str, Any]:
    for name in json_names:
        value = record.get(name)
        if isinstance(value, str):
            record[name] = orjson.loads(value)
    return record


def utc_millis(value: datetime) -> datetime:
    """Avro timestamp-millis keeps milliseconds in UTC; truncating up front makes round trips exact."""
    if value.tzinfo is UTC and value.microsecond % 1000 == 0:
        return value  # already in shape: what the Avro decoder returns, so the common case stays cheap
    if value.tzinfo is None:
        raise ValueError("timestamps must carry a time zone")
    value = value.astimezone(UTC)
    return value.replace(microsecond=value.microsecond // 1000 * 1000)
