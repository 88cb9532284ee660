"""A transactional outbox for PostgreSQL: submit tasks in the same transaction as the application's own write.

The problem it solves: a database commit and a Kafka produce cannot be one atomic act. Commit first and
crash before the produce, and the order exists with no task; produce first and roll back, and a task runs
for an order that does not exist. The outbox makes the submission a row of the application's database:

* ``install(conn, schema)`` creates ``<schema>.outbox`` (idempotent; safe to run concurrently).
* ``enqueue(conn, submission)`` inserts the encoded ``SubmitTask`` on the application's connection, inside
  its transaction: the business row and the submission commit together or not at all.
* ``OutboxRelay`` claims unsent rows in id order (``FOR UPDATE SKIP LOCKED``, a batch at a time), produces
  them to ``inbox`` keyed by task id with the idempotent producer, waits for every acknowledgement
  (acks=all), then deletes them (or marks them sent) in the transaction that claimed them. A row whose
  marked input was sealed under a new data key holds that key wrapped: the relay proposes it on ``keys``
  and waits for the acknowledgement before producing the row's submission, which goes without it
  (``eventstore.keys``), so ``inbox`` never holds a data key.

Delivery is at least once: a relay that dies after producing and before its commit leaves the rows
unsent, and the next relay produces them again. That is harmless because the row carries the task id,
fixed at enqueue: the scheduler treats the same task id with the same data as a no-op. Several relays may
run side by side; SKIP LOCKED hands each row to one of them at a time.

The table lives in its own schema (default ``stepstream_outbox``), never in the state store's schema: a
projections rebuild replaces that schema wholesale.
"""

from __future__ import annotations

import functools
import re
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import urlsplit

import psycopg
import structlog
from confluent_kafka import KafkaException
from prometheus_client import Counter, Gauge
from psycopg import pq
from psycopg import sql as pgsql
from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from eventstore.errors import InfrastructureError, StepstreamError
from eventstore.health import HEALTH
from eventstore.keys import KeyProposer
from eventstore.producer import EventProducer
from projections.settings import StoreSettings, StoreSpec
from scheduler.sealing import SubmissionSealer
from scheduler.settings import SchedulerSettings
from scheduler.workflow import WorkflowRegistry
from schemas.codec import Codec, default_codec
from schemas.errors import DecodeError
from schemas.messages import SubmitTask
from schemas.sealed import EncryptionSettings, Keyring, SealingError
from stepstream.client import InvalidSubmission, check_submission
from stepstream.project.files import configure

log = structlog.get_logger("stepstream.outbox")

DEFAULT_SCHEMA = "stepstream_outbox"
TABLE = "outbox"
ENV_PREFIX = "STEPSTREAM_OUTBOX_"
IDENTIFIER = r"^[A-Za-z_][A-Za-z0-9_]{0,62}$"

RELAYED = Counter("stepstream_outbox_relayed_total", "Outbox rows produced to inbox (acks=all) and marked sent",
                  ["schema"])
PENDING = Gauge("stepstream_outbox_pending", "Outbox rows not yet relayed", ["schema"])
OLDEST_PENDING = Gauge("stepstream_outbox_oldest_pending_seconds", "Age of the oldest unsent outbox row (0: none)",
                       ["schema"])
FAILED_BATCHES = Counter("stepstream_outbox_failed_batches_total",
                         "Batches rolled back after a Kafka or database fault (their rows are relayed again)",
                         ["schema"])


class OutboxError(StepstreamError):
    """The outbox cannot do what was asked (no table, no transaction, no database configured)."""


class InvalidOutboxInput(OutboxError, ValueError):
    """A setting or an argument is invalid; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


# ---- settings -------------------------------------------------------------------------------------


class OutboxSettings(BaseSettings):
    """``STEPSTREAM_OUTBOX_*``. The schema is ``db_schema`` (``schema`` is taken by pydantic's BaseModel)."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, frozen=True, extra="ignore")

    dsn: str | None = Field(default=None, description="postgresql://user@host:port/database of the application; "
                                                      "default: STEPSTREAM_STORE_URL when that is PostgreSQL")
    db_schema: str = Field(default=DEFAULT_SCHEMA, pattern=IDENTIFIER,
                           description="schema of the outbox table (never the state store's own schema)")
    batch_size: int = Field(default=100, ge=1, le=10_000, description="rows claimed, produced and marked at once")
    poll_interval_s: float = Field(default=0.5, gt=0, le=60, description="wait when the outbox is empty")
    keep_sent: bool = Field(default=False, description="mark relayed rows sent (sent_at) instead of deleting them")
    flush_timeout_s: float = Field(default=30.0, gt=0, le=600, description="wait for Kafka's acks per batch")

    @field_validator("dsn")
    @classmethod
    def _postgresql_url(cls, value: str | None) -> str | None:
        if value is not None and urlsplit(value).scheme not in ("postgresql", "postgres"):
            raise ValueError("expected a postgresql://user@host:port/database URL")
        return value

    def resolved_dsn(self) -> str:
        """The database to connect to: ``dsn``, else the state store's when it is PostgreSQL."""
        store_url = StoreSettings().url
        store = StoreSpec.parse(store_url) if store_url else None
        if self.dsn is None:
            if store is None or store.kind != "postgresql":
                raise InvalidOutboxInput(f"{ENV_PREFIX}DSN", "not set, and the state store (STEPSTREAM_STORE_URL) "
                                                             "is not PostgreSQL to default to")
            dsn = store.location
        else:
            dsn = StoreSpec.parse(self.dsn).location  # drops a ?schema= copied from a store URL
        if store is not None and store.kind == "postgresql" and store.location == dsn \
                and store.schema == self.db_schema:
            raise InvalidOutboxInput(f"{ENV_PREFIX}DB_SCHEMA", f"{self.db_schema!r} is the state store's schema, "
                                                                "which a projections rebuild replaces")
        return dsn


def load_settings(**overrides: Any) -> OutboxSettings:
    """The settings from the environment (and ``overrides``), or InvalidOutboxInput naming the first bad one."""
    try:
        return OutboxSettings(**overrides)
    except ValidationError as exc:
        first = exc.errors()[0]
        name = ".".join(str(part) for part in first["loc"]) or "settings"
        where = name if name in overrides else f"{ENV_PREFIX}{name.upper()}"
        raise InvalidOutboxInput(where, first["msg"]) from None


# ---- the table and enqueue -----------------------------------------------------------------------


def _schema(schema: str) -> pgsql.Identifier:
    if not isinstance(schema, str) or re.fullmatch(IDENTIFIER, schema) is None:
        raise InvalidOutboxInput("schema", f"{schema!r}: letters, digits and '_', not starting with a digit")
    return pgsql.Identifier(schema)


def _table(schema: str) -> pgsql.Composed:
    return pgsql.SQL("{}.{}").format(_schema(schema), pgsql.Identifier(TABLE))


def install(conn: psycopg.Connection[Any], schema: str = DEFAULT_SCHEMA) -> None:
    """Create the schema, the outbox table and its index if missing. Idempotent, safe to run concurrently.

    Inside the caller's transaction when one is open (a savepoint), else in a transaction of its own.
    """
    ident = _schema(schema)
    with conn.transaction():
        # Concurrent "create ... if not exists" can still collide in the catalog: serialize installers.
        conn.execute("select pg_advisory_xact_lock(hashtextextended(%s, 0))", (f"stepstream.outbox.{schema}",))
        conn.execute(pgsql.SQL("create schema if not exists {}").format(ident))
        conn.execute(pgsql.SQL(
            "create table if not exists {} ("
            " id bigint generated always as identity primary key,"
            " task_id text not null,"
            " workflow text not null,"
            " message_id text not null,"
            " payload bytea not null,"
            " enqueued_at timestamptz not null default now(),"
            " sent_at timestamptz)"
        ).format(_table(schema)))
        conn.execute(pgsql.SQL("create index if not exists outbox_unsent on {} (id) where sent_at is null")
                     .format(_table(schema)))


@functools.cache
def _codec() -> Codec:
    return default_codec()


def _submission(codec: Codec, payload: bytes) -> SubmitTask | None:
    """The submission a row holds; None for a payload that is none (relayed as it is: the scheduler
    dead-letters it with its reason, rather than the relay stopping on it)."""
    try:
        message = codec.decode(payload)
    except DecodeError:
        return None
    return message if isinstance(message, SubmitTask) else None


def enqueue(conn: psycopg.Connection[Any], submission: SubmitTask, *, schema: str = DEFAULT_SCHEMA,
            registry: WorkflowRegistry | None = None, keyring: Keyring | None = None) -> int:
    """Add ``submission`` to the outbox on the application's connection, in its open transaction.

    Call it on the connection (and in the transaction) of the business write, so both commit or neither
    does. Refused on an autocommit connection outside ``conn.transaction()``: the row would commit alone.
    Returns the row id. Build the submission with ``stepstream.client.build_submission`` and a task id
    derived from the business key, so a retried transaction submits the same task. Its workflow, version
    and input are checked against ``registry`` (default: the one the project file or
    ``STEPSTREAM_SCHEDULER_WORKFLOWS`` names) as the client checks them: a bad one is refused here, in the
    application's transaction, rather than dead-lettered after it committed.

    The input fields the workflow marks sensitive are sealed before the row is written, with a new data key
    wrapped by ``keyring`` (default: ``STEPSTREAM_ENCRYPTION_KEYS``), so neither the outbox table nor
    ``inbox`` ever holds them in clear; a retried transaction seals under another key, and the scheduler
    reseals a repeat under the task's own before comparing. No key for a marked workflow: OutboxError.
    """
    if not isinstance(submission, SubmitTask):
        raise InvalidOutboxInput("submission", f"must be a SubmitTask, not {type(submission).__name__}")
    if registry is None:
        configure()
        registry = SchedulerSettings().load_registry()
    try:
        check_submission(registry, submission.workflow, submission.workflow_version, submission.input)
    except InvalidSubmission as exc:
        raise InvalidOutboxInput(exc.field, exc.reason) from None
    try:
        submission = SubmissionSealer(registry, keyring or EncryptionSettings().keyring()).seal(submission)
    except SealingError as exc:
        raise OutboxError(f"task {submission.task_id} not enqueued: {exc}") from None
    table = _table(schema)
    if conn.autocommit and conn.info.transaction_status == pq.TransactionStatus.IDLE:
        raise OutboxError("enqueue needs the application's transaction: call it inside conn.transaction() "
                          "(or on a connection without autocommit), with the business write")
    payload = _codec().encode(submission)
    try:
        row = conn.execute(
            pgsql.SQL("insert into {} (task_id, workflow, message_id, payload) values (%s, %s, %s, %s) "
                      "returning id").format(table),
            (submission.task_id, submission.workflow, submission.message_id, payload),
        ).fetchone()
    except psycopg.errors.UndefinedTable as exc:
        raise OutboxError(f"no outbox table {schema}.{TABLE}: run stepstream.client.outbox.install(conn, {schema!r}) "
                          "or `stepstream outbox install`") from exc
    assert row is not None
    return int(row[0])


@dataclass(frozen=True)
class Backlog:
    pending: int
    oldest: datetime | None


def backlog(conn: psycopg.Connection[Any], schema: str = DEFAULT_SCHEMA) -> Backlog:
    """Unsent rows and the time the oldest of them was enqueued."""
    row = conn.execute(pgsql.SQL("select count(*), min(enqueued_at) from {} where sent_at is null")
                       .format(_table(schema))).fetchone()
    assert row is not None
    return Backlog(int(row[0]), row[1])


# ---- the relay ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OutboxRow:
    id: int
    task_id: str
    payload: bytes


class OutboxRelay:
    """Moves committed outbox rows to ``topic``: claim a batch, produce, wait for acks, mark, commit.

    ``after_produce`` runs between the acknowledged produce and the marking commit; it does nothing here
    and exists so tests (and the documentation) can show what a crash at that point does.
    """

    def __init__(self, settings: OutboxSettings, *, bootstrap: str, topic: str, keys_topic: str, dsn: str | None = None,
                 stop: threading.Event | None = None, producer: EventProducer | None = None) -> None:
        self.settings = settings
        self.schema = settings.db_schema
        self.topic = topic
        self.proposer = KeyProposer(bootstrap, keys_topic, topic)
        self.dsn = dsn or settings.resolved_dsn()
        self.stop = stop or threading.Event()
        self.producer = producer or EventProducer(bootstrap)
        self.relayed = 0
        self._table = _table(self.schema)
        self._conn: psycopg.Connection[Any] | None = None
        self._next_gauge = 0.0
        labels = {"schema": self.schema}
        self._relayed_metric = RELAYED.labels(**labels)
        self._pending_metric = PENDING.labels(**labels)
        self._oldest_metric = OLDEST_PENDING.labels(**labels)
        self._failed_metric = FAILED_BATCHES.labels(**labels)

    def _connection(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed or self._conn.broken:
            try:
                self._conn = psycopg.connect(self.dsn, autocommit=True)
            except psycopg.OperationalError as exc:
                raise InfrastructureError(f"outbox database unavailable: {exc}") from exc
            install(self._conn, self.schema)
        return self._conn

    def after_produce(self, rows: list[OutboxRow]) -> None:
        """Hook: the batch is acknowledged by Kafka and not yet marked sent."""

    def relay_once(self) -> int:
        """One batch: returns how many rows were produced and marked (0 when none were free to claim)."""
        conn = self._connection()
        with conn.transaction():
            claimed = conn.execute(
                pgsql.SQL("select id, task_id, payload from {} where sent_at is null order by id limit %s "
                          "for update skip locked").format(self._table),
                (self.settings.batch_size,),
            ).fetchall()
            rows = [OutboxRow(int(r[0]), str(r[1]), bytes(r[2])) for r in claimed]
            if not rows:
                return 0
            for row, payload in zip(rows, self._without_keys(rows), strict=True):
                self.producer.send_raw(self.topic, row.task_id, payload)
            self.producer.flush(self.settings.flush_timeout_s)  # raises unless every row is acknowledged
            self.after_produce(rows)
            ids = [row.id for row in rows]
            if self.settings.keep_sent:
                conn.execute(pgsql.SQL("update {} set sent_at = now() where id = any(%s)").format(self._table),
                             (ids,))
            else:
                conn.execute(pgsql.SQL("delete from {} where id = any(%s)").format(self._table), (ids,))
        self.relayed += len(rows)
        self._relayed_metric.inc(len(rows))
        log.debug("outbox batch relayed", rows=len(rows), first_id=rows[0].id, last_id=rows[-1].id)
        return len(rows)

    def _without_keys(self, rows: list[OutboxRow]) -> list[bytes]:
        """The rows' payloads as they may go to ``inbox``: the data keys rows hold proposed on ``keys`` (and
        acknowledged) and taken off their submissions."""
        codec = _codec()
        commands = [_submission(codec, row.payload) for row in rows]
        keyed = [c for c in commands if c is not None and c.data_key is not None]
        if not keyed:
            return [row.payload for row in rows]
        published = {c.message_id: c for c in self.proposer.publish(keyed, self.settings.flush_timeout_s)}
        return [codec.encode(published[c.message_id]) if c is not None and c.message_id in published else row.payload
                for row, c in zip(rows, commands, strict=True)]

    def update_gauges(self) -> Backlog:
        current = backlog(self._connection(), self.schema)
        self._pending_metric.set(current.pending)
        age = 0.0
        if current.oldest is not None:
            age = max(0.0, time.time() - current.oldest.timestamp())
        self._oldest_metric.set(age)
        return current

    def drain(self) -> int:
        """Relay until no row is free to claim; returns the rows relayed. Faults propagate."""
        total = 0
        while (count := self.relay_once()) > 0:
            total += count
        self.update_gauges()
        return total

    def run(self) -> None:
        """Relay until ``stop`` is set; the batch in flight finishes (produced, acknowledged, committed) first."""
        log.info("outbox relay running", schema=self.schema, topic=self.topic, batch_size=self.settings.batch_size)
        backoff = 0.2
        while not self.stop.is_set():
            HEALTH.beat()
            try:
                count = self.relay_once()
                if time.monotonic() >= self._next_gauge:
                    self.update_gauges()
                    self._next_gauge = time.monotonic() + 1.0
                backoff = 0.2
            except (InfrastructureError, KafkaException, psycopg.OperationalError) as exc:
                # The transaction rolled back: the rows stay unsent and are claimed again.
                self._failed_metric.inc()
                log.warning("outbox batch failed; retrying", error=str(exc), backoff_s=backoff)
                if self._conn is not None and self._conn.broken:
                    self._conn = None
                self.stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            if count < self.settings.batch_size:
                self.stop.wait(self.settings.poll_interval_s)
        log.info("outbox relay stopped", relayed=self.relayed)

    def close(self) -> None:
        try:
            self.producer.flush(self.settings.flush_timeout_s)
            self.proposer.close()
        finally:
            if self._conn is not None:
                self._conn.close()

    def __enter__(self) -> OutboxRelay:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()
