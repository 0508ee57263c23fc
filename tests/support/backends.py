"""One face over each cluster backend for the tests that must hold on all of them (tests/backends/):
its cluster, a spec of stand-in ranks (rank.py), a launch, and how a node dies there (a SIGKILL
on the local backend, its kubelet gone on the emulated Kubernetes cluster)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from lazarus.infra.backend import ClusterBackend
from lazarus.schema import Assignment, RunSpec, parse_spec
from lazarus.schema.pool import SpareWant
from tests.support.waiting import wait_until

RANK = Path(__file__).resolve().parent / "rank.py"
"""The stand-in rank program the harness runs."""


@dataclass
class Harness:
    """A backend under test with two active nodes and spares, and its own way of killing a node."""

    name: str
    cluster: ClusterBackend
    home: Path
    cluster_section: dict
    active: list[str]
    spares: list[str]
    kill_node: Callable[[str, str], None]
    started: list[str] = field(default_factory=list)
    kubelet: object | None = None  # the fake kubelet that runs the pods (Kubernetes only)

    def spec(self, name: str = "suite", steps: int = 1_000_000) -> RunSpec:
        """Two nodes of one stand-in rank each; the spares as hot spares."""
        cluster = {"active_nodes": 2, "spare_nodes": len(self.spares), **self.cluster_section}
        return parse_spec(
            {
                "name": name,
                "layout": {"dp": 2},
                "trainer": {"command": ["python", str(RANK)], "steps": steps, "checkpoint_every": 10},
                "cluster": cluster,
            }
        )

    def lodged_want(self, run_id: str) -> SpareWant | None:
        """The run's need of spares as the backend keeps it for the other runs to read."""
        wants = getattr(self.cluster, "wants", None)
        if wants is not None:  # Kubernetes: on the run's ConfigMap, read by the pool's other runs
            namespace, pool = (
                self.cluster_section["kubernetes"]["namespace"],
                self.cluster_section["kubernetes"]["pool"],
            )
            lodged = wants.others(namespace, pool, "")
        else:  # the pool's store
            lodged = self.cluster.pool.read().wants  # pyright: ignore[reportAttributeAccessIssue]
        return next((w for w in lodged if w.run_id == run_id), None)

    def launch(self, run_id: str, spec: RunSpec | None = None) -> Assignment:
        """What the launch activity does: create the run, assign its active nodes, start incarnation 0."""
        spec = spec or self.spec()
        self.cluster.create(run_id, spec)
        self.started.append(run_id)
        active = sorted(n.name for n in self.cluster.inventory(run_id).nodes if n.role == "active")
        port = self.cluster.rendezvous_port(run_id)
        assignment = Assignment(incarnation=0, nodes=active, layout=spec.layout, master_port=port)
        recorded = self.cluster.commit_assignment(run_id, assignment)
        self.cluster.start_ranks(run_id, 0, 0)
        return recorded


def every_rank_training(harness: Harness, run_id: str, incarnation: int = 0):
    """Wait until every rank of the incarnation runs and has reported a step; returns the observation."""

    def training():
        observation = harness.cluster.observe(run_id, incarnation)
        return all(r.alive and r.heartbeat and r.heartbeat.step > 0 for r in observation.ranks) and observation

    return wait_until(training, f"every rank of incarnation {incarnation} to train ({harness.name})", timeout=60)


def launch_two_ranks(cluster, command: list[str], warm: bool, recovery: dict | None = None) -> None:
    """Start run r1 of `command` on node-0 and node-1 of a local backend, a rank each."""
    spec = parse_spec(
        {
            "name": "r",
            "cluster": {"active_nodes": 2, "spare_nodes": 0, "warm_standby": warm},
            "layout": {"dp": 2},
            "recovery": recovery or {},
            "trainer": {"command": command},
        }
    )
    cluster.create("r1", spec)
    cluster.commit_assignment(
        "r1", Assignment(incarnation=0, nodes=["node-0", "node-1"], layout=spec.layout, master_port=29999)
    )
    cluster.start_ranks("r1", 0, resume_step=0)
