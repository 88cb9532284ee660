"""Where a command looks for the project folder (broker state, logs, state store) when STEPSTREAM_HOME is
not set: from a subfolder, a project's folder is found as git finds ``.git``; from outside any project,
the checkout's; and a message about a missing broker or store names the folder it looked in."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from eventstore.settings import HOME_NAME, default_home
from projections.store import Positioned, SqliteStore
from tests.histories import histories


def _tree(root: Path, *folders: str) -> None:
    for folder in folders:
        (root / folder).mkdir(parents=True, exist_ok=True)


def test_from_a_subfolder_the_nearest_project_home_is_found(tmp_path: Path) -> None:
    _tree(tmp_path, f"project/{HOME_NAME}", "project/src/deep")
    (tmp_path / "project" / "pyproject.toml").write_text("")
    assert default_home(tmp_path / "project" / "src" / "deep") == tmp_path / "project" / HOME_NAME


def test_a_project_root_without_a_home_yet_gets_its_own_rather_than_a_parents(tmp_path: Path) -> None:
    _tree(tmp_path, HOME_NAME, "clone/sub")
    (tmp_path / "clone" / "pyproject.toml").write_text("")
    assert default_home(tmp_path / "clone" / "sub") == tmp_path / "clone" / HOME_NAME


def test_outside_any_project_the_checkouts_home_is_used_if_it_exists(tmp_path: Path) -> None:
    _tree(tmp_path, "elsewhere", f"checkout/{HOME_NAME}")
    (tmp_path / "checkout" / "pyproject.toml").write_text("")
    assert default_home(tmp_path / "elsewhere", tmp_path / "checkout") == tmp_path / "checkout" / HOME_NAME
    fresh = tmp_path / "fresh-checkout"
    _tree(tmp_path, "fresh-checkout")
    assert default_home(tmp_path / "elsewhere", fresh) == tmp_path / "elsewhere" / HOME_NAME


def test_the_cli_run_from_a_subfolder_reads_the_projects_store(tmp_path: Path) -> None:
    project = tmp_path / "project"
    _tree(project, HOME_NAME, "notes/today")
    (project / "pyproject.toml").write_text("")
    store = SqliteStore(project / HOME_NAME / "state.db")
    store.apply_events("stepstream.events", [Positioned(0, i, e) for i, e in enumerate(histories(1, seed=3))])
    store.close()
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPSTREAM_")}
    done = subprocess.run([sys.executable, "-m", "stepstream", "status", "task-0000000"], env=env,
                          cwd=project / "notes" / "today", capture_output=True, text=True, timeout=60, check=False)
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    assert done.stdout.startswith("task-0000000: ")
    missing = subprocess.run([sys.executable, "-m", "stepstream", "submit", "orders", "--input", "{}"], env=env,
                             cwd=project / "notes", capture_output=True, text=True, timeout=60, check=False)
    assert missing.returncode == 69
    assert f"no local broker running in {project / HOME_NAME}:" in missing.stderr
