"""The recovery loop on a real Slurm cluster (tests/support/fixtures.py slurm_daemons): the
built-in trainer's ranks as job steps of one allocation, a node lost (its slurmd and every process
of its steps SIGKILLed), drained in Slurm with the incident as the reason, replaced by the
allocation's spare, and the losses those of the run without a fault."""

from __future__ import annotations

import asyncio
import json
import subprocess
import uuid

import pytest

from lazarus.client.config import Settings
from lazarus.client.runs import start_run
from lazarus.infra.backends.slurm.cluster import SlurmCluster
from lazarus.schema import RunState, load_spec
from lazarus.worker import build_worker
from tests.support.runs import SMALL_SPEC, assert_restored_from_survivors, losses, trained_step, with_absolute_command

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

KILL_AT_STEP = 15


async def node_lost_on_slurm(dev_env, daemons, folder, spares: int = 1):
    """The small spec on Slurm (`spares` hot spares), node-2 lost at step 15 (its slurmd and every
    process of its steps SIGKILLed); the final status, the run directory, the backend, and what
    `sinfo -R` said of each drained node once the run had ended."""
    small = with_absolute_command(load_spec(SMALL_SPEC))
    cluster_section = small.cluster.model_copy(update={"backend": "slurm", "spare_nodes": spares})
    spec = small.model_copy(update={"cluster": cluster_section})
    cluster = SlurmCluster(folder / "home", environ=daemons.env)
    queue, run_id = f"slurm-{uuid.uuid4().hex[:8]}", f"slurm-{uuid.uuid4().hex[:6]}"
    run = cluster.run_dir(run_id)
    try:
        async with build_worker(dev_env.client, queue, cluster):
            handle = await start_run(dev_env.client, Settings(task_queue=queue), spec, run_id)
            deadline = asyncio.get_running_loop().time() + 120
            while not (run.root.exists() and trained_step(run) >= KILL_AT_STEP):
                assert asyncio.get_running_loop().time() < deadline, "the run never reached the step of the fault"
                await asyncio.sleep(0.05)
            await asyncio.to_thread(daemons.kill_node, "node-2")
            status = await handle.result()
            said = subprocess.run(
                ["sinfo", "-R", "-h", "-o", "%N|%E"], capture_output=True, text=True, env=daemons.env, timeout=30
            ).stdout
            drained = dict(line.split("|", 1) for line in said.splitlines() if "|" in line)
    finally:
        cluster.stop_run(run_id)
        daemons.reset()
    return status, run, cluster, drained


async def test_a_node_lost_on_slurm_is_drained_with_its_incident_and_replaced_by_the_spare(
    dev_env, slurm_daemons, tmp_path, reference_losses
):
    status, run, cluster, drained = await node_lost_on_slurm(dev_env, slurm_daemons, tmp_path)

    assert status.state == RunState.COMPLETED and status.step == 40, status.reason
    [incident] = status.incidents
    assert incident.fault.nodes == ["node-2"] and incident.decision.replacements == {"node-2": "node-4"}
    assert incident.new_assignment.nodes == ["node-0", "node-1", "node-4", "node-3"]
    assert status.quarantined_nodes == ["node-2"]
    assert_restored_from_survivors(run, incident)
    # Every launcher ran as a job step of the run's one allocation, the spare's too.
    job = cluster.job_id(status.run_id)
    for incarnation, nodes in ((0, incident.old_assignment.nodes), (1, incident.new_assignment.nodes)):
        for index, node in enumerate(nodes):
            record = json.loads(run.node_pid_file(incarnation, index).read_text())
            assert record["slurm_step"].startswith(f"{job}.") and record["node"] == node, record
    # Slurm shows why the node is out: drained, the incident its reason.
    assert drained["node-2"].startswith(f"lazarus {status.run_id}: incident 1: rank_exit"), drained
    # Every step the resumed incarnation trained has the loss of the run without a fault, bit for bit.
    resumed = losses(run, incarnation=1)
    assert sorted(resumed) == list(range(incident.resumed_from_step + 1, 41))
    assert {s: loss for s, loss in resumed.items() if loss != reference_losses[s]} == {}


async def test_without_a_spare_a_run_on_slurm_reshards_and_keeps_the_math(
    dev_env, slurm_daemons, tmp_path, reference_losses
):
    status, run, _, drained = await node_lost_on_slurm(dev_env, slurm_daemons, tmp_path, spares=0)

    assert status.state == RunState.COMPLETED and status.step == 40 and status.layout.dp == 3, status.reason
    [incident] = status.incidents
    assert incident.decision.action == "reshard" and incident.decision.nodes == ["node-0", "node-1", "node-3"]
    assert "node-2" in drained
    resumed = losses(run, incarnation=1)
    assert sorted(resumed) == list(range(incident.resumed_from_step + 1, 41))
    # The same global batch over 3 replicas instead of 4: equal up to the order of the float sums.
    worst = max(abs(loss - reference_losses[s]) / abs(reference_losses[s]) for s, loss in resumed.items())
    assert worst < 1e-4, f"largest relative loss difference after the reshard: {worst:.2e}"
