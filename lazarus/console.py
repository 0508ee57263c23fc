"""Where the CLI's output goes: a rich console for stdout, one for stderr, and stdout kept for JSON."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from typing import TextIO

from rich import box
from rich.console import Console
from rich.table import Table

PIPED_WIDTH = 120
"""Columns of output that goes to a file or a pipe (rich would assume 80 and wrap the tables)."""


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or already closed
        return False


def _console(on_stderr: bool) -> Console:
    terminal = _is_terminal(sys.stderr if on_stderr else sys.stdout)
    return Console(
        stderr=on_stderr,
        # Decided by the stream alone: a file or a pipe never gets escape codes, even where FORCE_COLOR is set.
        force_terminal=terminal,
        width=None if terminal or os.environ.get("COLUMNS", "").isdigit() else PIPED_WIDTH,
        # What we print holds run ids, node names and reasons: text to show, never markup to interpret.
        markup=False,
        emoji=False,
        highlight=False,
        # Sentences stay one line each, as long as they are (a terminal wraps them itself); tables
        # still fit the width.
        soft_wrap=True,
    )


stdout = _console(on_stderr=False)
"""The console for results (tables, reports); follows sys.stdout, so redirections apply."""
stderr = _console(on_stderr=True)
"""The console for progress that must not mix with a result on stdout."""


def table(*headers: str, right: tuple[str, ...] = ()) -> Table:
    """A borderless table with these column headers; the columns named in `right` hold numbers."""
    grid = Table(box=box.HORIZONTALS, show_edge=False, pad_edge=False, header_style="bold")
    for header in headers:
        grid.add_column(header, justify="right" if header in right else "left")
    return grid


@contextlib.contextmanager
def stdout_reserved_for_json() -> Iterator[Callable[[object], None]]:
    """Keep stdout for one JSON document: while the block runs, file descriptor 1 and sys.stdout
    point at stderr, so that nothing a native library, a child process or a stray print writes can
    reach stdout. Yields `emit(document)`, which writes the document to the real stdout (once)."""
    sys.stdout.flush()
    real_stdout = os.dup(1)  # not inherited by child processes (os.dup makes it non-inheritable)
    emitted = False

    def emit(document: object) -> None:
        nonlocal emitted
        if emitted:
            raise RuntimeError("stdout carries one JSON document; a second was emitted")
        emitted = True
        data = (json.dumps(document, indent=2) + "\n").encode()
        while data:
            data = data[os.write(real_stdout, data) :]

    try:
        os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield emit
    finally:
        sys.stderr.flush()
        os.dup2(real_stdout, 1)
        os.close(real_stdout)
