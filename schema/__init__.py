"""The language of a run: what a user writes and what the system records (pydantic only)."""

from lazarus.schema.layout import Layout
from lazarus.schema.load import SpecError, load_spec, parse_spec
from lazarus.schema.policy import RecoveryPolicy, StagePolicies, StagePolicy
from lazarus.schema.records import (
    STAGES,
    Assignment,
    Decision,
    DetectResult,
    FaultReport,
    Incident,
    Inventory,
    NodeRecord,
    RankProgress,
    RunStart,
    RunState,
    RunStatus,
    StageRecord,
)
from lazarus.schema.run import ClusterSpec, FaultInjection, RunSpec, TrainerSettings

__all__ = [
    "STAGES",
    "Assignment",
    "ClusterSpec",
    "Decision",
    "DetectResult",
    "FaultInjection",
    "FaultReport",
    "Incident",
    "Inventory",
    "Layout",
    "NodeRecord",
    "RankProgress",
    "RecoveryPolicy",
    "RunSpec",
    "RunStart",
    "RunState",
    "RunStatus",
    "SpecError",
    "StagePolicies",
    "StagePolicy",
    "StageRecord",
    "TrainerSettings",
    "load_spec",
    "parse_spec",
]
