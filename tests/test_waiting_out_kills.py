"""Tasks wait out services SIGKILLed and restarted every few seconds and a broker restart, rather than give up.

Orders of ``orders-riding`` (tests/workflows.py: orders-chaos's steps and threshold, with back-off between
attempts and a long back-off past the threshold) run through orders-chaos's faults (tests/kills.py) while a
service is SIGKILLed and restarted every 1.5 s (each of the nine once after the broker's restart) and the
broker is SIGKILLed and restarted once. Every task must end as the order service's records say
(tests/agreement.py), and no task may stop trying while its faults pass: the only undone tasks are those
whose shipment was refused for good. The shares of tasks
undone with and without the kills are what benchmarks/waiting_out_kills.py reports (BENCHMARKS.md).

The module runs on a broker of its own, which it can kill without disturbing other tests.
``STEPSTREAM_KILLS_TASKS`` sets the number of orders (default 24, submitted over 16 s): the test takes 39 s at a
load of 3 and 70-90 s at loads of 13-27 on two cores, its broker's start and services included. It is a soak run
(``make soak``), outside ``make test``: with it the suite took 16-17 minutes here. Run it with
``STEPSTREAM_KILLS_TASKS=24 .venv/bin/pytest -n 0 tests/test_waiting_out_kills.py``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from eventstore.broker import LocalBroker
from tests.kills import ROTATION, run_orders
from tests.system import System
from tests.test_compensation_end_to_end import saga

__all__ = ["saga"]

pytestmark = [pytest.mark.kafka, pytest.mark.skipif(
    not {"STEPSTREAM_SOAK_TASKS", "STEPSTREAM_KILLS_TASKS"} & set(os.environ),
    reason="a soak run outside the 15-minute suite: `make soak` runs it")]

TASKS = int(os.environ.get("STEPSTREAM_KILLS_TASKS", "24"))
KILLS_EVERY_S = 1.5
WINDOW_S = max(16.0, TASKS / 3)
"""Orders are submitted evenly over this long, while the kills (eleven of them) run."""


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[LocalBroker]:
    broker = LocalBroker(tmp_path / "own-broker")
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture
def bootstrap(broker: LocalBroker) -> str:
    """This module's system runs on its own broker, not the session's: the test kills it."""
    running = broker.status()
    assert running is not None
    return running.bootstrap_servers


@pytest.mark.timeout(600)
def test_tasks_wait_out_services_sigkilled_every_few_seconds_and_a_broker_restart_instead_of_giving_up(
        saga: System, broker: LocalBroker) -> None:
    run = run_orders(saga, broker, workflow="orders-riding", tasks=TASKS, window_s=WINDOW_S,
                     kills_every_s=KILLS_EVERY_S, patience_s=240 + 2 * TASKS)

    assert set(ROTATION) | {"broker"} <= set(run.killed), f"every service and the broker restarted: {run.killed}"
    assert not run.wrong, f"{len(run.wrong)} tasks disagree with the service ({dict(run.outcomes)}): {run.wrong}"
    assert not run.gave_up, f"tasks stopped trying while their faults passed ({dict(run.outcomes)}): {run.gave_up}"
    assert run.outcomes["completed"], f"the run completed orders: {dict(run.outcomes)}"
