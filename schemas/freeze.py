"""``python -m schemas.freeze``: store a new schema version for every model whose shape changed.

Old versions are never touched, so data written with them stays readable.
"""

from __future__ import annotations

import sys

import orjson

from schemas.avro import NAMESPACE, avro_schema
from schemas.messages import MESSAGE_TYPES
from schemas.registry import AVRO_DIR, SchemaRegistry


def freeze() -> list[str]:
    registry = SchemaRegistry()
    written = []
    for model in MESSAGE_TYPES:
        full_name = f"{NAMESPACE}.{model.__name__}"
        current = avro_schema(model)
        versions = registry.versions.get(full_name, [])
        if versions and versions[-1].schema == current:
            continue
        path = AVRO_DIR / f"{full_name}.v{len(versions) + 1}.avsc"
        path.write_bytes(orjson.dumps(current, option=orjson.OPT_INDENT_2) + b"\n")
        written.append(path.name)
    return written


def main() -> int:
    for name in freeze():
        print(f"wrote {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
