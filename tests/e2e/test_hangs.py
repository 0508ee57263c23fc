"""A hang of a script that reports no steps and knows nothing of Lazarus
(tests/user_script/inplace_checkpoints.py): one rank waits in a collective nobody completes, its
peers behind it in the step's all-reduce. The ranks worked, then every rank sits idle (no CPU, no
output): a hang, found by default once that lasted recovery.quiet_hang_seconds (no setting: the
script gives no step times to derive one from); every rank's Python stack is dumped and kept with
the incident; the run recovers on the spare and trains to its end."""

from __future__ import annotations

import pytest

from lazarus.schema import RunState
from tests.e2e.test_program_failures import STEP_LINE, run_to_end, script_spec

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


async def test_a_rank_stuck_in_a_collective_of_a_script_without_step_reports_is_found_with_its_stack(
    dev_env, home, tmp_path
):
    spec = script_spec(
        "stuck",
        tmp_path,
        args=["--steps", "30", "--stuck-at", "2:12"],
        pattern=None,  # no step reports: only the processes tell
        # Shortened here (the default is 10 s): what is tested is how the hang is found and blamed.
        recovery={"quiet_hang_seconds": 4.0},
    )
    quiet = spec.recovery.quiet_hang_seconds
    status, run = await run_to_end(dev_env, home, spec)

    assert status.state == RunState.COMPLETED, status.reason
    [incident] = status.incidents
    fault = incident.fault
    assert fault.kind == "hang" and "every rank has sat idle (no CPU, no output)" in fault.reason, fault.reason
    assert f"recovery.quiet_hang_seconds {quiet:g}: the script reports no steps" in fault.reason
    # Found once every rank had been idle for the hang time; the reason above says which: not the startup grace.
    found = (fault.detected_at - fault.occurred_at).total_seconds()
    assert quiet <= found, found
    # Every rank's stack is in the run directory; the stuck rank waits where no other does, so it
    # is blamed, and its stack is in the incident.
    assert (fault.rank, fault.nodes) == (2, ["node-2"]) and "waits where no other rank does" in fault.reason
    assert "Current thread" in fault.stack and "wait_for_the_peer_that_never_comes" in fault.stack
    assert "wait_for_the_peer_that_never_comes" in run.stacks_file(0, 2).read_text()
    for rank in (0, 1, 3):
        assert "in main" in run.stacks_file(0, rank).read_text()
    # Recovered: the next incarnation trained from the script's newest checkpoint to the end.
    assert incident.outcome == "recovered" and incident.new_assignment.incarnation == 1
    steps = [int(s) for s, _ in STEP_LINE.findall(run.log_file(1, 0).read_text())]
    assert steps == list(range(11, 31))


async def test_a_rank_spinning_forever_is_found_by_its_stack_that_stands_still(dev_env, home, tmp_path):
    """Rank 1 loops forever before the step's all-reduce (busy: it is never idle), its peers wait in
    the all-reduce. The step stalls while CPU burns, as in a long save; dumps of the ranks' stacks
    some seconds apart show rank 1 in the same function every time: a hang, blamed on it, with its
    stack; the run goes on from the script's checkpoint on the spare. (Shortened here: the defaults
    probe after 15 s of stall and want 10 s of a still stack.)"""
    probe = {"busy_probe_seconds": 2.0, "stack_still_seconds": 2.0}
    spec = script_spec("spin", tmp_path, args=["--steps", "30", "--spin-at", "1:14"], recovery=probe)
    status, run = await run_to_end(dev_env, home, spec)

    assert status.state == RunState.COMPLETED, status.reason
    [incident] = status.incidents
    fault = incident.fault
    assert (fault.kind, fault.rank, fault.nodes) == ("hang", 1, ["node-1"]), fault.reason
    assert "its Python stack has not moved in" in fault.reason and "in spin_forever" in fault.reason
    assert "spin_forever" in fault.stack and "spin_forever" in run.stacks_file(0, 1).read_text()
    steps = [int(s) for s, _ in STEP_LINE.findall(run.log_file(1, 0).read_text())]
    assert steps == list(range(11, 31))  # from checkpoint-10 to the end
