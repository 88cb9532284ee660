"""The order service's journal: what a request writes does not grow with the orders served before it, a
crash mid-append loses only the unconfirmed line, and snapshot plus journal fold back to the same state."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from demo.orders_journal import Journal
from demo.orders_service import OrdersService, OrdersState, create_app


def _orders(service_app: Any, count: int, start: int = 0) -> None:
    async def run() -> None:
        transport = httpx.ASGITransport(app=service_app)
        async with httpx.AsyncClient(transport=transport, base_url="http://orders") as client:
            for i in range(start, start + count):
                for op in ("inventory/reserve", "payments/charge", "shipping/create"):
                    answer = await client.post(f"/{op}", json={"order_id": f"o-{i}", "qty": 1, "amount": 5},
                                               headers={"Idempotency-Key": f"{op}:{i}", "X-Attempt": "1"})
                    assert answer.status_code == 200, answer.text

    asyncio.run(run())


def _journal_bytes(path: Path) -> int:
    return path.with_name(path.name + ".journal").stat().st_size


def test_what_a_request_writes_does_not_grow_with_the_orders_served_before_it(tmp_path: Path) -> None:
    """Counted, not timed: the bytes journaled for 20 orders are the same after 20 orders as after 300."""
    state_file = tmp_path / "orders.json"
    app = create_app(state_file=state_file)
    _orders(app, 20)
    first = _journal_bytes(state_file)
    _orders(app, 280, start=20)
    before = _journal_bytes(state_file)
    _orders(app, 20, start=300)
    late = _journal_bytes(state_file) - before
    # The same shapes with ids of the same length; allow the digits of a longer order number.
    assert late <= first * 1.05, (first, late)


def test_the_snapshot_and_journal_fold_back_to_the_state_the_service_held(tmp_path: Path) -> None:
    state_file = tmp_path / "orders.json"
    app = create_app(state_file=state_file)
    _orders(app, 30)
    service: OrdersService = app.state.service
    service.persist()  # the last answers' outcome counts, which ride with the next write or the shutdown's
    held = service.state.to_json()

    restored = Journal(state_file).load()

    assert restored == held


def test_a_journal_torn_after_its_last_fsync_is_folded_up_to_the_tear(tmp_path: Path) -> None:
    """Lines written after the last fsync may be torn in any pattern by a machine crash; none was confirmed."""
    state_file = tmp_path / "orders.json"
    app = create_app(state_file=state_file)
    _orders(app, 3)
    app.state.service.persist()
    held = app.state.service.state.to_json()
    journal = state_file.with_name(state_file.name + ".journal")
    with journal.open("ab") as handle:
        handle.write(b'{"keyed": [["inventory/reserve", "torn"')  # a crash mid-append

    assert Journal(state_file).load() == held

    lines = journal.read_bytes().split(b"\n")
    journal.write_bytes(b"\n".join([lines[0], b"\0\0\0", *lines[1:]]))
    folded = Journal(state_file).load()
    assert folded is not None and folded != held
    one_line = Journal(state_file)
    journal.write_bytes(lines[0] + b"\n")
    assert folded == one_line.load()


def test_a_journal_that_outgrows_its_snapshot_is_folded_into_a_new_one(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("demo.orders_journal.COMPACT_FLOOR_BYTES", 4096)
    state_file = tmp_path / "orders.json"
    app = create_app(state_file=state_file)
    _orders(app, 40)
    app.state.service.persist()

    snapshot = state_file.stat().st_size
    assert _journal_bytes(state_file) <= 2 * snapshot + 2048  # compacted as it outgrew the snapshot
    assert OrdersState.from_json(Journal(state_file).load() or {}).to_json() == app.state.service.state.to_json()
