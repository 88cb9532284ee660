"""The benchmarks run as modules of the ``benchmarks`` package from the project folder, as BENCHMARKS.md
shows: each one imports (the project's packages, not a benchmark named like one) and parses its options.
What they measure needs a broker and minutes; that is run by hand."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
MODULES = sorted(path.stem for path in (ROOT / "benchmarks").glob("*.py") if path.stem not in {"__init__", "shared"})


def test_every_benchmark_is_listed() -> None:
    assert MODULES == ["agent_calls", "broker_kill_loop", "burst", "console", "event_store", "replay", "restore",
                       "scaling", "sealing", "submit", "throttling", "timers", "waiting_out_kills", "workflow"]


@pytest.mark.parametrize("module", MODULES)
def test_a_benchmark_runs_as_a_module(module: str) -> None:
    done = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", "--help"], capture_output=True, text=True,
                          timeout=60, check=False, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout
