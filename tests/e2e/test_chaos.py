"""The chaos matrix, one scenario of each mechanism (QUICK): a real dev server and worker processes
(either SIGKILLed where the scenario says, on a bed of its own; the others share one), the local
backend, the real trainer. A row passes only if the run recovered, no rank process was started
twice, no spare was claimed twice, no complete checkpoint was lost, the losses are those of the
run without a fault (bit for bit, or within 1e-4 after a reshard), and what the scenario adds
holds (a hang found in time and blamed right, a rank stuck in a collective found with the stacks
that show it, a sick node swapped with no step lost, no corrupt checkpoint loaded, a full disk
told);
bench/chaos.py prints the whole matrix."""

from __future__ import annotations

import pytest

from lazarus.chaos.run import run_scenario, shared_bed
from lazarus.chaos.scenarios import BY_NAME
from lazarus.commands.demo_run import default_kill_step
from lazarus.schema import load_spec
from tests.support.runs import SPECS

CHAOS_SPEC = SPECS / "chaos.yaml"

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

QUICK = [
    "worker-in-drain",
    "server-mid-recovery",
    "two-nodes-two-spares",
    "second-node-in-resume",
    "spare-before-claim",
    "node-hung",
    "rank-in-collective",
    "sick-node",
    "rank-raises",
    "newest-checkpoint-corrupt",
    "disk-full",
    "node-in-async-save",
]
"""One scenario of each mechanism, in about ten seconds each: the worker killed in drain here, in
resume on Slurm (tests/slurm/test_chaos.py); the variations of a
mechanism tested here run in the bench (bench/chaos.py): the plain node kill, the worker killed in
each stage of one recovery in turn, and in one stage at a time, the server down
already at the fault, the worker and a node together, two nodes with one spare, the spare lost
after its claim, one rank hung (node-hung stops all of a node), a node slowed 2x (a straggler
needs a run longer than the chaos spec's 40 steps of 20 ms of work: its detection is tested in
tests/unit/test_pace.py, its planned swap here by sick-node), every checkpoint corrupt, a
second node lost in the survivors' save. The suite stays within CI's budget so."""


@pytest.fixture(scope="module")
def bed(tmp_path_factory):
    """One server and worker for the scenarios that kill neither; stopped at the end, pass or fail.
    The worker serves them all: its nodes are forked from a forkserver of its own
    (tests/support/forked_worker.py); the scenarios with a bed of their own run `lazarus worker`."""
    with shared_bed(tmp_path_factory.mktemp("shared-bed"), "tests.support.forked_worker") as shared:
        yield shared


@pytest.mark.parametrize("name", QUICK)
async def test_the_run_survives(name, bed, reference, tmp_path):
    spec = load_spec(CHAOS_SPEC)
    row = await run_scenario(BY_NAME[name], tmp_path, spec, default_kill_step(spec), reference(CHAOS_SPEC), bed)
    assert row.passed, row.as_dict()
    assert row.incidents >= 1 and row.new_incarnations >= 1
    assert row.max_loss_difference is not None
