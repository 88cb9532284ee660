"""The README as a newcomer reads it: every file of the repository it names is there (the design page
included, so a clone is self-contained), and ``stepstream`` alone shows the commands it describes."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from stepstream.cli import build_parser

ROOT = Path(__file__).parent.parent
PACKAGES = "docs|examples|schemas|eventstore|projections|scheduler|agents|supervisor|stepstream|tests|benchmarks"


def test_every_repository_file_the_readme_names_exists() -> None:
    readme = (ROOT / "README.md").read_text()
    named = set(re.findall(rf"[`(]((?:{PACKAGES})/[\w./*-]+)[`)]", readme))
    assert "docs/design.md" in named
    missing = sorted(path for path in named if not any(ROOT.glob(path.rstrip("/"))))
    assert missing == []
    assert "../" not in readme, "no reference outside the repository"


def test_stepstream_without_a_command_lists_every_command_and_exits_2() -> None:
    done = subprocess.run([sys.executable, "-m", "stepstream"], capture_output=True, text=True, timeout=60,
                          check=False, cwd=ROOT)
    commands = next(a for a in build_parser()._actions if a.dest == "command").choices
    assert done.returncode == 2 and commands
    for name in commands:
        assert re.search(rf"^\s+{name}\s+\S", done.stderr, re.MULTILINE), name
