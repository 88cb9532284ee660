"""The cluster id a new local broker or cluster is formatted with."""

from __future__ import annotations

import uuid

import pytest

from eventstore import broker


def test_a_new_cluster_id_never_starts_with_a_dash_which_the_format_tool_would_take_for_an_option(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dashed = uuid.UUID(bytes=b"\xf8" + bytes(15))  # encodes to "-AAA...": the case that failed one run in 64
    plain = uuid.UUID(bytes=bytes(range(16)))
    drawn = iter([dashed, plain])
    monkeypatch.setattr(broker.uuid, "uuid4", lambda: next(drawn))
    assert broker.new_cluster_id() == "AAECAwQFBgcICQoLDA0ODw"
