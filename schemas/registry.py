"""Every schema version ever frozen, found by name and by CRC-64-AVRO fingerprint.

Files are ``avro/stepstream.<Name>.v<N>.avsc``. A reader resolves the writer's schema (from the
fingerprint in each message) against the newest version of the same name, so data written by any
older version decodes into the current model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from fastavro import parse_schema
from fastavro.schema import fingerprint, to_parsing_canonical_form

from schemas.errors import SchemaError

AVRO_DIR = Path(__file__).with_name("avro")
_FILE = re.compile(r"^(?P<name>[A-Za-z0-9_.]+)\.v(?P<version>\d+)\.avsc$")


@dataclass(frozen=True)
class SchemaVersion:
    full_name: str
    version: int
    schema: dict[str, Any]
    parsed: Any
    fingerprint: bytes
    path: Path


def schema_fingerprint(schema: dict[str, Any]) -> bytes:
    """The 8 bytes of the single-object header: CRC-64-AVRO of the canonical form, little-endian."""
    return bytes.fromhex(fingerprint(to_parsing_canonical_form(schema), "CRC-64-AVRO"))


def load_version(path: Path) -> SchemaVersion:
    match = _FILE.match(path.name)
    if match is None:
        raise SchemaError(f"{path.name}: schema files are named <full name>.v<N>.avsc")
    schema = orjson.loads(path.read_bytes())
    full_name = f"{schema.get('namespace', '')}.{schema['name']}".lstrip(".")
    if full_name != match["name"]:
        raise SchemaError(f"{path.name} holds {full_name}")
    return SchemaVersion(
        full_name=full_name,
        version=int(match["version"]),
        schema=schema,
        parsed=parse_schema(schema),
        fingerprint=schema_fingerprint(schema),
        path=path,
    )


class SchemaRegistry:
    """The schema versions in one folder; loaded once, read-only after."""

    def __init__(self, directory: Path = AVRO_DIR) -> None:
        self.by_fingerprint: dict[bytes, SchemaVersion] = {}
        self.versions: dict[str, list[SchemaVersion]] = {}
        for path in sorted(directory.glob("*.avsc")):
            version = load_version(path)
            self.by_fingerprint[version.fingerprint] = version
            self.versions.setdefault(version.full_name, []).append(version)
        for versions in self.versions.values():
            versions.sort(key=lambda v: v.version)

    def latest(self, full_name: str) -> SchemaVersion:
        try:
            return self.versions[full_name][-1]
        except KeyError:
            raise SchemaError(f"no schema stored for {full_name}; run `python -m schemas.freeze`") from None
