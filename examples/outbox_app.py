"""An application with its own database that submits a task per order: the two safe ways to do it.

``place_order`` is the transactional outbox: the order row and its submission commit in one PostgreSQL
transaction, and ``stepstream outbox relay`` produces the submission to Kafka afterwards.

``place_order_and_submit`` is the simpler variant: commit the order, then submit with the task id derived
from the order id, retrying the submit (never with a new id). It is idempotent as a whole, so the caller
may repeat it after any failure, a crash included; an order whose caller gave up stays without a task,
which is the risk the outbox removes. See docs/dual-write.md.

Run it against a broker and a PostgreSQL database (``stepstream up`` for the rest of the system)::

    STEPSTREAM_OUTBOX_DSN=postgresql://user@host/db python examples/outbox_app.py --orders 3
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import psycopg
from confluent_kafka import KafkaException

from eventstore.errors import InfrastructureError
from schemas.messages import SubmitTask
from stepstream.client import Client, InvalidSubmission, build_submission, outbox

WORKFLOW, WORKFLOW_VERSION = "orders", 1

ORDERS_TABLE = """
create table if not exists orders (
    order_id text primary key,
    sku text not null,
    qty integer not null,
    amount integer not null,
    task_id text not null unique,
    placed_at timestamptz not null default now()
)"""


def install(conn: psycopg.Connection[Any], schema: str = outbox.DEFAULT_SCHEMA) -> None:
    """The application's table and the outbox (both idempotent)."""
    with conn.transaction():
        conn.execute(ORDERS_TABLE)
    outbox.install(conn, schema)


def task_id_for(order_id: str) -> str:
    """The task id is a function of the business key: every retry, of anything, names the same task."""
    return f"order-{order_id}"


def submission_for(order: dict[str, Any]) -> SubmitTask:
    """Validated before anything is written: a bad order raises InvalidSubmission naming the field."""
    order_id = order.get("order_id")
    if not isinstance(order_id, str) or not order_id:
        raise InvalidSubmission("order_id", "must be a non-empty string")
    qty = order.get("qty")
    if isinstance(qty, bool) or not isinstance(qty, int) or qty < 1:
        raise InvalidSubmission("qty", "must be a positive integer")
    data = {"order_id": order_id, "sku": str(order.get("sku", "")), "qty": qty, "amount": int(order.get("amount", 0))}
    return build_submission(WORKFLOW, data, version=WORKFLOW_VERSION, task_id=task_id_for(order_id))


def place_order(conn: psycopg.Connection[Any], order: dict[str, Any], *,
                schema: str = outbox.DEFAULT_SCHEMA) -> str:
    """The transactional outbox: the order and its submission commit together, or neither does."""
    submission = submission_for(order)
    with conn.transaction():
        conn.execute("insert into orders (order_id, sku, qty, amount, task_id) values (%s, %s, %s, %s, %s)",
                     (submission.input["order_id"], submission.input["sku"], submission.input["qty"],
                      submission.input["amount"], submission.task_id))
        outbox.enqueue(conn, submission, schema=schema)
    return submission.task_id


def place_order_and_submit(conn: psycopg.Connection[Any], client: Client, order: dict[str, Any], *,
                           attempts: int = 5, backoff_s: float = 0.2) -> str:
    """Stable task id + retry: commit the order, then submit it, retrying the submit with the same id.

    Repeating the whole call is safe: the insert does nothing the second time, and the submission is built
    from the row as committed (not from the request), so a repeat never contradicts the first submit.
    """
    submission_for(order)  # refuse bad input before writing
    with conn.transaction():
        conn.execute("insert into orders (order_id, sku, qty, amount, task_id) values (%s, %s, %s, %s, %s) "
                     "on conflict (order_id) do nothing",
                     (order["order_id"], str(order.get("sku", "")), order["qty"], int(order.get("amount", 0)),
                      task_id_for(order["order_id"])))
        row = conn.execute("select order_id, sku, qty, amount from orders where order_id = %s",
                           (order["order_id"],)).fetchone()
    assert row is not None
    stored = submission_for({"order_id": row[0], "sku": row[1], "qty": row[2], "amount": row[3]})
    for attempt in range(1, attempts + 1):
        try:
            return client.submit(stored.workflow, stored.input, version=stored.workflow_version,
                                 task_id=stored.task_id)
        except (InfrastructureError, KafkaException):
            if attempt == attempts:
                raise  # the order is committed without a task: the caller must repeat this call
            time.sleep(backoff_s * 2 ** (attempt - 1))
    raise AssertionError("unreachable")


def main() -> int:
    from eventstore.logs import configure_logging
    from eventstore.settings import KafkaSettings
    from eventstore.topics import TopicLayout

    configure_logging("INFO", json=False)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--orders", type=int, default=3)
    args = parser.parse_args()
    settings = outbox.load_settings()
    kafka = KafkaSettings()
    with psycopg.connect(settings.resolved_dsn(), autocommit=True) as conn:
        install(conn, settings.db_schema)
        stamp = int(time.time())
        ids = [place_order(conn, {"order_id": f"{stamp}-{i}", "sku": "A-1", "qty": 1, "amount": 10},
                           schema=settings.db_schema) for i in range(args.orders)]
    print("committed with their submissions:", ", ".join(ids))
    with outbox.OutboxRelay(settings, bootstrap=kafka.resolved_bootstrap(),
                            topic=TopicLayout.from_settings(kafka).inbox,
                            keys_topic=TopicLayout.from_settings(kafka).keys) as relay:
        print(f"relayed {relay.drain()} submissions to inbox")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
