"""The operator console in a real headless Chromium (Debian's, driven by Playwright), against the real API over
a real store and a real broker (for lag, agents, commands and dead letters): an empty system; a few hundred tasks
decided by the real decider and written straight to the store (some compensated, some whose undo was refused)
found through the state filter, the search, paging and deep links; a busy store redrawn in place; an operator's
command and a dead letter's replay. Each test fails on any error the browser reports (console or uncaught
exception) and saves a screenshot to test-artifacts/."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from agents.http import http_handler
from agents.policy import DependencyPolicy
from agents.reporting import Reading, Reporter, prometheus_readings
from agents.retry import RetryPolicy
from agents.runtime import Agent
from demo.orders_client import ServiceProcess
from eventstore.dead_letters import DeadLetters
from eventstore.dlq import DeadLetter, dlq_headers
from eventstore.producer import EventProducer
from eventstore.replay import LogRange
from eventstore.topics import TopicLayout
from projections.dlq_rows import project_dead_letter
from projections.lag import LagReader
from projections.store import Positioned, SqliteStore
from scheduler.decider import Limits, decide, fold
from scheduler.workflow import Backoff, Step, Workflow, WorkflowRegistry
from schemas.messages import AgentRequest, Event, StepResult, SubmitTask
from schemas.states import TaskStatus
from stepstream.http.admission import GlobalAdmission
from stepstream.http.app import create_app
from stepstream.http.dead_letters import dead_letter_routers
from stepstream.http.dependencies import DependencyBoard
from stepstream.http.settings import ApiSettings
from stepstream.http.writer import TaskWriter
from stepstream.http.writes import write_router
from stepstream.presence import Presence
from tests.console_data import ORDERS, SCRIPTS, decided
from tests.histories import histories
from tests.kafka_helpers import read_to_end, wait_for
from tests.test_task_api import requests_on_inbox

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Locator, Page

pytestmark = pytest.mark.kafka

ARTIFACTS = Path(__file__).parent.parent / "test-artifacts"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
STATES = tuple(TaskStatus)  # the page's tiles: one per task state, as the server wrote them into the page
TABLES = ("tasks", "waiting", "failed", "stuck", "queued", "alerts")  # the task view's tables fed by the store
OPERATOR_TOKEN = "ops-secret"
# One step that waits ten minutes after a failure: its tasks stay in the waiting table while the test acts.
WAITING_REGISTRY = WorkflowRegistry.of([Workflow("wait", 1, (Step("pay", "payments",
                                                                  backoff=Backoff(initial_s=600, max_s=600)),)),
                                        ORDERS])


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        message = "Chromium not found: install Debian's `chromium` (apt-get install chromium) to run this test"
        if os.environ.get("CI"):  # CI installs it (.ci/run): missing there is a failure, not a skip
            pytest.fail(message)
        pytest.skip(message)
    return found


@dataclass
class Dashboard:
    """An open dashboard page and every error the browser reported while it was open."""

    page: Page
    api: httpx.Client
    errors: list[str] = field(default_factory=list)

    def rows(self, table: str) -> int:
        return self.page.locator(f"#{table} tbody tr").count()

    def shows_none(self, table: str) -> bool:
        return self.rows(table) == 1 and self.page.locator(f"#{table} tbody td.empty").count() == 1

    def screenshot(self, name: str, *, full_page: bool = True) -> None:
        ARTIFACTS.mkdir(exist_ok=True)
        self.page.screenshot(path=str(ARTIFACTS / name), full_page=full_page)

    def cells(self, table: str, column: str) -> list[str]:
        """The texts of one column, found by its header's name (``data-col``), not its position."""
        return self.page.locator(f'#{table} tbody td[data-col="{column}"]').all_inner_texts()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SqliteStore]:
    opened = SqliteStore(tmp_path / "state.db")
    try:
        yield opened
    finally:
        opened.close()


@contextlib.contextmanager
def serving(app: FastAPI) -> Iterator[str]:
    """``app`` served on a free port in a thread; its base URL."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    assert wait_for(lambda: server.started, timeout_s=30)
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.fixture
def api_url(store: SqliteStore, bootstrap: str, layout: TopicLayout) -> Iterator[str]:
    """The read-only API (no token configured, so no writes), as ``stepstream serve api`` without tokens: lag,
    the agents' presence and their reports read from the broker (no agent runs, so the page names the workflows'
    agents)."""
    board = DependencyBoard(bootstrap, layout.dependencies)
    try:
        with serving(create_app(store, layout, LagReader(bootstrap, layout.prefix, cache_s=0.2),
                                presence=Presence.of(WAITING_REGISTRY, bootstrap, layout), dependencies=board)) as url:
            yield url
    finally:
        board.close()


@pytest.fixture
def browser() -> Iterator[Browser]:
    chromium = _chromium()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS, headless=True)
        try:
            yield launched
        finally:
            launched.close()


@contextlib.contextmanager
def page_on(browser: Browser, api_url: str) -> Iterator[Dashboard]:
    """A page of ``browser`` for the API at ``api_url``, noting every error the browser reports."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    opened = Dashboard(page, httpx.Client(base_url=api_url))
    page.on("console", lambda msg: opened.errors.append(msg.text) if msg.type == "error" else None)
    page.on("pageerror", lambda exc: opened.errors.append(str(exc)))
    try:
        yield opened
    finally:
        opened.api.close()
        page.close()


@pytest.fixture
def dashboard(browser: Browser, api_url: str) -> Iterator[Dashboard]:
    with page_on(browser, api_url) as opened:
        yield opened


@pytest.fixture
def operator_dashboard(browser: Browser, store: SqliteStore, bootstrap: str, layout: TopicLayout
                       ) -> Iterator[Dashboard]:
    """The page over an API with its write side, as ``stepstream serve api`` with an operator's token: commands
    reach the real inbox topic (no scheduler runs, so each is answered 202, on the log and not decided yet), and
    dead letters are read from and replayed to the real topics."""
    settings = ApiSettings(tokens={"ops": OPERATOR_TOKEN}, decision_timeout_s=1)
    lag = LagReader(bootstrap, layout.prefix, cache_s=0.2)
    writer = TaskWriter(bootstrap=bootstrap, layout=layout, store=store, registry=WAITING_REGISTRY,
                        admission=GlobalAdmission(store, lag, layout, settings.max_in_flight,
                                                  settings.admission_refresh_s), settings=settings)
    board = DependencyBoard(bootstrap, layout.dependencies)
    try:
        dead_letters = DeadLetters(bootstrap, layout.dlq, layout.keys)
        routers = [write_router(writer, settings), *dead_letter_routers(dead_letters, settings)]
        presence = Presence.of(WAITING_REGISTRY, bootstrap, layout)
        with serving(create_app(store, layout, lag, routers, presence, board)) as url, page_on(browser, url) as opened:
            yield opened
    finally:
        board.close()
        writer.close()


def _open(dashboard: Dashboard, path: str = "/") -> None:
    """Open ``path`` (query and fragment kept) refreshing every second, once its first refresh has drawn."""
    base, _, fragment = path.partition("#")
    url = f"{dashboard.api.base_url}{base}{'&' if '?' in base else '?'}refresh=1" + (f"#{fragment}" if fragment else "")
    dashboard.page.goto(url)
    dashboard.page.wait_for_function("Number(document.body.dataset.refreshes || 0) >= 1", timeout=30000)


def _orders(store: SqliteStore, layout: TopicLayout, count: int = 240) -> dict[str, str]:
    """``count`` tasks of the orders workflow, decided by the scheduler's decider a few seconds apart (completed,
    throttled then completed, compensated, compensation refused), written to the store as the projector would;
    each task's state as the decider left it."""
    start = datetime.now(UTC) - timedelta(minutes=40)
    scripts = list(SCRIPTS.values())
    events: list[Event] = []
    states: dict[str, str] = {}
    for i in range(count):
        mine = decided(f"order-{i:04d}", scripts[i % len(scripts)], start + timedelta(seconds=i * 8),
                       submitter="back-office" if i % 3 == 0 else "shop")
        final = fold(mine)
        assert final is not None
        states[final.task_id] = final.status
        events += mine
    store.apply_events(layout.events, [Positioned(i % layout.partitions, i, e) for i, e in enumerate(events)])
    return states


def _keys(dashboard: Dashboard, table: str) -> list[str]:
    return dashboard.page.locator(f"#{table} tbody tr[data-key]").evaluate_all("rows => rows.map(r => r.dataset.key)")


def _walk_pages(dashboard: Dashboard) -> list[str]:
    """Every task id the list shows, page after page (``older``), until the last page."""
    page = dashboard.page
    seen: list[str] = []
    while True:
        keys = _keys(dashboard, "tasks")
        seen += keys
        if page.locator("#older").is_disabled():
            return seen
        page.click("#older")
        page.wait_for_function(f"document.querySelector('#tasks tbody tr').dataset.key !== {keys[0]!r}")


def test_an_empty_system_shows_none_in_every_table_its_lag_per_group_and_no_browser_error(
    dashboard: Dashboard,
) -> None:
    _open(dashboard)
    page = dashboard.page
    assert {s: int(page.inner_text(f'[data-count="{s}"]')) for s in STATES} == dict.fromkeys(STATES, 0)
    assert page.inner_text("#total") == "0 in all" and page.inner_text("#dlq-depth") == "0"
    for table in TABLES:
        assert dashboard.shows_none(table), table
    lag = dashboard.api.get("/api/lag").json()
    groups = {row["group"] for row in lag["projection"] + lag["groups"]}
    assert dashboard.rows("lag") == len(groups) > 0, "one line per consumer group"
    page.locator("#lag tbody tr").first.click()
    partitions = [r for r in lag["projection"] + lag["groups"] if r["group"] == min(groups)]
    page.wait_for_function(f"document.querySelectorAll('#lag tbody tr').length === {len(groups) + len(partitions)}")
    assert page.locator("#lag td.partition").count() == len(partitions), "a group's partitions on demand"
    assert "with errors" not in page.inner_text("#refreshed")
    dashboard.screenshot("dashboard-empty.png")
    assert dashboard.errors == []


def test_the_compensated_filter_pages_through_every_compensated_task_and_nothing_else(
    dashboard: Dashboard, store: SqliteStore, layout: TopicLayout,
) -> None:
    states = _orders(store, layout)
    compensated = sorted(t for t, s in states.items() if s == "compensated")
    assert len(compensated) == 60
    _open(dashboard, "/?state=compensated")
    page = dashboard.page
    assert page.inner_text('[data-count="compensated"]') == "60" and page.inner_text("#matching") == "60 matching"
    assert page.locator("#filters select[name=state]").input_value() == "compensated", "the URL's filter is shown"
    shown = _walk_pages(dashboard)
    assert sorted(shown) == compensated and len(shown) == len(set(shown)), "each compensated task once, no other"
    assert set(dashboard.cells("tasks", "state")) == {"compensated"}

    page.locator(".tile.completed").click()  # a tile filters the list, and the URL says so
    page.wait_for_function("document.getElementById('matching').textContent === '120 matching'")
    assert "state=completed" in page.url and set(dashboard.cells("tasks", "state")) == {"completed"}
    dashboard.screenshot("console-tasks.png", full_page=False)  # the user guide's (docs/img)
    assert dashboard.errors == []


def test_the_search_finds_tasks_by_id_prefix_and_submitter_and_a_refused_filter_names_its_field(
    dashboard: Dashboard, store: SqliteStore, layout: TopicLayout,
) -> None:
    states = _orders(store, layout, count=120)
    _open(dashboard)
    page = dashboard.page
    page.fill("#filters [name=q]", "order-001")
    page.fill("#filters [name=submitter]", "back-office")
    page.click("#filters button[type=submit]")
    wanted = sorted(t for t in states if t.startswith("order-001") and int(t[-4:]) % 3 == 0)
    page.wait_for_function(f"document.getElementById('matching').textContent === '{len(wanted)} matching'")
    assert sorted(_keys(dashboard, "tasks")) == wanted and "q=order-001" in page.url
    assert set(dashboard.cells("tasks", "submitter")) == {"back-office"}

    _open(dashboard, "/?workflow=orders&version=x")  # a shared link with a typo
    page.wait_for_selector("#tasks-error:not([hidden])")
    assert "version" in page.inner_text("#tasks-error")
    assert page.inner_text("#total") == "120 in all", "the rest of the page is drawn"
    assert [e for e in dashboard.errors if "422" not in e] == []


def test_a_deep_link_opens_a_task_with_its_attempts_classified_and_its_compensations_in_order(
    dashboard: Dashboard, store: SqliteStore, layout: TopicLayout,
) -> None:
    states = _orders(store, layout, count=8)
    refused = next(t for t, s in states.items() if s == "compensation_failed")
    _open(dashboard, f"/#task={refused}")
    page = dashboard.page
    page.wait_for_function("document.querySelectorAll('#attempts tbody tr[data-key]').length === 4")
    assert page.inner_text("#task-status") == "compensation_failed"
    assert dashboard.cells("attempts", "step") == ["reserve", "charge", "ship", "charge (undo)"]
    assert dashboard.cells("attempts", "outcome") == ["succeeded", "succeeded", "refused", "refused"]
    assert dashboard.cells("attempts", "error")[3] == "409 charge already settled: refund by hand", \
        "the undo refused for good shows its reason"
    assert dashboard.cells("attempts", "agent") == ["inventory", "payments", "shipping", "payments-refund"]
    assert "undo charge, then reserve; nothing to undo in ship" in page.inner_text("#task-summary")
    assert page.get_by_role("button", name="retry-compensation").count() == 1
    assert page.locator("#task-timeline rect.seg").count() == 8  # each attempt: its queue and its work
    dashboard.screenshot("console-task.png")  # the user guide's (docs/img)

    throttled = next(t for t, s in states.items() if s == "completed" and int(t[-4:]) % 4 == 1)
    page.fill("#task-id", throttled)
    page.click("#task-form button")
    page.wait_for_function(f"location.hash === '#task={throttled}' && "
                           "document.querySelectorAll('#attempts tbody tr[data-key]').length === 4")
    assert dashboard.cells("attempts", "outcome") == ["succeeded", "throttled", "succeeded", "succeeded"]
    assert dashboard.cells("attempts", "then waited")[1].startswith("3.0 s")
    page.click("#back")
    page.wait_for_selector("#view-tasks:not([hidden])")
    assert dashboard.errors == []


def test_a_busy_store_is_redrawn_in_place_and_a_failing_endpoint_leaves_the_rest_drawn(
    browser: Browser, store: SqliteStore, layout: TopicLayout,
) -> None:
    # No broker for this API: lag and agents answer 503, and the page draws everything else.
    with serving(create_app(store, layout)) as url, page_on(browser, url) as dashboard:
        _open(dashboard)
        page = dashboard.page
        first = list(histories(30, seed=40, prefix="busy0", in_flight_every=7))
        store.apply_events(layout.events, [Positioned(0, i, e) for i, e in enumerate(first)])
        page.wait_for_function("document.getElementById('total').textContent === '30 in all'", timeout=30000)
        page.locator("#tasks tbody tr").evaluate_all("rows => rows.forEach(r => { r.dataset.before = 'yes'; })")
        more = list(histories(5, seed=41, prefix="busy1", start=datetime.now(UTC)))
        store.apply_events(layout.events, [Positioned(1, i, e) for i, e in enumerate(more)])
        page.wait_for_function("document.getElementById('total').textContent === '35 in all'", timeout=30000)
        assert dashboard.rows("tasks") == 25
        assert page.locator("#tasks tbody tr[data-before]").count() == 20, "rows still shown are the same elements"
        assert not dashboard.shows_none("stuck")
        assert "503" in page.inner_text("#lag") and "with errors" in page.inner_text("#refreshed")
        dashboard.screenshot("dashboard-busy.png")
        assert dashboard.errors and all("503" in e for e in dashboard.errors), dashboard.errors


def _waiting(store: SqliteStore, layout: TopicLayout, task_ids: list[str]) -> None:
    """Tasks whose only step failed once and waits ten minutes for its next attempt, as the scheduler decided."""
    events: list[Event] = []
    for task_id in task_ids:
        accepted = decide(SubmitTask(task_id=task_id, workflow="wait", input={}), None, registry=WAITING_REGISTRY,
                          now=datetime.now(UTC), in_flight=0, limits=Limits())
        state = fold(accepted.events)
        assert state is not None and state.current_step is not None
        failed = decide(StepResult(task_id=task_id, step="pay", attempt_id=state.steps[0].lock or "", ok=False,
                                   error="503", calls=1, error_kind="server_error"), state,
                        registry=WAITING_REGISTRY, now=datetime.now(UTC), in_flight=0, limits=Limits())
        events += [*accepted.events, *failed.events]
    store.apply_events(layout.events, [Positioned(0, offset, e) for offset, e in enumerate(events)])


def test_an_operator_makes_a_waiting_step_try_now_or_cancels_its_task_after_confirming(
    operator_dashboard: Dashboard, store: SqliteStore, bootstrap: str, layout: TopicLayout,
) -> None:
    _waiting(store, layout, ["wait-1", "wait-2"])
    _open(operator_dashboard)
    page = operator_dashboard.page
    assert operator_dashboard.rows("waiting") == 2

    def answered(text: str) -> None:
        page.wait_for_function(f"document.getElementById('command-answer').textContent.startsWith({text!r})",
                               timeout=30000)

    def button(task_id: str, label: str) -> Locator:
        return page.locator("#waiting tbody tr", has_text=task_id).get_by_role("button", name=label)

    button("wait-1", "try now").click()
    answered("enter an operator token")
    assert requests_on_inbox(bootstrap, layout) == [], "without a token the page sends nothing"

    page.fill("#operator-token", OPERATOR_TOKEN)
    page.once("dialog", lambda dialog: dialog.accept())
    button("wait-1", "try now").click()
    answered("try-now wait-1: HTTP 202 pending")
    page.once("dialog", lambda dialog: dialog.dismiss())
    button("wait-2", "cancel").click()
    assert page.inner_text("#command-answer").startswith("try-now wait-1"), "a cancel not confirmed sends nothing"
    page.once("dialog", lambda dialog: dialog.accept())
    button("wait-2", "cancel").click()
    answered("cancel wait-2: HTTP 202 pending")

    commands = sorted((c.task_id, c.action, c.step, c.operator) for c in requests_on_inbox(bootstrap, layout))
    assert commands == [("wait-1", "try-now", "pay", "ops"), ("wait-2", "cancel", None, "ops")]
    assert not page.locator("#view-tasks").is_hidden(), "a button is not a click on its row (the task page)"
    operator_dashboard.screenshot("dashboard-operator.png")
    assert operator_dashboard.errors == []


def test_an_operator_inspects_a_dead_letter_replays_it_to_its_origin_once_and_discards_another_for_good(
    operator_dashboard: Dashboard, store: SqliteStore, bootstrap: str, layout: TopicLayout,
) -> None:
    producer = EventProducer(bootstrap)
    for i in range(2):
        producer.send_raw(layout.dlq, f"task-{i}".encode(), b"\x00garbage", dlq_headers(
            reason=f"undecodable bytes #{i}", error_class="DecodeError", kind="corrupt", topic=layout.inbox,
            partition=0, offset=40 + i, group=layout.scheduler_group), partition=0)
    producer.flush()
    letters = [DeadLetter.from_message(m) for m in LogRange(bootstrap, layout.dlq)]
    store.apply_batch(layout.dlq, [Positioned(d.partition, d.offset, d) for d in letters], project_dead_letter)
    _open(operator_dashboard, "/?view=dlq")
    page = operator_dashboard.page
    assert page.inner_text("#dlq-depth") == "2" and operator_dashboard.rows("dlq") == 2
    page.locator("#dlq tbody tr", has_text="#1").click()
    page.wait_for_function("document.getElementById('dlq-value').textContent.includes('undecodable')")
    assert "undecodable bytes #1" in page.inner_text("#dlq-fields")
    assert f"{layout.inbox}[0]@41" in page.inner_text("#dlq-fields")
    assert "stepstream.dlq.reason" in page.inner_text("#dlq-headers")

    page.fill("#operator-token", OPERATOR_TOKEN)
    page.once("dialog", lambda dialog: dialog.accept())
    page.click("#dlq-replay")
    page.wait_for_function("document.getElementById('command-answer').textContent.startsWith('replay 0:1: HTTP 200')")
    replayed = [m for m in read_to_end(bootstrap, layout.inbox)]
    assert [(m.key(), m.value(), m.partition()) for m in replayed] == [(b"task-1", b"\x00garbage", 0)]
    assert f"to {layout.inbox}[0]@" in page.inner_text("#command-answer")
    page.once("dialog", lambda dialog: dialog.accept())
    page.click("#dlq-replay")
    page.wait_for_function("document.getElementById('command-answer').textContent.startsWith('replay 0:1: HTTP 409')")
    assert len(read_to_end(bootstrap, layout.inbox)) == 1, "a second replay needs force"
    operator_dashboard.screenshot("console-dlq.png")

    page.locator("#dlq tbody tr", has_text="#0").click()
    page.wait_for_function("document.getElementById('dlq-entry').textContent === '0:0'")
    asked: list[str] = []
    page.once("dialog", lambda dialog: (asked.append(dialog.message), dialog.accept()))
    page.click("#dlq-discard")
    page.wait_for_function(
        "document.getElementById('command-answer').textContent.startsWith('discard 0:0: HTTP 200')")
    assert asked and asked[0].startswith("Discard dead letter 0:0 for good? It can never be replayed")
    markers = [DeadLetter.from_message(m) for m in LogRange(bootstrap, layout.dlq)][len(letters):]
    assert [(m.replay_of, m.discard_of) for m in markers] == [((0, 1), None), (None, (0, 0))]
    store.apply_batch(layout.dlq, [Positioned(d.partition, d.offset, d) for d in markers], project_dead_letter)
    page.wait_for_function("[...document.querySelectorAll('#dlq tbody tr')].some(r => "
                           "r.textContent.includes('#0') && r.textContent.includes('discarded '))")
    # The depth is its own panel, read before the list within a refresh: the refresh that drew the list may have
    # read it before the markers were projected, so wait for the next one.
    page.wait_for_function("document.getElementById('dlq-depth').textContent === '0'")  # neither letter waits
    page.once("dialog", lambda dialog: dialog.accept())
    page.click("#dlq-replay")
    page.wait_for_function("document.getElementById('command-answer').textContent.startsWith('replay 0:0: HTTP 409')")
    assert "a discarded dead letter is never replayed" in page.inner_text("#command-answer")
    assert len(read_to_end(bootstrap, layout.inbox)) == 1, "the discarded letter was not replayed"
    assert [e for e in operator_dashboard.errors if "409" not in e] == []


def test_the_dependencies_view_shows_the_throttles_of_a_throttling_service_at_the_top(
    browser: Browser, store: SqliteStore, bootstrap: str, layout: TopicLayout,
) -> None:
    """A real agent calls the real order service, which throttles half its calls (429, Retry-After); the agent
    process's reporter publishes to the real topic, the API follows it, the page shows it."""
    dependency = f"orders-{uuid.uuid4().hex[:8]}"
    reporter = Reporter(bootstrap, layout.dependencies, interval_s=0.5, window_s=60, concurrency=4,
                        source=lambda: [r for r in prometheus_readings() if r.dependency == dependency])
    board = DependencyBoard(bootstrap, layout.dependencies)
    quiet = Reporter(bootstrap, layout.dependencies, interval_s=3, concurrency=1, instance="other:1",
                     source=lambda: [Reading("shipping", "carrier", ok=1, breaker="closed", budget_remaining=5)])
    try:
        with ServiceProcess(seed=3) as service, service.admin() as admin:
            admin.set_faults("inventory/reserve", throttle_rate=0.5, retry_after_s=0)
            quiet.start()
            agent = Agent("inventory", http_handler(service.base_url, "inventory/reserve"),
                          DependencyPolicy(retry=RetryPolicy(max_retries=8)), dependency=dependency)
            results = [agent.execute(_agent_request()) for _ in range(8)]
            assert all(r.ok for r in results), results
            reporter.start()
            with serving(create_app(store, layout, dependencies=board)) as url, page_on(browser, url) as dashboard:
                _open(dashboard, "/?view=deps")
                page = dashboard.page
                page.wait_for_function("document.querySelectorAll('#dependencies tbody tr[data-key]').length === 2 "
                                       "&& document.querySelector('#dependencies tbody tr').dataset.key"
                                       f".includes({dependency!r})", timeout=30000)
                first = page.locator("#dependencies tbody tr").first
                assert "trouble" in (first.get_attribute("class") or "")
                throttles = float(first.locator('td[data-col="throttles/s"]').inner_text())
                assert throttles > 0 and "throttled" in first.locator('td[data-col="trouble"]').inner_text()
                assert first.locator('td[data-col="breaker"]').inner_text() == "closed", \
                    "throttles are the service pacing us, not a failure the breaker counts"
                assert first.locator('td[data-col="in use"]').inner_text().endswith("/ 4")
                assert page.locator("#dependencies tbody tr").nth(1).locator('td[data-col="trouble"]').inner_text() \
                    == ""
                assert page.inner_text("#deps-count") == "1 in trouble"
                dashboard.screenshot("console-dependencies.png")
                page.click('nav a[data-view="tasks"]')
                page.wait_for_selector("#trouble:not([hidden])")
                assert dependency in page.inner_text("#trouble-text")
                assert dashboard.errors == []
    finally:
        reporter.stop()
        quiet.stop()
        board.close()


def _agent_request() -> AgentRequest:
    task_id = f"t-{uuid.uuid4().hex[:12]}"
    return AgentRequest(task_id=task_id, step="reserve", attempt=1, attempt_id=f"{task_id}:reserve:1",
                        idempotency_key=f"{task_id}:reserve", complete_by=datetime.now(UTC) + timedelta(seconds=20),
                        calls_allowed=10, input={"task": {"order_id": task_id, "sku": "A-1", "qty": 1}})
