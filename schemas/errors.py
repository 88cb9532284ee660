"""Errors of the schema layer. ``DecodeError`` marks bytes that can never be read: callers dead-letter them."""

from __future__ import annotations


class SchemaError(Exception):
    """A model and its stored Avro schemas disagree, or a schema file is malformed."""


class DecodeError(Exception):
    """The bytes are not a message this codec can read: corrupt, unknown fingerprint or schema-invalid."""

    def __init__(self, reason: str, kind: str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.kind = kind
