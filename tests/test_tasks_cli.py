"""``stepstream tasks``: listing tasks from the state store for people (a table) and scripts (JSON Lines).

The store is real and filled the way the projector fills it (events applied through ``projections.rows``);
no broker is needed. The command runs through ``stepstream.cli.main`` with the environment pointing at it.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson
import pytest

from projections.settings import StoreSpec
from projections.store import Positioned, SqliteStore, Store
from schemas.messages import (
    CompensationStarted,
    Event,
    StepFailed,
    StepRetryScheduled,
    StepStarted,
    StepSucceeded,
    TaskAccepted,
    TaskCompensated,
    TaskCompensationFailed,
    TaskCompleted,
    TaskFailed,
    TaskQuarantined,
    TaskRejected,
)
from stepstream.cli import main
from stepstream.cli.tasks import TASK_STATES, TaskFilter, all_tasks

START = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)
TOPIC = "t.events"


def task_events(task_id: str, state: str, *, workflow: str = "orders", version: int = 1, at: datetime = START,
                error: str = "charge refused") -> list[Event]:
    """One task's events, as the scheduler writes them, ending in ``state``; created at ``at``."""
    events: list[Event] = []

    def add(kind: type[Event], **fields: Any) -> None:
        events.append(kind(task_id=task_id, sequence=len(events) + 1, workflow=workflow, workflow_version=version,
                           causation_id=f"c-{task_id}", occurred_at=at + timedelta(milliseconds=len(events)),
                           **fields))

    if state == "rejected":
        add(TaskRejected, reason="in-flight bound reached")
        return events
    add(TaskAccepted, input={"order_id": task_id}, input_digest="d")
    if state == "accepted":
        return events
    attempt = f"{task_id}:charge:1"
    add(StepStarted, step="charge", step_index=0, attempt=1, attempt_id=attempt,
        complete_by=at + timedelta(seconds=30), calls_allowed=3)
    if state == "running":
        return events
    if state == "waiting":
        add(StepFailed, step="charge", attempt_id=attempt, error="503", permanent=False, calls=1, failure_count=1)
        add(StepRetryScheduled, step="charge", step_index=0, attempt=2, not_before=at + timedelta(seconds=8),
            reason="back-off after 1 failed attempt(s)", error_kind="server_error")
        return events
    if state in ("completed", "quarantined"):
        add(StepSucceeded, step="charge", attempt_id=attempt, output={}, calls=1)
        add(TaskCompleted, output={})
        if state == "quarantined":
            add(TaskQuarantined, reason="TaskCompleted does not fold", unfolded_sequence=len(events) + 1)
        return events
    add(StepFailed, step="charge", attempt_id=attempt, error=error, permanent=True, calls=1, failure_count=1)
    add(TaskFailed, step="charge", reason=error)
    if state == "error":
        return events
    add(CompensationStarted, trigger="escalation", reason=error, steps=[], step="charge")
    if state == "compensated":
        add(TaskCompensated)
    elif state == "compensation_failed":
        add(TaskCompensationFailed, step="charge", reason="refund refused")
    return events


def fill(store: Store, tasks: list[list[Event]]) -> None:
    events = [e for task in tasks for e in task]
    store.apply_events(TOPIC, [Positioned(0, i, e) for i, e in enumerate(events)])


def mixed_tasks() -> list[list[Event]]:
    """Three tasks of every state, alternating workflows, one created per second: task ``t-00`` oldest."""
    states = TASK_STATES * 3
    return [task_events(f"t-{i:02d}", state, workflow=("orders", "refunds")[i % 2], version=1 + i % 2,
                        at=START + timedelta(seconds=i)) for i, state in enumerate(states)]


def ids_newest_first(tasks: list[list[Event]], keep: Callable[[TaskAccepted | TaskRejected, str], bool]
                     = lambda first, state: True) -> list[str]:
    """Task ids newest first (creation time, then id, descending) of the tasks ``keep`` picks."""
    picked = []
    for events in tasks:
        first = events[0]
        assert isinstance(first, TaskAccepted | TaskRejected)
        if keep(first, STATE_OF[first.task_id]):
            picked.append((first.occurred_at, first.task_id))
    return [task_id for _, task_id in sorted(picked, reverse=True)]


STATE_OF = {f"t-{i:02d}": state for i, state in enumerate(TASK_STATES * 3)}


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """STEPSTREAM_HOME at a fresh folder; the store is ``<home>/state.db``, the default."""
    monkeypatch.setenv("STEPSTREAM_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("STEPSTREAM_STORE_URL", raising=False)
    monkeypatch.delenv("STEPSTREAM_STORE_PATH", raising=False)
    return tmp_path / "home"


@pytest.fixture
def mixed(home: Path) -> list[list[Event]]:
    tasks = mixed_tasks()
    store = SqliteStore(home / "state.db")
    try:
        fill(store, tasks)
    finally:
        store.close()
    return tasks


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["tasks", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def json_lines(out: str) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in out.splitlines()]


def test_json_prints_one_parseable_object_per_task_newest_first_and_nothing_else(
    mixed: list[list[Event]], capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run(capsys, "--json")
    assert (code, err) == (0, "")
    rows = json_lines(out)
    assert [r["task_id"] for r in rows] == ids_newest_first(mixed)
    assert {r["task_id"]: r["status"] for r in rows} == STATE_OF, "every state, as the projection holds it"
    newest = rows[0]
    assert newest["created_at"] == int((START + timedelta(seconds=len(STATE_OF) - 1)).timestamp() * 1000)
    assert set(newest) >= {"task_id", "workflow", "workflow_version", "status", "error", "created_at", "updated_at"}


@pytest.mark.parametrize("states", [["error"], ["compensation_failed"], ["error", "rejected"],
                                    ["running", "accepted", "running"], ["waiting"]])
def test_the_state_filter_lists_only_tasks_in_the_states_given(
    mixed: list[list[Event]], capsys: pytest.CaptureFixture[str], states: list[str],
) -> None:
    code, out, _ = run(capsys, "--json", *(arg for s in states for arg in ("--state", s)))
    assert code == 0
    assert [r["task_id"] for r in json_lines(out)] == ids_newest_first(mixed, lambda _, state: state in states)


def test_the_workflow_filter_lists_only_that_workflows_tasks(
    mixed: list[list[Event]], capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run(capsys, "--json", "--workflow", "refunds", "--state", "completed", "--state", "error")
    assert code == 0
    expected = ids_newest_first(mixed, lambda first, state: first.workflow == "refunds"
                                and state in ("completed", "error"))
    assert expected and [r["task_id"] for r in json_lines(out)] == expected
    code, out, _ = run(capsys, "--json", "--workflow", "no-such-workflow")
    assert (code, out) == (0, "")


def test_since_and_until_bound_the_creation_time_at_or_after_since_and_before_until(
    mixed: list[list[Event]], capsys: pytest.CaptureFixture[str],
) -> None:
    since, until = START + timedelta(seconds=5), START + timedelta(seconds=9)
    code, out, _ = run(capsys, "--json", "--all", "--since", since.isoformat(),
                       "--until", until.replace(tzinfo=None).isoformat())  # no offset: UTC
    assert code == 0
    assert [r["task_id"] for r in json_lines(out)] == ["t-08", "t-07", "t-06", "t-05"]


def test_limit_lists_the_newest_tasks_and_the_table_says_more_match(
    mixed: list[list[Event]], capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run(capsys, "--json", "--limit", "4")
    assert code == 0
    assert [r["task_id"] for r in json_lines(out)] == ids_newest_first(mixed)[:4]

    code, out, err = run(capsys, "--limit", "4")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert [line.split()[0] for line in lines[1:5]] == ids_newest_first(mixed)[:4]
    assert lines[-1].startswith("4 tasks") and "--all" in lines[-1]

    code, out, _ = run(capsys, "--limit", str(len(STATE_OF)))
    assert out.splitlines()[-1] == f"{len(STATE_OF)} tasks", "no hint when nothing more matches"


def test_the_table_shows_id_workflow_and_version_state_times_in_utc_and_a_truncated_error(
    home: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    error = "[bold]refused[/bold]: " + "card declined " * 20
    store = SqliteStore(home / "state.db")
    fill(store, [task_events("long-error", "error", workflow="payments", version=3, error=error)])
    store.close()
    code, out, _ = run(capsys)
    assert code == 0
    header, row, footer = out.splitlines()
    assert header.split()[:3] == ["task", "workflow", "status"]
    assert row.split()[:5] == ["long-error", "payments", "v3", "error", "2025-03-01T12:00:00Z"]
    assert "[bold]refused[/bold]: card declined" in row, "errors are data, not rich markup"
    assert row.rstrip().endswith("…") and "card declined " * 20 not in row
    assert footer == "1 task"


def test_all_pages_through_every_task_once_whatever_the_page_size(
    mixed: list[list[Event]], capsys: pytest.CaptureFixture[str],
) -> None:
    for limit in ("1", "2", "5", str(len(STATE_OF) - 1), str(len(STATE_OF)), "100"):
        code, out, _ = run(capsys, "--json", "--all", "--limit", limit)
        assert code == 0
        assert [r["task_id"] for r in json_lines(out)] == ids_newest_first(mixed), limit
        code, out, _ = run(capsys, "--all", "--limit", limit, "--state", "error", "--state", "completed")
        expected = ids_newest_first(mixed, lambda _, state: state in ("error", "completed"))
        lines = out.splitlines()
        assert [line.split()[0] for line in lines[1:-1]] == expected
        assert lines[-1] == f"{len(expected)} tasks"


def tasks_created_together() -> list[list[Event]]:
    """Tasks of several states created in the same milliseconds, and more of them than a page holds."""
    states = ["error", "completed", "rejected", "running"]
    return [task_events(f"tie-{i:02d}", states[i % 4], at=START + timedelta(milliseconds=100 * (i // 7)))
            for i in range(30)]


def test_all_lists_tasks_created_in_the_same_millisecond_once_across_pages_and_states(
    store_spec: StoreSpec, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    tasks = tasks_created_together()
    store = store_spec.open()
    try:
        fill(store, tasks)
    finally:
        store.close()
    monkeypatch.setenv("STEPSTREAM_STORE_URL", str(store_spec))
    everything = sorted(((t[0].occurred_at, t[0].task_id) for t in tasks), reverse=True)
    for states in ([], ["error", "rejected"], ["error", "completed", "rejected", "running"]):
        expected = [task_id for _, task_id in everything if not states or _state(tasks, task_id) in states]
        for limit in ("1", "2", "3", "8"):
            state_args = (a for s in states for a in ("--state", s))
            code, out, _ = run(capsys, "--json", "--all", "--limit", limit, *state_args)
            assert code == 0
            assert [r["task_id"] for r in json_lines(out)] == expected, (states, limit)


def _state(tasks: list[list[Event]], task_id: str) -> str:
    last = next(t for t in tasks if t[0].task_id == task_id)[-1]
    return {"TaskFailed": "error", "TaskCompleted": "completed", "TaskRejected": "rejected",
            "StepStarted": "running"}[type(last).__name__]


class OtherCollation:
    """A store whose database orders task ids unlike Python does (as a PostgreSQL locale collation may):
    by the reversed id. Keyset pages follow that order, as a real database's would."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def tasks(self, *, state: str | None = None, workflow: str | None = None, since_ms: int | None = None,
              until_ms: int | None = None, before: tuple[int, str] | None = None,
              limit: int = 50) -> list[dict[str, Any]]:
        rows = self.store.tasks(state=state, workflow=workflow, since_ms=since_ms, until_ms=until_ms, limit=10**6)

        def key(created_at: int, task_id: str) -> tuple[int, str]:
            return created_at, task_id[::-1]

        rows.sort(key=lambda r: key(r["created_at"], r["task_id"]), reverse=True)
        if before is not None:
            rows = [r for r in rows if key(r["created_at"], r["task_id"]) < key(*before)]
        return rows[:limit]


def test_paging_over_several_states_needs_no_agreement_with_the_databases_order_of_task_ids(
    tmp_path: Path,
) -> None:
    tasks = tasks_created_together()
    store = SqliteStore(tmp_path / "state.db")
    fill(store, tasks)
    foreign: Any = OtherCollation(store)
    wanted = TaskFilter(states=("error", "completed", "rejected", "running"))
    expected = sorted(t[0].task_id for t in tasks)
    for size in (1, 2, 3, 5, 8, 40):
        listed = [row["task_id"] for page in all_tasks(foreign, wanted, size) for row in page]
        assert sorted(listed) == expected, size
    store.close()


def test_an_invalid_state_is_refused_naming_the_option_with_exit_2(
    mixed: list[list[Event]], capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["tasks", "--state", "done"])
    out, err = capsys.readouterr()
    assert exit_info.value.code == 2
    assert "--state" in err and "'done'" in err and "compensation_failed" in err
    assert out == ""


@pytest.mark.parametrize(("argv", "option"), [
    (["--limit", "0"], "--limit"),
    (["--limit", "many"], "--limit"),
    (["--since", "yesterday"], "--since"),
    (["--workflow", ""], "--workflow"),
])
def test_other_invalid_arguments_exit_2_naming_the_option(
    home: Path, capsys: pytest.CaptureFixture[str], argv: list[str], option: str,
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["tasks", *argv])
    assert exit_info.value.code == 2
    assert f"argument {option}" in capsys.readouterr().err


def test_until_not_after_since_exits_2_naming_until(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "--since", "2025-03-01T12:00:00Z", "--until", "2025-03-01T12:00:00+00:00")
    assert (code, out) == (2, "")
    assert "--until" in err


def test_a_store_no_projector_created_yet_is_an_empty_list_with_a_note_for_people_only(
    home: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run(capsys, "--json", "--all")
    assert (code, out, err) == (0, "", "")
    code, out, err = run(capsys, "--state", "error")
    assert (code, out) == (0, "0 tasks\n")
    assert "no state store" in err and str(home / "state.db") in err
    assert not (home / "state.db").exists(), "listing creates no store"


def test_an_empty_store_and_a_filter_matching_nothing_are_an_empty_list_with_exit_0(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    path = tmp_path / "elsewhere" / "store.db"
    monkeypatch.setenv("STEPSTREAM_STORE_PATH", str(path))
    SqliteStore(path).close()
    assert run(capsys, "--json") == (0, "", "")
    assert run(capsys) == (0, "0 tasks\n", "")
    store = SqliteStore(path)
    fill(store, [task_events("only", "completed")])
    store.close()
    assert run(capsys, "--json", "--state", "error", "--all") == (0, "", "")
    code, out, _ = run(capsys, "--json")
    assert (code, [r["task_id"] for r in json_lines(out)]) == (0, ["only"]), "STEPSTREAM_STORE_PATH is the store"
