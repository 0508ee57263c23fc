"""Prometheus metrics of the recovery activities (served by the worker, `lazarus worker --metrics-port`)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Stages last from milliseconds (reschedule) to minutes (resume at scale).
BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


LAG_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30)


@dataclass(frozen=True)
class Span:
    """One successful activity attempt as the activity itself timed it (wall clock, seconds since the epoch)."""

    workflow_id: str | None  # None for an activity no workflow started (activity.Info)
    stage: str
    attempt: int
    started: float
    ended: float


class Metrics:
    """The worker's metrics, in a registry of their own so tests and workers do not share state."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.stage_seconds = Histogram(
            "lazarus_stage_seconds",
            "Duration of a recovery stage's successful activity attempt (detect: fault to report).",
            ["stage"],
            buckets=BUCKETS,
            registry=self.registry,
        )
        self.incidents = Counter(
            "lazarus_incidents",
            "Recoveries by the fault that started them and the decision taken.",
            ["kind", "decision"],
            registry=self.registry,
        )
        self.restores = Counter(
            "lazarus_restores",
            "Incarnations a resume started (after a fault or an operator's restart), by where their state came "
            "from: survivors, checkpoint or scratch.",
            ["source"],
            registry=self.registry,
        )
        self.lost_steps = Counter(
            "lazarus_lost_steps",
            "Completed steps lost to faults and trained again (steps).",
            registry=self.registry,
        )
        self.runs = Gauge(
            "lazarus_runs",
            "TrainingRun workflows by state (from the LazarusState search attribute).",
            ["state"],
            registry=self.registry,
        )
        self.loop_lag = Histogram(
            "lazarus_loop_lag_seconds",
            "How late the worker's event loop ran a timer (seconds): every heartbeat and every look waits "
            "on it, so a lag near an activity's heartbeat timeout fails its attempts.",
            buckets=LAG_BUCKETS,
            registry=self.registry,
        )
        self.start_lag = Histogram(
            "lazarus_activity_start_lag_seconds",
            "From the worker taking an activity task (its heartbeat and start-to-close timers start then) to the "
            "activity's code starting, by stage (seconds): time a busy worker holds a task before it runs it.",
            ["stage"],
            buckets=LAG_BUCKETS,
            registry=self.registry,
        )
        # The newest attempts, for benchmarks that split a recovery into work and orchestration.
        self.spans: deque[Span] = deque(maxlen=10_000)
