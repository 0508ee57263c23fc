"""Named points where a worker stops dead on purpose, so tests can kill it mid-stage.

LAZARUS_FAILPOINTS=drain.after_quarantine,resume.after_launch makes the worker, on reaching
such a point, write `<LAZARUS_FAILPOINT_DIR>/<name>` (holding its pid) and wait there
forever. A test waits for that file, SIGKILLs the worker, and starts another one: the
crash then lands exactly inside the stage instead of wherever a timer happened to fire.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterable
from pathlib import Path

ENV_FAILPOINTS = "LAZARUS_FAILPOINTS"
"""Tests only: the failpoints armed in this worker, comma-separated (STAGE_FAILPOINTS)."""
ENV_FAILPOINT_DIR = "LAZARUS_FAILPOINT_DIR"
"""Tests only: where a worker that reached an armed failpoint writes its marker and waits."""

STAGE_FAILPOINTS = {
    "detect": "detect.after_fault",
    "drain": "drain.after_quarantine",
    "reschedule": "reschedule.after_inventory",
    "replace_or_reshard": "replace_or_reshard.after_claim",
    "resume": "resume.after_launch",
}
"""One point inside each recovery stage, after the stage has done something a retry must find
(the fault noted, the nodes quarantined, the spares claimed, the ranks launched)."""


class Failpoints:
    """The failpoints armed in this worker (none by default)."""

    def __init__(self, armed: Iterable[str] = frozenset(), marker_dir: Path | None = None):
        self.armed = set(armed)
        self.marker_dir = marker_dir

    @classmethod
    def from_environ(cls, environ=os.environ) -> Failpoints:
        names = {n.strip() for n in environ.get(ENV_FAILPOINTS, "").split(",") if n.strip()}
        unknown = sorted(names - set(STAGE_FAILPOINTS.values()))
        if unknown:
            raise SystemExit(
                f"{ENV_FAILPOINTS}: no failpoint {', '.join(unknown)} (known: {', '.join(STAGE_FAILPOINTS.values())})"
            )
        if names and ENV_FAILPOINT_DIR not in environ:
            raise SystemExit(f"{ENV_FAILPOINTS} needs {ENV_FAILPOINT_DIR} to say where to write markers")
        return cls(names, Path(environ[ENV_FAILPOINT_DIR]) if names else None)

    async def reach(self, name: str) -> None:
        """Return at once unless `name` is armed; if it is, announce it and never return."""
        if name not in self.armed:
            return
        assert self.marker_dir is not None, "a failpoint is armed with the folder for its marker"
        self.marker_dir.mkdir(parents=True, exist_ok=True)
        (self.marker_dir / name).write_text(str(os.getpid()))
        await asyncio.Event().wait()
