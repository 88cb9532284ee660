"""A throwaway PostgreSQL cluster for the tests (and the replay benchmark), and the store fixtures.

The cluster is, in order: the server named by STEPSTREAM_TEST_POSTGRES_URL, else a new cluster made
with the installed server binaries (``initdb`` and ``pg_ctl`` on PATH or in Debian's
/usr/lib/postgresql/<version>/bin) in a temporary folder, on a free 127.0.0.1 port, stopped and deleted
at the end. Without either, the PostgreSQL tests are skipped, saying how to enable them.

initdb refuses to run as root, so as root the cluster belongs to an unprivileged user (``postgres``
where Debian's package made it, else ``nobody``) and every server command runs through ``runuser``.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from projections.settings import StoreSpec

SKIP_MESSAGE = ("PostgreSQL server binaries (initdb, pg_ctl) not found: install them (Debian: "
                "`apt-get install postgresql`; .ci/run does) or set STEPSTREAM_TEST_POSTGRES_URL to a server "
                "where the tests may create databases")


def server_binaries() -> Path | None:
    """The folder holding initdb and pg_ctl: on PATH, else the newest Debian versioned folder."""
    on_path = shutil.which("initdb")
    if on_path and shutil.which("pg_ctl"):
        return Path(on_path).parent
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"),
                      key=lambda p: [int(x) for x in re.findall(r"\d+", p.parent.parent.name)])
    return versions[-1].parent if versions else None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class ThrowawayPostgres:
    """A cluster of its own: ``start()`` returns the URL of its ``postgres`` database."""

    def __init__(self, bindir: Path) -> None:
        self.bindir = bindir
        self.root = Path(tempfile.mkdtemp(prefix="stepstream-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self.url = ""
        self._runner: list[str] = []
        if os.geteuid() == 0:
            user = "postgres" if _user_exists("postgres") else "nobody"
            entry = pwd.getpwnam(user)
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
            self._runner = ["runuser", "-u", user, "--"]

    def _run(self, *args: str) -> None:
        result = subprocess.run([*self._runner, *args], capture_output=True, text=True, cwd=self.root, timeout=120)
        if result.returncode != 0:
            log = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
            raise RuntimeError(f"{' '.join(args[:2])} failed ({result.returncode}):\n{result.stdout}\n"
                               f"{result.stderr}\n{log}")

    def start(self) -> str:
        self._run(str(self.bindir / "initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust",
                  "-E", "UTF8", "--locale=C", "--no-sync")
        for attempt in range(3):
            port = _free_port()
            options = (f"-c listen_addresses=127.0.0.1 -p {port} -c unix_socket_directories='' -c fsync=off "
                       "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200")
            try:
                self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-w",
                          "-t", "60", "-o", options, "start")
            except RuntimeError:
                if attempt == 2:
                    raise
                continue  # another process took the port meanwhile
            self.url = f"postgresql://postgres@127.0.0.1:{port}/postgres"
            return self.url
        raise AssertionError("unreachable")

    def stop(self) -> None:
        try:
            self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


def _user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
        return True
    except KeyError:
        return False


def create_database(server_url: str) -> str:
    """A new, empty database on the server; returns its URL."""
    name = f"t{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(sql.SQL("create database {}").format(sql.Identifier(name)))
    return server_url.rsplit("/", 1)[0] + "/" + name


def drop_database(database_url: str) -> None:
    server_url, name = database_url.rsplit("/", 1)
    with psycopg.connect(f"{server_url}/postgres", autocommit=True) as conn:
        conn.execute(sql.SQL("drop database if exists {} with (force)").format(sql.Identifier(name)))


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[str]:
    """URL of a server the tests may create databases on (see the module doc)."""
    external = os.environ.get("STEPSTREAM_TEST_POSTGRES_URL")
    if external:
        yield external
        return
    bindir = server_binaries()
    if bindir is None:
        if os.environ.get("CI"):  # CI installs them (.ci/run): missing there is a failure, not a skip
            pytest.fail(SKIP_MESSAGE)
        pytest.skip(SKIP_MESSAGE)
    cluster = ThrowawayPostgres(bindir)
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture
def postgres_url(postgres_server: str) -> Iterator[str]:
    """A database of its own for one test."""
    url = create_database(postgres_server)
    try:
        yield url
    finally:
        drop_database(url)


@pytest.fixture(params=["sqlite", "postgresql"])
def store_spec(request: pytest.FixtureRequest, tmp_path: Path) -> StoreSpec:
    """The test runs once per backend: an SQLite file, and a schema of a fresh PostgreSQL database."""
    if request.param == "sqlite":
        return StoreSpec("sqlite", str(tmp_path / "state.db"))
    return StoreSpec("postgresql", request.getfixturevalue("postgres_url"))
