"""State store settings (``STEPSTREAM_STORE_*``) and the one way to name a store.

A store is named by a spec string, the same for the setting and for command-line options:

* ``postgresql://user@host:port/database`` (or ``postgres://``), optionally ``?schema=NAME``
  (default ``stepstream``): a schema of a PostgreSQL database;
* ``sqlite:///absolute/path.db``, ``sqlite:relative/path.db`` or a plain path: an SQLite file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from projections.migrations import DEFAULT_SCHEMA

if TYPE_CHECKING:
    from projections.store import Store

@dataclass(frozen=True)
class StoreSpec:
    kind: Literal["sqlite", "postgresql"]
    location: str  # the SQLite file, or the PostgreSQL URL without the schema parameter
    schema: str = DEFAULT_SCHEMA

    @classmethod
    def parse(cls, text: str) -> StoreSpec:
        parts = urlsplit(text)
        if parts.scheme in ("postgresql", "postgres"):
            query = parse_qsl(parts.query, keep_blank_values=True)
            schema = next((v for k, v in query if k == "schema"), DEFAULT_SCHEMA)
            if not schema.replace("_", "").isalnum():
                raise ValueError(f"store schema {schema!r}: letters, digits and '_' only")
            rest = urlencode([(k, v) for k, v in query if k != "schema"])
            return cls("postgresql", urlunsplit(parts._replace(query=rest)), schema)
        if parts.scheme == "sqlite":
            return cls("sqlite", text.removeprefix("sqlite:").removeprefix("//"))
        if "://" in text:
            raise ValueError(f"store {text!r}: expected postgresql://..., sqlite:PATH or a file path")
        return cls("sqlite", text)

    def open(self) -> Store:
        if self.kind == "postgresql":
            from projections.postgres import PostgresStore

            return PostgresStore(self.location, self.schema)
        from projections.store import SqliteStore

        return SqliteStore(Path(self.location))

    def __str__(self) -> str:
        if self.kind == "sqlite":
            return self.location
        return f"{self.location}{'&' if '?' in self.location else '?'}schema={self.schema}"


class StoreSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="STEPSTREAM_STORE_", frozen=True, extra="ignore")

    url: str | None = Field(default=None, description="the store (see the module doc); default: the SQLite file")
    path: Path | None = Field(default=None, description="SQLite file; default: <STEPSTREAM_HOME>/state.db")
    projector_group: str | None = Field(
        default=None, description="the projector's consumer group; default <prefix>projector. Two stores fed "
                                  "from one log (SQLite and PostgreSQL side by side) need two groups.")

    def sqlite_path(self, home: Path) -> Path:
        return self.path or home / "state.db"

    def spec(self, home: Path) -> StoreSpec:
        return StoreSpec.parse(self.url) if self.url else StoreSpec("sqlite", str(self.sqlite_path(home)))

    def open(self, home: Path) -> Store:
        return self.spec(home).open()
