"""The Slurm backend: the run's nodes are nodes of a Slurm cluster, held in one allocation of the
run's active nodes and spares (`salloc --no-shell --no-kill`: a lost node does not end it), each
node's launcher (trainer/agent/launcher.py) started as a job step on its node (`srun --jobid J -w NODE
--overlap`). Its files live in a run directory on a path every node shares (`home`), as on the
local backend, which it extends: the pool, liveness and heartbeats are read the same way.

Slurm's own words where they exist: a quarantined node is drained (`scontrol update
nodename=N state=drain reason=...`, with the incident, so that `sinfo -R` shows why) and resumed
only by `lazarus pool return` or the site's admin; a node slurmctld marks not responding, down or
drained by someone else counts as dead.

Warm standbys (trainer/agent/standby/port.py) run as job steps too, one per node of the allocation,
and take their orders on a port of the node's address (NodeAddr), as on Kubernetes: a FIFO on the
shared filesystem does not cross machines. A launch orders each node's standby to fork its
launcher; a node whose standby does not answer starts cold, as a job step of its own. A stop
orders the survivors' standbys to kill their launchers and cancels the cold launchers' steps
(`scancel --signal=KILL JOB.STEP`), so that the standbys stay warm for the next incarnation.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Collection
from datetime import UTC, datetime
from pathlib import Path

from lazarus.infra.backend import ClusterError
from lazarus.infra.backends.local.cluster import LocalCluster
from lazarus.infra.processes import start_in_session
from lazarus.infra.rate import fan_out
from lazarus.infra.standby_orders import CONNECT_SECONDS, order_standby, write_standby_secret
from lazarus.schema.contract import (
    ENV_LAUNCHER_LOCKS,
    ENV_NODE,
    ENV_RUN_DIR,
    ENV_STANDBY_ADDRESS,
    LaunchRecord,
    SurvivorSource,
    launcher_env,
)
from lazarus.schema.files import lock_is_held, read_json
from lazarus.schema.policy import RecoveryPolicy
from lazarus.schema.records import Assignment, Inventory
from lazarus.schema.run import RunSpec
from lazarus.schema.rundir import RunDir

COMMAND_SECONDS = 60.0
"""How long one Slurm command (salloc, scontrol, sinfo) may take before it counts as failed (seconds)."""

STATES_SECONDS = 1.0
"""How long a read of the nodes' states serves the watch's looks (seconds)."""

STANDBY_ANSWER_SECONDS = 60.0
"""How long a launch waits for a node's standby to answer (its step may still be importing torch,
as a cold launcher would) before the node's launcher starts cold instead (seconds)."""

STOP_ANSWER_SECONDS = 20.0
"""How long a stop waits for a node's standby to report its launchers gone (seconds); the
backend then kills what is left itself."""

DEAD_STATES = ("down", "fail")
"""sinfo states of a node that runs nothing (a `*` suffix: slurmctld stopped hearing from it)."""


class SlurmCluster(LocalCluster):
    """Runs' nodes as nodes of the Slurm cluster SLURM_CONF names, with state under `home/runs/<run_id>`."""

    backend = "slurm"
    quick_observe = False  # it asks slurmctld which nodes are down (sinfo)
    vets_spares = False  # a spare's health check would have to run on the node, in the run's allocation
    shares_host = False  # the ranks run on the cluster's nodes, which share LAZARUS_HOME's path
    keeps_survivors = False  # its launchers are job steps: a survivor node's is not followed yet
    quarantines_in_cluster = True  # a quarantined node is drained in Slurm

    @classmethod
    def open(cls, options):
        """The Slurm cluster SLURM_CONF names, once slurmctld answers: ClusterError, one line, where
        SLURM_CONF names no file or no controller answers."""
        conf = os.environ.get("SLURM_CONF")
        if conf and not Path(conf).is_file():
            # Slurm's clients would retry reading it for a minute before they say so.
            raise ClusterError(f"SLURM_CONF names {conf}, which is not a file")
        cluster = cls(options.home, store=options.store, runs=options.runs)
        try:
            cluster.node_states()
        except ClusterError as error:
            raise ClusterError(f"cannot reach a Slurm controller ({error}); is SLURM_CONF set?") from None
        cluster.pool  # noqa: B018 - opened now, so that a worker with a wrong store says so as it starts
        return cluster

    @classmethod
    def placement(cls, cluster) -> str:
        """The Slurm cluster, and its partition where the spec names one."""
        partition = f" (partition {cluster.slurm.partition})" if cluster.slurm.partition else ""
        return f" on the Slurm cluster SLURM_CONF names{partition}"

    def __init__(
        self,
        home: str | Path,
        python: str = sys.executable,
        environ: dict | None = None,
        store: str | None = None,
        runs: str | Path | None = None,
    ):
        super().__init__(home, python, store, runs)
        self.environ = dict(os.environ if environ is None else environ)  # SLURM_CONF, for every Slurm command
        self._states: dict[str, str] = {}
        self._states_read = float("-inf")
        self._standby_steps: dict[tuple[str, str], subprocess.Popen] = {}  # (run, node): its srun

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
        """Start every node's launcher of an incarnation that is not running: forked by the node's
        warm standby when the spec has them, else (or where the standby does not answer) as a job
        step of its own on the node; returns the launch record in force."""
        run, assignment = self._incarnation(run_id, incarnation)
        record = self.record_launch(run_id, incarnation, resume_step, skipped, survivors)
        allocated = set(self.allocated_nodes(run_id))  # read once for every node's step
        cold = [i for i in range(len(assignment.nodes)) if not lock_is_held(run.node_lock_file(incarnation, i))]
        if self.spec(run_id).cluster.warm_standby and cold:
            self.ensure_standbys(run_id, allocated)
            order = {"incarnation": incarnation, "resume_step": record.resume_step}
            answers = fan_out(
                [
                    lambda i=i: self._order(
                        run, assignment.nodes[i], {**order, "node_index": i}, STANDBY_ANSWER_SECONDS
                    )
                    for i in cold
                ]
            )
            cold = [i for i, answer in zip(cold, answers, strict=True) if not (answer or {}).get("started")]
        for index in cold:
            self._start_launcher(run, incarnation, index, assignment.nodes[index], record.resume_step, allocated)
        return record

    def _start_launcher(
        self,
        run: RunDir,
        incarnation: int,
        index: int,
        node: str,
        resume_step: int,
        allocated: Collection[str] = frozenset(),
    ) -> None:
        """Start the node's launcher as a step of the run's allocation on that node (a job of its own on a
        node the allocation lacks), unless one runs; the launcher takes its lock itself."""
        if lock_is_held(run.node_lock_file(incarnation, index)):
            return
        env = {
            **self.environ,
            **launcher_env(str(run.root), incarnation, node, index, resume_step),
            ENV_LAUNCHER_LOCKS: "1",
        }
        name = f"lazarus-{run.root.name}-{incarnation}-{index}"
        self._children.append(
            self._step(
                self._srun(run, node, name, allocated),
                "lazarus.trainer.agent.launcher",
                env,
                run.incarnation(incarnation) / "nodes" / f"{index}.log",
            )
        )

    def _srun(self, run: RunDir, node: str, name: str, allocated: Collection[str]) -> list[str]:
        """srun's flags for one task on `node` named `name`: a step of the run's allocation, or a job
        of its own on a node the allocation lacks (one the run regrew onto)."""
        job = self.job_id(run.root.name)
        where = [f"--jobid={job}", "--overlap"] if job and node in allocated else []
        return [
            "srun",
            *where,
            f"--nodelist={node}",
            "--nodes=1",
            "--ntasks=1",
            "--oversubscribe",
            "--kill-on-bad-exit=0",
            f"--job-name={name}",
        ]

    def _step(self, srun: list[str], module: str, env: dict, log: Path) -> subprocess.Popen:
        """Start `srun ... python -m MODULE` (its srun flags given) with `env`, its output appended
        to `log`; srun stays this machine's handle on the step, in a session of its own: the step
        outlives a crashed worker, as a node would."""
        return start_in_session([*srun, "--export=ALL", self.python, "-m", module], env, log)

    # --- warm standbys as job steps ------------------------------------------------------

    def ensure_standbys(self, run_id: str, allocated: set[str] | None = None) -> None:
        """Start a standby step on each healthy node of the run's allocation that has none, if the
        spec asks for them (a node outside the allocation starts its launchers cold)."""
        run, spec = self._existing(run_id), self.spec(run_id)
        if not spec.cluster.warm_standby:
            return
        allocated = set(self.allocated_nodes(run_id)) if allocated is None else allocated
        healthy = [n.name for n in self.inventory(run_id).nodes if n.healthy and n.role != "quarantined"]
        wanted = [node for node in healthy if node in allocated and not self._standby_lives(run, node)]
        if not wanted:
            return
        write_standby_secret(run)
        addresses = self.node_addresses()
        for node in wanted:
            home = run.standby(node)
            home.mkdir(parents=True, exist_ok=True)
            (home / "ready").unlink(missing_ok=True)  # an earlier standby's port: not this one's
            env = {
                **self.environ,
                **spec.trainer.env,
                ENV_RUN_DIR: str(run.root),
                ENV_NODE: node,
                ENV_STANDBY_ADDRESS: addresses.get(node, node),
            }
            env.setdefault("OMP_NUM_THREADS", "1")  # as the launcher sets it for ranks; read when torch is imported
            srun = self._srun(run, node, f"lazarus-{run_id}-standby", allocated)
            self._standby_steps[(run_id, node)] = step = self._step(
                srun, "lazarus.trainer.agent.standby", env, home / "log"
            )
            self._children.append(step)  # reaped with the others once it ends

    def _standby_lives(self, run: RunDir, node: str) -> bool:
        """Whether the node has a standby of the run: its lock is held, or the step this backend
        started for it has not ended (srun may still be placing it)."""
        step = self._standby_steps.get((run.root.name, node))
        return lock_is_held(run.standby(node) / "lock") or (step is not None and step.poll() is None)

    def _order(self, run: RunDir, node: str, order: dict, timeout: float) -> dict | None:
        """One order to the node's standby and its answer (None: no standby, or no answer in time)."""
        if not run.standby_token_file.exists():
            return None
        return order_standby(run, node, order, timeout, lambda: self._standby_lives(run, node))

    def _standby_sender(self, run: RunDir) -> Callable[[str, dict], object] | None:
        return lambda node, order: self._order(run, node, order, CONNECT_SECONDS)

    def node_addresses(self) -> dict[str, str]:
        """Each node's address as slurmctld knows it (NodeAddr), where its standby listens."""
        shown = self._slurm("scontrol", "show", "node", "-o")
        fields = [dict(f.split("=", 1) for f in line.split() if "=" in f) for line in shown.splitlines()]
        return {f["NodeName"]: f.get("NodeAddr", f["NodeName"]) for f in fields if "NodeName" in f}

    def stop_incarnation(self, run_id: str, incarnation: int) -> list[int]:
        """End the incarnation's launchers and ranks (_stop_steps), then kill whatever is left
        (LocalCluster.stop_incarnation) and wait for it; returns the ranks that were alive."""
        run, assignment = self._incarnation(run_id, incarnation)
        run.end(incarnation)  # before any stop: a launcher ordered a moment ago must not start ranks
        alive = self._stop_steps(run, assignment, assignment.nodes)
        return sorted(alive.union(super().stop_incarnation(run_id, incarnation)))

    def stop_nodes(self, run_id: str, incarnation: int, nodes: list[str]) -> list[int]:
        """End the incarnation's launchers and ranks on `nodes` as stop_incarnation does."""
        run, assignment = self._incarnation(run_id, incarnation)
        alive = self._stop_steps(run, assignment, nodes)
        return sorted(alive.union(super().stop_nodes(run_id, incarnation, nodes)))

    def _stop_steps(self, run: RunDir, assignment: Assignment, nodes: list[str]) -> set[int]:
        """The standbys of live `nodes` kill the launchers they forked (and stay warm), the cold
        launchers' steps are cancelled; returns the ranks on `nodes` that were alive."""
        incarnation, per_node = assignment.incarnation, assignment.layout.ranks_per_node
        indices = [i for i, node in enumerate(assignment.nodes) if node in nodes]
        alive = {
            r
            for i in indices
            for r in range(i * per_node, (i + 1) * per_node)
            if lock_is_held(run.lock_file(incarnation, r))
        }
        dead = set(self.dead_nodes(assignment))
        records = {i: read_json(run.node_pid_file(incarnation, i)) or {} for i in indices}
        warm = [assignment.nodes[i] for i, r in records.items() if r.get("step_is_standby")]
        fan_out(
            [
                lambda node=node: self._order(run, node, {"stop": incarnation}, STOP_ANSWER_SECONDS)
                for node in warm
                if node not in dead
            ]
        )
        self._cancel(
            [r["slurm_step"] for r in records.values() if r.get("slurm_step") and not r.get("step_is_standby")]
        )
        return alive

    def release_standbys(self, run_id: str) -> None:
        """The run ended: cancel its standbys' steps, and wait until they are gone."""
        self._cancel_standbys(run_id)
        super().release_standbys(run_id)

    def quarantine(self, run_id: str, nodes: list[str], reason: str, counted: bool = True) -> None:
        """Hold the nodes out of the pool (its breaker first), end their standbys, drain them in Slurm (`sinfo -R`)."""
        super().quarantine(run_id, nodes, reason, counted)  # the breaker first: refused, nothing is touched
        self._cancel_standbys(run_id, nodes)
        for node in nodes:
            self._slurm(
                "scontrol", "update", f"nodename={node}", "state=drain", f"reason=lazarus {run_id}: {reason}"[:250]
            )

    def stop_run(self, run_id: str) -> None:
        """Cancel every step of the run (standbys and launchers, on any node), then kill and wait
        for what is left (LocalCluster.stop_run)."""
        self._cancel_steps(run_id, lambda name: name.startswith(f"lazarus-{run_id}-"))
        super().stop_run(run_id)

    def _cancel_standbys(self, run_id: str, nodes: list[str] | None = None) -> None:
        """Cancel the steps of the run's standbys (on `nodes`, default all)."""
        self._cancel_steps(run_id, lambda name: name == f"lazarus-{run_id}-standby", nodes)

    def _cancel_steps(self, run_id: str, named, nodes: list[str] | None = None) -> None:
        """Cancel the run's steps whose name `named(name)` accepts (on `nodes`, default all), as squeue
        lists them; with slurmctld away, the pid-record kill that follows ends what runs here."""
        try:
            listed = self._slurm("squeue", "-h", "-s", "-o", "%i %j %N")
        except ClusterError:
            return
        rows = [line.split() for line in listed.splitlines()]
        self._cancel([r[0] for r in rows if len(r) == 3 and named(r[1]) and (nodes is None or r[2] in nodes)])

    def _cancel(self, steps: list[str]) -> None:
        """SIGKILL the tasks of Slurm steps (JOB.STEP); those ended already, or on a node slurmctld
        cannot reach, are left to the kill that follows."""
        if steps:
            try:
                self._slurm("scancel", "--signal=KILL", *steps)
            except ClusterError:
                pass

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
        quarantined = {n for n, node in self.pool.nodes(assignment.nodes).items() if node.role == "quarantined"}
        for node in assignment.nodes:
            state = states.get(node, "")
            drained = state.startswith("drain") and node not in quarantined
            if state.endswith("*") or state.startswith(DEAD_STATES) or drained:
                dead.setdefault(node, datetime.now(UTC))
        return dead

    def return_node(self, run_id: str, node: str) -> Inventory:
        """A repaired node is resumed in Slurm and goes back to the pool as a spare."""
        state = self.node_states().get(node, "")
        if state.startswith("drain"):
            self._slurm("scontrol", "update", f"nodename={node}", "state=resume")
        return super().return_node(run_id, node)
