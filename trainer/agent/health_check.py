"""A node's health check (the spec's `health.command`), run by the node's launcher every interval
while its ranks train: the node is sick once a run of it fails, and the node's report says so
(schema/node_reports.py), so detect swaps it for a spare before it crashes the run."""

from __future__ import annotations

import threading

from lazarus.schema.health_checks import HealthChecks, run_check


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
