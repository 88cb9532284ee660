"""The allowed import directions between the packages (``[tool.importlinter]`` in pyproject.toml): nothing in
the six core packages imports the front or the demo, the layers point one way, and the four services do not
import each other. ``make lint`` runs the same check; it is here too because CI runs only the test suite."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_every_import_contract_is_kept() -> None:
    lint_imports = Path(sys.executable).parent / "lint-imports"
    done = subprocess.run([str(lint_imports), "--no-cache"], capture_output=True, text=True, timeout=120,
                          check=False, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout
