"""One node's launcher: starts the node's ranks of an incarnation with torchrun's environment,
and records how each one ended.

Run by the backend as `python -m lazarus.trainer.agent.launcher` with LAZARUS_RUN_DIR, LAZARUS_INCARNATION,
LAZARUS_NODE, LAZARUS_NODE_INDEX and LAZARUS_RESUME_STEP set (trainer/CONTRACT.md).

Why not torchrun as the per-node launcher: its agent imports torch before it starts a rank
(one to three seconds on a loaded node, paid again on every recovery), hosts the rendezvous
store inside the agent of node 0 (so losing that node's agent takes the store with it), and
cannot keep warm standbys. This launcher does what a static-rendezvous torchrun agent does
for the rank (the same environment: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
GROUP_RANK, GROUP_WORLD_SIZE, ROLE_*, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_ERROR_FILE), and
nothing torch-specific, so it starts in milliseconds. Rank 0 of the job hosts the store, as
under a plain torchrun.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from lazarus.schema.contract import (
    ENV_FAIL_AT,
    ENV_INCARNATION,
    ENV_LAUNCHER_LOCKS,
    ENV_NODE,
    ENV_NODE_INDEX,
    ENV_RUN_DIR,
    RankExit,
    read_heartbeat,
    write_exit,
)
from lazarus.schema.files import lock_is_held, process_start_time, read_json, take_lock, write_json_atomic
from lazarus.schema.records import Assignment
from lazarus.schema.run import BUILT_IN_TRAINER, RunSpec
from lazarus.schema.rundir import RunDir
from lazarus.trainer.agent.follow import Follower
from lazarus.trainer.agent.health_check import HealthCheck
from lazarus.trainer.agent.node_report import NodeReporter
from lazarus.trainer.agent.output import OutputWatch
from lazarus.trainer.agent.stack_dump import with_dump_hook

NODE_NICENESS = 5
"""Scheduling priority added to a node's launcher and ranks (`nice`)."""


def rank_command(command: list[str]) -> list[str]:
    """The argv to run: `python` (and the built-in trainer) mean this interpreter."""
    return [sys.executable, *command[1:]] if command[0] == "python" or command == BUILT_IN_TRAINER else list(command)


def rank_environment(
    spec: RunSpec, assignment: Assignment, run: RunDir, incarnation: int, node_index: int, rank: int, base: dict
) -> dict:
    """torchrun's environment for one rank, plus the contract's and the spec's variables."""
    layout = assignment.layout
    env = {**base, **spec.trainer.env}
    env.pop(ENV_FAIL_AT, None)
    env.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(layout.world_size),
            "LOCAL_RANK": str(rank % layout.ranks_per_node),
            "LOCAL_WORLD_SIZE": str(layout.ranks_per_node),
            "GROUP_RANK": str(node_index),
            "GROUP_WORLD_SIZE": str(len(assignment.nodes)),
            "ROLE_NAME": "default",
            "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(layout.world_size),
            "MASTER_ADDR": assignment.master_addr,
            "MASTER_PORT": str(assignment.master_port),
            "TORCHELASTIC_RUN_ID": run.root.name,
            # torchrun's meanings: the restarts so far, and how many the job may have.
            "TORCHELASTIC_RESTART_COUNT": str(incarnation),
            "TORCHELASTIC_MAX_RESTARTS": str(spec.recovery.max_incidents),
            "TORCHELASTIC_ERROR_FILE": str(run.error_file(incarnation, rank)),
            # NCCL: fail a broken collective with an error instead of hanging (ignored on CPU).
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
            "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
        }
    )
    fault = planned_fault(spec, assignment, incarnation, node_index)
    if fault is not None:
        env[ENV_FAIL_AT] = fault.planned
    # Each Python rank dumps its stacks on SIGUSR1 (trainer/agent/stack_dump.py), so a hang shows where it waited.
    return with_dump_hook(env, str(run.stacks_file(incarnation, rank)))


def planned_fault(spec: RunSpec, assignment: Assignment, incarnation: int, node_index: int):
    """The fault the spec plans for this node in this incarnation, if any."""
    node = assignment.nodes[node_index]
    return next((f for f in spec.faults if f.incarnation == incarnation and f.node == node), None)


def working_directory(spec: RunSpec, run: RunDir) -> Path:
    """Where the ranks run (created): trainer.workdir, else the run's own folder."""
    folder = Path(spec.trainer.workdir) if spec.trainer.workdir else run.work_dir
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _error_summary(path: Path) -> str:
    """The exception message torch's @record wrote, if the rank used it."""
    data = read_json(path)
    if not data:
        return ""
    message = data.get("message", {})
    if isinstance(message, dict):
        message = message.get("message", "")
    return str(message).strip().splitlines()[-1] if str(message).strip() else ""


LOG_TAIL_BYTES = 16384
"""How much of the end of a rank's log is searched for the traceback that ended it (bytes)."""


def _traceback_summary(log: Path) -> str:
    """The last line of the last Python traceback at the end of a rank's log ("ValueError: bad
    input"), for a script that does not use @record; "" when the log ends without one. A chained
    exception prints the one that ended the process last."""
    try:
        with open(log, "rb") as file:
            file.seek(max(0, file.seek(0, os.SEEK_END) - LOG_TAIL_BYTES))
            lines = file.read().decode(errors="replace").replace("\r", "\n").splitlines()
    except OSError:
        return ""
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last):")]
    if not starts:
        return ""
    # The frames are indented; the exception is the first line after them that is not.
    for line in lines[starts[-1] + 1 :]:
        if line.strip() and not line[0].isspace():
            return line.strip()[:500]
    return ""


def record_exit(run: RunDir, incarnation: int, rank: int, returncode: int) -> None:
    """Record how a rank's process ended, unless the rank recorded it itself."""
    beat = read_heartbeat(run, incarnation, rank)
    write_exit(
        run,
        incarnation,
        RankExit(
            rank=rank,
            code=returncode,
            step=beat.step if beat else None,
            time=time.time(),
            error=_error_summary(run.error_file(incarnation, rank))
            or (_traceback_summary(run.log_file(incarnation, rank)) if returncode > 0 else ""),
            signal=signal.Signals(-returncode).name if returncode < 0 else None,
            by="launcher",
        ),
    )


def start_cold(command: list[str], env: dict, log, lock_fd: int, cwd: Path):
    """Start a rank as a new process in `cwd` (the lock's descriptor is its only inherited one); returns a Popen."""
    return subprocess.Popen(
        command, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, pass_fds=(lock_fd,)
    )


def launch_node(run: RunDir, incarnation: int, node_index: int, base_env: dict, start_rank=start_cold) -> int:
    """Start this node's ranks (those not running and not ended), wait for them; returns 0.

    `start_rank(command, env, log, lock_fd, cwd)` starts one rank and returns an object with
    `pid` and `wait()`: a new process here, a fork of a warm standby in trainer/agent/standby/.
    """
    assignment = Assignment.model_validate_json(run.assignment_file(incarnation).read_text())
    # On the local backend every node shares this machine's cores with the controller; a real
    # node would not. Ranks (forked after this) inherit the lower priority, so a busy node
    # cannot delay the controller's reaction to a fault by a scheduler slice or two.
    os.nice(NODE_NICENESS)
    # Record this launcher's process group before any rank exists: the controller kills the
    # node by killing the group, which its ranks join when they are forked.
    node = assignment.nodes[node_index]
    me = {"pid": os.getpid(), "pgid": os.getpgid(0), "start_time": process_start_time(os.getpid()), "node": node}
    if "SLURM_JOB_ID" in base_env:  # the job step it runs in, in Slurm's words (squeue -s shows it)
        me["slurm_step"] = f"{base_env['SLURM_JOB_ID']}.{base_env.get('SLURM_STEP_ID', '')}"
        # A warm standby's fork runs in the standby's step, which ending the launcher must not end.
        me["step_is_standby"] = start_rank is not start_cold
    write_json_atomic(run.node_pid_file(incarnation, node_index), me)
    # The backend marks an incarnation ended before it kills it; a launcher it started a moment
    # too late (a launch cut short by a stop) holds its lock already, so it is either killed or sees this.
    if run.ended_file(incarnation).exists():
        print(f"lazarus launcher: incarnation {incarnation} has ended; starting no rank", flush=True)
        return 0
    spec = RunSpec.model_validate_json(run.spec_file.read_text())
    cwd = working_directory(spec, run)
    output = OutputWatch(run, incarnation, spec.trainer, planned_fault(spec, assignment, incarnation, node_index))
    per_node = assignment.layout.ranks_per_node
    ranks = range(node_index * per_node, (node_index + 1) * per_node)
    reporter = NodeReporter(run, incarnation, node_index, node, ranks, spec.recovery.heartbeat_interval_seconds)
    reporter.health = HealthCheck(spec.health, cwd, changed=reporter.changed)
    children: dict[int, object] = {}
    watched: list[int] = []
    for rank in ranks:
        fd = take_lock(run.lock_file(incarnation, rank))
        if fd is None:
            watched.append(rank)  # started by an earlier launcher of this node; wait for it too
            continue
        try:
            if run.exit_file(incarnation, rank).exists():
                continue  # it ran and ended; a restarted rank could not rejoin its peers
            env = rank_environment(spec, assignment, run, incarnation, node_index, rank, base_env)
            log = run.log_file(incarnation, rank)
            offset = log.stat().st_size if log.exists() else 0
            child = _start(run, incarnation, rank, rank_command(spec.trainer.command), env, fd, cwd, start_rank)
            if child is not None:
                children[rank] = child
                record = {"pid": child.pid, "start_time": process_start_time(child.pid), "node": node}
                write_json_atomic(run.pid_file(incarnation, rank), record)
                output.add(rank, child.pid, log, offset)
        finally:
            os.close(fd)
    reporter.launched.update(watched, children)
    # Where survivors keep their processes, this launcher follows its ranks into the incarnations they rejoin.
    follower = (
        Follower(run, incarnation, node_index, ranks, me, [reporter, output]) if spec.recovery.in_process else None
    )
    _wait_for_ranks(run, incarnation, children, watched, output, reporter, follower)
    return 0


def _wait_for_ranks(
    run: RunDir, incarnation: int, children: dict, watched: list[int], output, reporter, follower: Follower | None
) -> None:
    """Watch the ranks' output and report the node until every rank has ended, recording how each
    one this launcher started ended (in the incarnation it ended in, where they rejoined later ones)."""
    output.start()
    reporter.start()
    reporter.health.start()
    if follower is not None:
        follower.start()
    for rank, child in children.items():
        code = child.wait()
        output.finish(rank)
        record_exit(run, follower.incarnation if follower is not None else incarnation, rank, code)
        reporter.changed()
    if follower is not None:
        follower.stop()
    output.stop()
    reporter.health.stop()
    for rank in watched:
        while lock_is_held(run.lock_file(incarnation, rank)):
            time.sleep(0.05)
    reporter.stop()


def _start(run: RunDir, incarnation: int, rank: int, command: list[str], env: dict, lock_fd: int, cwd, start_rank):
    """Start one rank with its output in its log; None, with an exit record saying why, when the
    command cannot start."""
    log_path = run.log_file(incarnation, rank)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    run.error_file(incarnation, rank).parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        try:
            # The rank inherits the locked descriptor: the lock lives exactly as long as it does.
            return start_rank(command, env, log, lock_fd, cwd)
        except OSError as error:
            log.write(f"lazarus launcher: cannot start {command[0]}: {error.strerror}\n".encode())
            why = f"cannot start {command[0]!r}: {error.strerror} (trainer.command)"
    write_exit(run, incarnation, RankExit(rank=rank, code=127, step=0, time=time.time(), error=why, by="launcher"))
    return None


def main() -> None:
    """Entry point: `python -m lazarus.trainer.agent.launcher`."""
    missing = [name for name in (ENV_RUN_DIR, ENV_INCARNATION, ENV_NODE, ENV_NODE_INDEX) if name not in os.environ]
    if missing:
        raise SystemExit(f"lazarus launcher: missing environment variables {', '.join(missing)} (trainer/CONTRACT.md)")
    run = RunDir(os.environ[ENV_RUN_DIR])
    incarnation, index = int(os.environ[ENV_INCARNATION]), int(os.environ[ENV_NODE_INDEX])
    if os.environ.get(ENV_LAUNCHER_LOCKS) and not take_node_lock(run, incarnation, index):
        sys.exit(0)  # this node's launcher runs already (a repeated start)
    sys.exit(launch_node(run, incarnation, index, dict(os.environ)))


def take_node_lock(run: RunDir, incarnation: int, index: int) -> bool:
    """Hold the node's launcher lock, where whoever started this launcher could not hand it the
    lock (a Slurm job step: srun passes no descriptor); False when another launcher of the node
    holds it. The lock lives as long as this process."""
    if take_lock(run.node_lock_file(incarnation, index)) is None:
        return False
    # A group of its own, as start_locked gives a launcher: killing the node's processes kills this
    # group (the launcher and its ranks), never the slurmstepd that started it.
    os.setpgid(0, 0)
    return True


if __name__ == "__main__":
    main()
