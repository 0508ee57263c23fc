"""The Slurm backend: the run's nodes are nodes of a Slurm cluster, held in one allocation of the
run's active nodes and spares (`salloc --no-shell --no-kill`: a lost node does not end it), each
node's launcher (trainer/launcher.py) started as a job step on its node (`srun --jobid J -w NODE
--overlap`). Its files live in a run directory on a path every node shares (`home`), as on the
local backend, which it extends: the pool, liveness and heartbeats are read the same way.

Slurm's own words where they exist: a quarantined node is drained (`scontrol update
nodename=N state=drain reason=...`, with the incident, so that `sinfo -R` shows why) and resumed
only by `lazarus pool return` or the site's admin; a node slurmctld marks not responding, down or
drained by someone else counts as dead. Ranks start cold (no warm standbys on Slurm yet).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from lazarus.infra.backend import ClusterError
from lazarus.infra.local import LocalCluster
from lazarus.schema.contract import (
    ENV_INCARNATION,
    ENV_LAUNCHER_LOCKS,
    ENV_NODE,
    ENV_NODE_INDEX,
    ENV_RESUME_STEP,
    ENV_RUN_DIR,
    LaunchRecord,
    SurvivorSource,
)
from lazarus.schema.files import lock_is_held
from lazarus.schema.policy import RecoveryPolicy
from lazarus.schema.records import Assignment, Inventory
from lazarus.schema.run import RunSpec
from lazarus.schema.rundir import RunDir

COMMAND_SECONDS = 60.0
"""How long one Slurm command (salloc, scontrol, sinfo) may take before it counts as failed (seconds)."""

STATES_SECONDS = 1.0
"""How long a read of the nodes' states serves the watch's looks (seconds)."""

DEAD_STATES = ("down", "fail")
"""sinfo states of a node that runs nothing (a `*` suffix: slurmctld stopped hearing from it)."""


class SlurmCluster(LocalCluster):
    """Runs' nodes as nodes of the Slurm cluster SLURM_CONF names, with state under `home/runs/<run_id>`."""

    backend = "slurm"

    def __init__(self, home: str | Path, python: str = sys.executable, environ: dict | None = None):
        super().__init__(home, python)
        self.environ = dict(os.environ if environ is None else environ)  # SLURM_CONF, for every Slurm command
        self._states: dict[str, str] = {}
        self._states_read = float("-inf")

    def _slurm(self, *command: str) -> str:
        """Run a Slurm client command; its stdout, or ClusterError with what it said."""
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=COMMAND_SECONDS, env=self.environ)
        except (OSError, subprocess.TimeoutExpired) as error:
            raise ClusterError(f"{command[0]}: {error}") from None
        if done.returncode != 0:
            said = (done.stderr or done.stdout).strip().splitlines()
            raise ClusterError(f"{' '.join(command[:3])}: {said[-1] if said else f'exit {done.returncode}'}")
        return done.stdout + done.stderr

    # --- the allocation ----------------------------------------------------------------

    def create(self, run_id: str, spec: RunSpec) -> RunDir:
        """Create the run's state (LocalCluster.create: the pool's nodes are the cluster's) and hold
        its active nodes and spares in one allocation, once."""
        run = super().create(run_id, spec)
        if self.job_id(run_id) is None:
            nodes = [n.name for n in self.pool.inventory(run_id).nodes if n.role in ("active", "spare")]
            # The pool names nodes it lacks as the local backend would add them; Slurm has only its own.
            unknown = sorted(set(nodes) - set(self.node_states()))
            if unknown:
                self.pool.release(run_id)
                raise ClusterError(
                    f"the run needs {', '.join(unknown)}, which the Slurm cluster does not have: too few of its "
                    "nodes are free (a quarantined one comes back with `lazarus pool return NODE`)"
                )
            self._allocate(run, spec, nodes)
        return run

    def _allocate(self, run: RunDir, spec: RunSpec, nodes: list[str]) -> None:
        settings = spec.cluster.slurm
        command = ["salloc", "--no-shell", "--no-kill", "--oversubscribe", f"--nodes={len(nodes)}"]
        command += [f"--nodelist={','.join(nodes)}", f"--job-name=lazarus-{run.root.name}"]
        for flag, value in (("--partition", settings.partition), ("--account", settings.account)):
            if value:
                command.append(f"{flag}={value}")
        if settings.time_limit:
            command.append(f"--time={settings.time_limit}")
        said = self._slurm(*command)
        found = re.search(r"Granted job allocation (\d+)", said)
        if found is None:
            raise ClusterError(f"salloc granted no allocation: {said.strip()[-200:]}")
        (run.root / "slurm_job").write_text(found.group(1))

    def job_id(self, run_id: str) -> str | None:
        """The run's allocation (None before it has one)."""
        path = self.run_dir(run_id).root / "slurm_job"
        return path.read_text().strip() if path.exists() else None

    def allocated_nodes(self, run_id: str) -> list[str]:
        """The nodes of the run's allocation, as Slurm lists them."""
        job = self.job_id(run_id)
        if job is None:
            return []
        listed = self._slurm("squeue", "-h", "-j", job, "-o", "%N").strip()
        return self._slurm("scontrol", "show", "hostnames", listed).split() if listed else []

    def release_nodes(self, run_id: str) -> list[str]:
        """The run ended: its active nodes go back to the pool, and its allocation ends."""
        released = super().release_nodes(run_id)
        job = self.job_id(run_id)
        if job is not None:
            try:
                self._slurm("scancel", job)
            except ClusterError:
                pass  # ended already (a second release), or slurmctld away: the job's time limit ends it
        return released

    # --- launchers as job steps ----------------------------------------------------------

    def start_ranks(
        self,
        run_id: str,
        incarnation: int,
        resume_step: int,
        skipped: dict[int, str] | None = None,
        policy: RecoveryPolicy | None = None,
        survivors: SurvivorSource | None = None,
    ) -> LaunchRecord:
        """Start every node's launcher of an incarnation that is not running, as a job step on its node;
        returns the launch record in force."""
        run, assignment = self._incarnation(run_id, incarnation)
        record = self.record_launch(run_id, incarnation, resume_step, skipped, survivors)
        allocated = set(self.allocated_nodes(run_id))  # read once for every node's step
        for index, node in enumerate(assignment.nodes):
            self._start_launcher(run, incarnation, index, node, record.resume_step, allocated)
        return record

    def _start_launcher(
        self, run: RunDir, incarnation: int, index: int, node: str, resume_step: int, allocated: set[str] = frozenset()
    ) -> None:
        """Start the node's launcher as a step of the run's allocation on that node (a job of its own on a
        node the allocation lacks), unless one runs; the launcher takes its lock itself."""
        if lock_is_held(run.node_lock_file(incarnation, index)):
            return
        env = {
            **self.environ,
            ENV_RUN_DIR: str(run.root),
            ENV_INCARNATION: str(incarnation),
            ENV_NODE: node,
            ENV_NODE_INDEX: str(index),
            ENV_RESUME_STEP: str(resume_step),
            ENV_LAUNCHER_LOCKS: "1",
        }
        job = self.job_id(run.root.name)
        where = [f"--jobid={job}", "--overlap"] if job and node in allocated else []
        step = [
            "srun",
            *where,
            f"--nodelist={node}",
            "--nodes=1",
            "--ntasks=1",
            "--oversubscribe",
            "--kill-on-bad-exit=0",
        ]
        step += [f"--job-name=lazarus-{run.root.name}-{incarnation}-{index}", "--export=ALL"]
        log = run.incarnation(incarnation) / "nodes" / f"{index}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as output:
            child = subprocess.Popen(
                [*step, self.python, "-m", "lazarus.trainer.launcher"],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # the step outlives a crashed worker, as a node would
            )
        self._children.append(child)

    # --- nodes as Slurm sees them --------------------------------------------------------

    def node_states(self, fresh: bool = True) -> dict[str, str]:
        """Each node's state as sinfo shows it (idle, mixed, drained, down*, ...); unless `fresh`,
        as read within the last STATES_SECONDS (a watch looks every 0.1 s; slurmctld learns of a
        node in seconds)."""
        now = time.monotonic()
        if fresh or now - self._states_read > STATES_SECONDS:
            shown = self._slurm("sinfo", "-h", "-N", "-o", "%N %T")
            self._states = dict(line.split() for line in shown.splitlines() if len(line.split()) == 2)
            self._states_read = now
        return self._states

    def dead_nodes(self, assignment: Assignment) -> dict[str, datetime]:
        """The assignment's nodes the pool has seen die, and those slurmctld does not hear from,
        marks down or failed, or that someone else drained."""
        dead = super().dead_nodes(assignment)
        try:
            states = self.node_states(fresh=False)
        except ClusterError:
            return dead  # slurmctld not answering says nothing of the nodes
        quarantined = {n.name for n in self.pool.read().nodes if n.role == "quarantined"}
        for node in assignment.nodes:
            state = states.get(node, "")
            drained = state.startswith("drain") and node not in quarantined
            if state.endswith("*") or state.startswith(DEAD_STATES) or drained:
                dead.setdefault(node, datetime.now(UTC))
        return dead

    def quarantine(self, run_id: str, nodes: list[str], reason: str) -> None:
        """Hold the nodes out of the pool, and drain them in Slurm with the incident as the reason."""
        super().quarantine(run_id, nodes, reason)
        for node in nodes:
            self._slurm(
                "scontrol", "update", f"nodename={node}", "state=drain", f"reason=lazarus {run_id}: {reason}"[:250]
            )

    def return_node(self, run_id: str, node: str) -> Inventory:
        """A repaired node is resumed in Slurm and goes back to the pool as a spare."""
        state = self.node_states().get(node, "")
        if state.startswith("drain"):
            self._slurm("scontrol", "update", f"nodename={node}", "state=resume")
        return super().return_node(run_id, node)
