"""The Avro single-object codec: round trips, and clear errors for bytes it cannot read."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.avro import avro_schema
from schemas.codec import HEADER_SIZE, MAGIC, Codec, default_codec
from schemas.errors import DecodeError
from schemas.messages import MESSAGE_TYPES, OperatorAlert, StepResult, SubmitTask

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=10,
)


@given(task_id=st.text(min_size=1, max_size=40), data=st.dictionaries(st.text(max_size=10), json_values, max_size=5),
       reply=st.none() | st.text(max_size=30))
@settings(max_examples=150, deadline=None)
def test_submissions_round_trip_exactly(task_id: str, data: dict[str, object], reply: str | None) -> None:
    codec = default_codec()
    message = SubmitTask(task_id=task_id, workflow="orders", input=data, reply_topic=reply)
    assert codec.decode(codec.encode(message)) == message


def test_encoding_is_single_object_with_the_writer_fingerprint() -> None:
    codec = default_codec()
    data = codec.encode(OperatorAlert(task_id="t", sequence=1, workflow="w", workflow_version=1,
                                      causation_id="c", reason="r"))
    assert data[:2] == MAGIC
    assert data[2:HEADER_SIZE] == codec.registry.latest("stepstream.OperatorAlert").fingerprint


def test_every_message_type_has_a_frozen_schema_matching_its_model() -> None:
    codec = Codec()  # raises SchemaError if a model changed without a new frozen version
    for model in MESSAGE_TYPES:
        assert codec.registry.latest(f"stepstream.{model.__name__}").schema == avro_schema(model)


@pytest.mark.parametrize(
    ("data", "kind"),
    [
        (b"", "corrupt"),
        (None, "corrupt"),
        (b"{\"json\": true}", "corrupt"),
        (MAGIC + b"\xff" * 8 + b"\x00", "unknown_schema"),
    ],
)
def test_unreadable_bytes_raise_a_decode_error_saying_why(data: bytes | None, kind: str) -> None:
    with pytest.raises(DecodeError) as caught:
        default_codec().decode(data)
    assert caught.value.kind == kind
    assert caught.value.reason


def test_truncated_and_padded_bodies_are_corrupt() -> None:
    codec = default_codec()
    good = codec.encode(StepResult(task_id="t", step="s", attempt_id="a", ok=True, output={"x": 1}))
    for broken in (good[:-3], good + b"\x00\x01"):
        with pytest.raises(DecodeError) as caught:
            codec.decode(broken)
        assert caught.value.kind == "corrupt"
