"""The one way commands make a rich console, so every command prints alike.

Data is printed as it is: no emoji codes (a step named ``:ship:`` stays text) and no highlighting. Output
that is not a terminal (a pipe, a log file another process reads) is not squeezed into rich's default of
80 columns: lines stay whole and tables get room, so a reader never gets half a line.
"""

from __future__ import annotations

import sys

from rich.console import Console

PIPED_WIDTH = 240  # tables written to a pipe or a file get this many columns


def command_console(*, stderr: bool = False) -> Console:
    stream = sys.stderr if stderr else sys.stdout
    terminal = stream.isatty()
    return Console(stderr=stderr, emoji=False, highlight=False, soft_wrap=not terminal,
                   width=None if terminal else PIPED_WIDTH)
