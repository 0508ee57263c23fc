"""What the Slurm backend alone does (the shared suite is tests/backends/): a run that needs more
nodes than the Slurm cluster has free is refused, naming them, and holds none."""

from __future__ import annotations

import pytest

from lazarus.infra.backend import ClusterError
from lazarus.schema import parse_spec
from tests.support.backends import RANK

pytestmark = pytest.mark.timeout(120)


def test_a_run_needing_nodes_slurm_does_not_have_is_refused(slurm_backend):
    spec = parse_spec(
        {
            "name": "big",
            "layout": {"dp": 6},
            "trainer": {"command": ["python", str(RANK)]},
            "cluster": {"backend": "slurm", "active_nodes": 6, "spare_nodes": 1},
        }
    )
    with pytest.raises(ClusterError, match="node-5, node-6, which the Slurm cluster does not have"):
        slurm_backend.cluster.create("big", spec)
    assert slurm_backend.cluster.job_id("big") is None
    assert all(node.role == "free" for node in slurm_backend.cluster.pool.read().nodes)
