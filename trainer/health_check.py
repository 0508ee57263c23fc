"""A node's health check (the spec's `health.command`), run by the node's launcher every interval
while its ranks train: the node is sick once a run of it fails, and the node's report says so
(schema/node_reports.py), so detect swaps it for a spare before it crashes the run."""

from __future__ import annotations

import subprocess
import threading

from lazarus.schema.health_checks import HealthChecks

OUTPUT_KEPT_CHARACTERS = 300
"""How much of a failed check's output the report keeps (characters, from its end)."""


class HealthCheck:
    """The thread that runs the check; `failure` says why the node is sick (None: healthy so far)."""

    def __init__(self, checks: HealthChecks, cwd=None, changed=None):
        self.checks, self.cwd = checks, cwd
        self.changed = changed or (lambda: None)  # told when the node turns sick (the report is rewritten)
        self.failure: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="health-check", daemon=True)

    def start(self) -> None:
        """Run the check now and every interval, unless the spec names none."""
        if self.checks.command:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            failure = run_check(self.checks, self.cwd)
            if failure is not None:
                # Sick stays sick for this incarnation: a check that passes again later does not
                # make a node that failed one trustworthy.
                self.failure = failure
                self.changed()
                return
            self._stop.wait(self.checks.interval_seconds)


def run_check(checks: HealthChecks, cwd=None) -> str | None:
    """Run the check once: None when it passed, else why it failed, in one line."""
    shown = " ".join(checks.command)
    try:
        done = subprocess.run(
            checks.command,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            timeout=checks.timeout_seconds,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return f"health check `{shown}` gave no answer within {checks.timeout_seconds:g} s"
    except OSError as error:
        return f"health check `{shown}` cannot run: {error.strerror}"
    if done.returncode == 0:
        return None
    said = " ".join(done.stdout.decode(errors="replace").split())[-OUTPUT_KEPT_CHARACTERS:]
    return f"health check `{shown}` exited with {done.returncode}" + (f": {said}" if said else "")
