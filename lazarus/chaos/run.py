"""Running a scenario of the matrix (lazarus.chaos.scenarios) on a bed and judging what it left:
the common row (lazarus.chaos.judge) and what the scenario must show beyond it."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
import traceback
import uuid
from pathlib import Path

from lazarus.chaos.bed import ChaosBed, ChaosError
from lazarus.chaos.judge import Row, judge
from lazarus.chaos.scenarios import DERIVED_HANG_LIMIT_SECONDS, HANG_FOUND_MARGIN_SECONDS, Scenario
from lazarus.chaos.trial import Trial
from lazarus.infra.harness.slurm_daemons import SlurmDaemons
from lazarus.schema.contract import read_heartbeat, read_launch
from lazarus.schema.run import RunSpec


@contextlib.contextmanager
def shared_bed(folder: Path, worker_entry: str = "lazarus.cli"):
    """A bed with its server and one plain worker up, for the scenarios that kill neither (the
    worker runs `python -m WORKER_ENTRY worker`)."""
    bed = ChaosBed(folder, worker_entry=worker_entry)
    try:
        bed.server.start()
        bed.start_worker()
        yield bed
    finally:
        bed.close()


def scenario_checks(trial: Trial, status) -> list[str]:
    """What a scenario must show beyond the common row: a hang found in time and blamed right, no
    resume from a checkpoint the scenario corrupted."""
    notes = []
    if trial.hang is not None and status.incidents:
        node, stopped_at = trial.hang
        fault = status.incidents[0].fault
        found = fault.detected_at.timestamp() - stopped_at
        notes.append(f"{fault.kind} on {', '.join(fault.nodes)} found {found:.1f} s after the stop{judged_by(fault)}")
        explicit = trial.spec.recovery.hang_after_seconds
        limit = DERIVED_HANG_LIMIT_SECONDS if explicit is None else explicit + HANG_FOUND_MARGIN_SECONDS
        if fault.kind != "hang" or fault.nodes != [node] or found > limit:
            notes.append(f"FAIL the hang of {node} was not found as one within {limit:.0f} s")
    if trial.swapped is not None:
        notes += swap_checks(*trial.swapped, status)
    if any(fault.effect in HELD_IN for fault in trial.spec.faults) and status.incidents:
        notes += held_checks(trial, status)
    if trial.disk_full is not None:
        notes += disk_full_checks(trial, status, trial.disk_full)
    if trial.in_flight is not None and status.incidents:
        incident = status.incidents[0]
        if (incident.checkpoint_in_flight, incident.discarded_checkpoints) != (trial.in_flight, [trial.in_flight]):
            notes.append(
                f"FAIL the checkpoint of step {trial.in_flight}, written at the fault, was not found in flight and "
                f"discarded (in flight {incident.checkpoint_in_flight}, discarded {incident.discarded_checkpoints})"
            )
    if trial.half_saved is not None:
        notes += half_saved_checks(trial, trial.half_saved)
    for incident in status.incidents:
        if incident.resumed_from_step in trial.corrupted:
            notes.append(f"FAIL resumed from the corrupted checkpoint of step {incident.resumed_from_step}")
    return notes


def judged_by(fault) -> str:
    """The hang time the watch judged a hang by, as its reason says it (', hang time N s'); '' otherwise."""
    found = re.search(r"hang time ([\d.]+) s|(?:hang_after|quiet_hang)_seconds ([\d.]+)", fault.reason)
    return f", hang time {next(g for g in found.groups() if g)} s" if found else ""


def half_saved_checks(trial: Trial, node: str) -> list[str]:
    """The node's ranks of the first incarnation died with their survivor state half written (a
    partial file, no manifest), or where survivors keep their processes, at their boundary (they
    said so, and none rejoined): otherwise the scenario did not test what it says."""
    index = trial.assignment(0).nodes.index(node)
    per_node = trial.spec.layout.ranks_per_node
    ranks = range(index * per_node, (index + 1) * per_node)
    if trial.spec.recovery.in_process:
        return at_boundary_checks(trial, node, ranks)
    half = [r for r in ranks if trial.run.survivor_state(0, r).with_suffix(".partial").exists()]
    whole = [r for r in ranks if trial.run.survivor_manifest(0, r).exists()]
    if half != list(ranks) or whole:
        return [f"FAIL {node}'s ranks did not die half-way through their survivor save (partial {half}, whole {whole})"]
    return [f"{node}'s ranks {half} died half-way through their survivor save"]


def at_boundary_checks(trial: Trial, node: str, ranks: range) -> list[str]:
    """The node's ranks of the first incarnation left their broken groups and died at their boundary
    before they said they wait there, and no rank of the run rejoined the next incarnation in its process."""
    said = "waiting at the boundary"
    there = [r for r in ranks if (log := trial.run.log_file(0, r)).exists() and said in log.read_text()]
    waited = [r for r in ranks if (beat := read_heartbeat(trial.run, 0, r)) is not None and beat.phase == "waiting"]
    rejoined = [k for k in trial.run.incarnations() if (launch := read_launch(trial.run, k)) and launch.rejoin]
    if there != list(ranks) or waited or rejoined:
        return [
            f"FAIL {node}'s ranks did not die at their boundary (there {there}, waited {waited}, "
            f"rejoined in {rejoined})"
        ]
    return [f"{node}'s ranks {there} died at their boundary; the survivors fell back to the restart path"]


def disk_full_checks(trial: Trial, status, lost: int) -> list[str]:
    """The checkpoint the full disk failed never counted, the recovery took the one before it, and
    the operator was told."""
    notes = []
    assert trial.watch is not None, "the trial started"
    # The next incarnation trains that step again and commits it: only the first one's counts here.
    if trial.watch.committed.get(lost, (None, None))[1] == 0:
        notes.append(f"FAIL the checkpoint of step {lost}, written to a full disk, was committed")
    # The newest the first incarnation committed: the one before the lost, or (when the write failed
    # late, under load) the next, written before the node died.
    kept = [step for step, (_, k) in trial.watch.committed.items() if k == 0 and step != lost]
    previous = max(kept, default=None)
    if status.incidents and status.incidents[0].resumed_from_step != previous:
        notes.append(f"FAIL resumed from step {status.incidents[0].resumed_from_step}, not the checkpoint {previous}")
    said = f"checkpoint of step {lost} not written"
    warned = [w for w in status.warnings if said in w]
    notes.append(f"warning: {warned[0]}" if warned else f"FAIL no warning '{said}' in the run's status")
    return notes


async def run_scenario(
    scenario: Scenario,
    folder: Path,
    spec: RunSpec,
    kill_at: int,
    reference: dict[int, float],
    shared: ChaosBed | None = None,
    slurm: SlurmDaemons | None = None,
) -> Row:
    """Run one scenario on a bed of its own under `folder` (or on `shared`, where the scenario
    kills neither its worker nor its server), on the local backend or the Slurm cluster `slurm`;
    its row of the matrix."""
    started = time.monotonic()
    bed = shared if shared is not None and not scenario.own_bed else ChaosBed(folder, slurm)
    own = bed is not shared
    trial = None
    try:
        if own:
            await asyncio.to_thread(bed.server.start)
            bed.start_worker(*scenario.failpoints)
        trial = Trial(bed, scenario.spec_for(spec, kill_at), f"chaos-{scenario.name}-{uuid.uuid4().hex[:4]}")
        await trial.start()
        assert trial.watch is not None, "start() made it"
        await scenario.act(trial, kill_at)
        status = await trial.outcome()
        trial.watch.stop()
        row = judge(
            scenario.name,
            trial.spec,
            trial.run,
            status,
            reference,
            trial.watch.committed,
            trial.watch.gone,
            trial.corrupted,
        )
        row.notes = trial.notes + row.notes + scenario_checks(trial, status)
        row.injected = injected(trial)
        row.blamed = status.incidents[0].fault.nodes if status.incidents else None
    except ChaosError as error:
        row = Row(scenario=scenario.name, notes=[*(trial.notes if trial else []), f"FAIL {error}"])
    except Exception as error:  # noqa: BLE001 - a broken bed fails its row, not the whole matrix
        traceback.print_exc()
        row = Row(scenario=scenario.name, notes=[f"FAIL the bed broke: {type(error).__name__}: {error}"])
    finally:
        if trial is not None and trial.watch is not None:
            trial.watch.stop()
        # Here, not in a thread: a cancelled scenario (Ctrl-C) still ends what it started.
        if own:
            bed.close()
        elif trial is not None:
            if trial.handle is not None:
                with contextlib.suppress(Exception):  # ended already, as it should have
                    await trial.handle.terminate("the chaos scenario ended")
            bed.cluster.stop_run(trial.run_id)
            bed.cluster.repair_after(trial.run_id)  # the next scenario finds the nodes a fresh home has
    row.seconds = round(time.monotonic() - started, 1)
    return row


def swap_checks(node: str, kind: str, broken_at: float, status) -> list[str]:
    """The slowed or sick node found as what it is, swapped with no step lost."""
    if not status.incidents:
        return [f"FAIL {node} was to be swapped but never was"]
    incident = status.incidents[0]
    fault = incident.fault
    found = fault.detected_at.timestamp() - broken_at
    notes = [f"{fault.kind} on {', '.join(fault.nodes)} found {found:.1f} s after it was broken: {fault.reason}"]
    if fault.kind != kind or fault.nodes != [node]:
        notes.append(f"FAIL {node} was not found as {kind} ({fault.kind}: {fault.reason})")
    if incident.resumed_from_step != fault.step:
        notes.append(f"FAIL the swap lost steps: stopped at {fault.step}, resumed from {incident.resumed_from_step}")
    return notes


def injected(trial: Trial) -> list[str]:
    """The nodes the scenario broke: killed, stopped, held by a planned fault, slowed or made sick
    (a planned exception is the program's, no node's)."""
    if trial.hang is not None:
        return [trial.hang[0]]
    if trial.swapped is not None:
        return [trial.swapped[0]]
    planned = {f.node for f in trial.spec.faults if f.effect != "raise" and f.incarnation == 0}
    return sorted(planned | set(trial.killed))


HELD_IN = {"stuck": "wait_for_the_peer_that_never_comes", "spin": "spin_forever"}
"""The function a planned fault holds its rank in (trainer/sdk/session.py), by effect: its stack shows it."""


def held_checks(trial: Trial, status) -> list[str]:
    """A rank held forever (stuck in a collective, or spinning): found as a hang, blamed on its node,
    and every rank's Python stack dumped, the held one's showing where it is."""
    fault, planned = status.incidents[0].fault, trial.spec.faults[0]
    found = (fault.detected_at - fault.occurred_at).total_seconds()
    since = "the first rank went idle" if planned.effect == "stuck" else "the step stalled"
    notes = [f"{fault.kind} on {', '.join(fault.nodes)}, found {found:.1f} s after {since}{judged_by(fault)}"]
    if fault.kind != "hang":
        notes.append(f"FAIL the {planned.effect} rank was not found as a hang ({fault.kind}: {fault.reason})")
    if fault.nodes != [planned.node]:
        notes.append(f"FAIL blamed {', '.join(fault.nodes)}, not the {planned.effect} {planned.node}")
    held = trial.assignment(fault.incarnation).nodes.index(planned.node)
    dump = trial.run.stacks_file(fault.incarnation, held)
    if not dump.exists() or HELD_IN[planned.effect] not in dump.read_text():
        notes.append(f"FAIL no stack dump of rank {held} shows where it is")
    return notes
