"""Every stored schema version reads data written by every older version of the same record."""

from __future__ import annotations

import io
from typing import Any

import pytest
from fastavro import schemaless_reader, schemaless_writer

from schemas.codec import MAGIC, default_codec
from schemas.messages import SubmitTask
from schemas.registry import SchemaRegistry, SchemaVersion

REGISTRY = SchemaRegistry()


def _sample(avro_type: Any) -> Any:
    """A value of an Avro type, for writing test data with an old schema."""
    if isinstance(avro_type, list):
        return _sample(next(t for t in avro_type if t != "null"))
    if isinstance(avro_type, dict):
        if avro_type.get("logicalType") == "timestamp-millis":
            return 1_700_000_000_000
        if avro_type.get("stepstream.json"):
            return '{"sample": 1}'
        if avro_type["type"] == "array":
            return [_sample(avro_type["items"])]
        if avro_type["type"] == "map":
            return {"k": _sample(avro_type["values"])}
        return _sample(avro_type["type"])
    return {"string": "sample", "long": 7, "double": 1.5, "boolean": True, "bytes": b"x"}[avro_type]


def _pairs() -> list[tuple[SchemaVersion, SchemaVersion]]:
    pairs = []
    for versions in REGISTRY.versions.values():
        for i, older in enumerate(versions):
            pairs.extend((older, newer) for newer in versions[i:])
    return pairs


@pytest.mark.parametrize(("older", "newer"), _pairs(), ids=lambda v: f"{v.full_name}.v{v.version}")
def test_newer_schema_reads_what_older_schema_wrote(older: SchemaVersion, newer: SchemaVersion) -> None:
    record = {f["name"]: _sample(f["type"]) for f in older.schema["fields"]}
    out = io.BytesIO()
    schemaless_writer(out, older.parsed, record)
    out.seek(0)
    read = schemaless_reader(out, older.parsed, newer.parsed)
    for name in record:
        if name in read:
            assert read[name] is not None
    new_fields = {f["name"] for f in newer.schema["fields"]} - set(record)
    for field in newer.schema["fields"]:
        if field["name"] in new_fields:
            assert read[field["name"]] == field["default"]


def test_the_codec_decodes_a_submission_written_with_schema_v1_into_the_current_model() -> None:
    v1 = REGISTRY.versions["stepstream.SubmitTask"][0]
    assert v1.version == 1 and len(REGISTRY.versions["stepstream.SubmitTask"]) >= 2
    out = io.BytesIO()
    out.write(MAGIC + v1.fingerprint)
    schemaless_writer(out, v1.parsed, {"message_id": "m1", "task_id": "t1", "occurred_at": 1_700_000_000_000,
                                       "workflow": "orders", "workflow_version": None, "input": '{"sku": "A"}'})
    decoded = default_codec().decode(out.getvalue())
    assert isinstance(decoded, SubmitTask)
    assert decoded.input == {"sku": "A"} and decoded.reply_topic is None and decoded.submitter is None
