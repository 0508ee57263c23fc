"""The controller's crashes on a real Slurm cluster (tests/support/fixtures.py slurm_daemons): the
chaos matrix's worker-in-resume scenario with `lazarus worker --backend slurm` processes, a node lost
whole (its slurmd and every process of its steps SIGKILLed), and the worker SIGKILLed inside the
resume, a fresh one taking over. A worker killed in every stage in turn is the same scenario five
times over (a minute here): `bench/chaos.py --slurm --only worker-in-every-stage` runs it."""

from __future__ import annotations

import json

import pytest

from lazarus.chaos.run import run_scenario
from lazarus.chaos.scenarios import BY_NAME
from lazarus.commands.demo_run import default_kill_step
from lazarus.schema import load_spec
from tests.support.runs import SPECS

CHAOS_SPEC = SPECS / "chaos.yaml"

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


async def test_a_worker_killed_in_a_slurm_resume_starts_no_step_twice(slurm_daemons, reference, tmp_path):
    chaos = load_spec(CHAOS_SPEC)
    spec = chaos.model_copy(update={"cluster": chaos.cluster.model_copy(update={"backend": "slurm"})})
    try:
        row = await run_scenario(
            BY_NAME["worker-in-resume"],
            tmp_path,
            spec,
            default_kill_step(spec),
            reference(CHAOS_SPEC),
            slurm=slurm_daemons,
        )
    finally:
        slurm_daemons.reset()
    # Recovered on the spare with the losses of the run without a fault, bit for bit; no rank
    # started twice, no spare claimed twice, no complete checkpoint lost (lazarus.chaos.judge).
    assert row.passed, row.as_dict()
    assert row.incidents == 1 and row.new_incarnations == 1
    assert row.duplicate_starts == 0 and row.double_claims == 0 and row.max_loss_difference == 0.0
    # Each incarnation's four launchers ran on four distinct nodes, inside steps of the run's allocation.
    run = tmp_path / "home" / "runs"
    [run_dir] = list(run.iterdir())
    job = (run_dir / "slurm_job").read_text().strip()
    for incarnation in ("0", "1"):
        nodes = run_dir / "incarnations" / incarnation / "nodes"
        records = [json.loads(p.read_text()) for p in sorted(nodes.glob("*.pid"))]
        assert len(records) == 4 and len({r["node"] for r in records}) == 4, records
        assert all(r["slurm_step"].startswith(f"{job}.") for r in records), records
