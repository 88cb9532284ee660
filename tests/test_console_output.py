"""What commands print is whole and literal: piped or logged output is not wrapped at 80 columns (the demo
once read half a line back from a log), ``:ship:`` in data stays text, and a progress bar's rate is the
average the summary line reports (it showed 0 records/s for a replay done in one batch)."""

from __future__ import annotations

import subprocess
import sys

from rich.progress import Task, TaskID

from projections.rebuild import _Rate

LONG = ":ship: " + "x" * 200


def test_command_output_to_a_pipe_is_whole_lines_with_emoji_codes_as_text() -> None:
    printed = subprocess.run(
        [sys.executable, "-c", f"from eventstore.console import command_console; command_console().print({LONG!r})"],
        capture_output=True, text=True, timeout=60, check=True)
    assert printed.stdout == LONG + "\n"


def test_the_progress_rate_is_the_average_since_the_start_even_after_one_update() -> None:
    task = Task(TaskID(0), "replaying", total=86.0, completed=86.0, _get_time=lambda: 11.0)
    task.start_time = 9.0  # 2 s elapsed at the end
    assert _Rate().render(task).plain == "43 records/s"
