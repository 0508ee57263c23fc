"""The helper a training script imports to be recoverable under Lazarus (torch only; no controller).

    from lazarus.session import TrainingSession

    session = TrainingSession.from_environ()
    if session.resume_step:                        # restore what you saved at that step
        state = session.load_survivor_state() or torch.load(session.resume_checkpoint / "model.pt")
    for step in range(session.resume_step + 1, session.total_steps + 1):
        try:
            loss = train_one_step(...)
        except Exception:                          # a peer died: the state is that after step - 1
            session.save_survivor_state(step - 1, state)   # if the spec sets trainer.survivor_state
            raise
        session.step_done(step, loss)              # heartbeat (every rank), metrics line (rank 0)
        if session.checkpoint_due(step):
            torch.save(state, session.checkpoint_dir(step) / f"rank-{rank}.pt")   # your format
            dist.barrier()
            session.commit_checkpoint(step)        # rank 0: the manifest, last
        if session.stop_requested():               # an operator's pause, abort or reshard
            ...save and commit a checkpoint of this step..., then break
    session.finish(step)                           # exit record: done at this step

Everything it does is the file contract of trainer/CONTRACT.md, so a script can follow the
contract without it. It needs only the environment the launcher sets.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from pathlib import Path

from lazarus.schema.contract import (
    ENV_INCARNATION,
    ENV_NODE,
    ENV_RESUME_STEP,
    ENV_RUN_DIR,
    Heartbeat,
    MetricsLine,
    MetricsLog,
    Phase,
    RankExit,
    read_launch,
    write_exit,
    write_heartbeat,
)
from lazarus.schema.layout import MESH_DIMENSIONS
from lazarus.schema.records import Assignment
from lazarus.schema.run import RunSpec
from lazarus.schema.rundir import RunDir, commit_checkpoint
from lazarus.trainer.sdk.faults import maybe_fail


def commit_or_say_why(run: RunDir, step: int, incarnation: int) -> bool:
    """Commit checkpoint `step` (its manifest, last); when the controller has ended the incarnation,
    commit nothing, say so on stderr, and return False."""
    if commit_checkpoint(run, step, incarnation):
        return True
    print(
        f"lazarus trainer: incarnation {incarnation} was ended by the controller; checkpoint of step {step} "
        "not committed",
        file=sys.stderr,
        flush=True,
    )
    return False


class TrainingSession:
    """One rank's view of its run: resume step, checkpoint folders, heartbeats, metrics, exit."""

    def __init__(self, run: RunDir, incarnation: int, rank: int, world_size: int, node: str, resume_step: int):
        self.run = run
        self.incarnation = incarnation
        self.rank = rank
        self.world_size = world_size
        self.node = node
        self.resume_step = resume_step
        """Step of the checkpoint to restore (0: start from scratch); the controller chose it."""
        spec = RunSpec.model_validate_json(run.spec_file.read_text())
        self.total_steps = spec.trainer.steps
        """trainer.steps: the step at which the run is complete."""
        self.checkpoint_every = spec.trainer.checkpoint_every
        """trainer.checkpoint_every: steps between checkpoints."""
        self.saves_survivors = spec.trainer.saves_survivors
        """Whether the spec says this trainer saves its state when a collective breaks (the
        controller then waits for it and may restore from it)."""
        self.layout = Assignment.model_validate_json(run.assignment_file(incarnation).read_text()).layout
        self.first_step_at: float | None = None
        self._first_step: int | None = None
        self._phases: dict[str, float] = {}  # phase -> when this rank first reported it
        self._step = resume_step  # newest step reported, for the exit record
        self.warning: str | None = None  # see warn()
        self._alive: threading.Thread | None = None
        self._beat: Heartbeat | None = None  # the newest heartbeat, which the liveness thread rewrites
        self._beat_lock = threading.Lock()  # one heartbeat file, two writers: the steps and the thread
        self._alive_every = spec.recovery.heartbeat_interval_seconds
        self._metrics = MetricsLog(run) if rank == 0 else None
        self.heartbeat(resume_step, "starting")

    @classmethod
    def from_environ(cls, environ=os.environ) -> TrainingSession:
        """The session of this process, from the launcher's environment."""
        missing = [name for name in ("RANK", "WORLD_SIZE", ENV_RUN_DIR, ENV_INCARNATION) if name not in environ]
        if missing:
            raise RuntimeError(f"not started by Lazarus: {', '.join(missing)} missing (trainer/CONTRACT.md)")
        return cls(
            RunDir(environ[ENV_RUN_DIR]),
            int(environ[ENV_INCARNATION]),
            int(environ["RANK"]),
            int(environ["WORLD_SIZE"]),
            environ.get(ENV_NODE, "local"),
            int(environ.get(ENV_RESUME_STEP, "0")),
        )

    def wait_for_store(self, timeout: float = 300.0) -> None:
        """Before init_process_group on a rank other than 0: return once rank 0's store
        (MASTER_ADDR:MASTER_PORT) accepts connections, or after `timeout` seconds.

        torch's TCPStore client that finds no server backs off for half a second or more
        before it tries again. The ranks of a warm start begin within milliseconds of each
        other, so whichever reaches init_process_group before rank 0 listens would lose that
        backoff on every resume; connecting here first costs nothing.
        """
        if self.rank == 0 or "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
            return
        address = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                socket.create_connection(address, timeout=1.0).close()
                return
            except OSError:
                time.sleep(0.002)

    @property
    def coordinates(self) -> dict[str, int]:
        """This rank's place in the layout: {"dp", "pp", "dp_shard", "tp"} (schema/layout.py)."""
        return self.layout.coordinates(self.rank)

    def device_mesh(self, device_type: str = "cpu"):
        """The run's device mesh, built from this incarnation's assignment, after init_process_group:
        dimensions ("dp", "pp", "dp_shard", "tp") of the layout's sizes (1 where unused), this rank at
        its `coordinates`. `mesh["tp"]` is for parallelize_module, `mesh["dp_shard"]` (or
        `mesh["dp", "dp_shard"]` for HSDP) for fully_shard; after a reshard the same call gives
        the smaller mesh."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, self.layout.shape, mesh_dim_names=MESH_DIMENSIONS)

    def checkpoint_dir(self, step: int) -> Path:
        """The folder for the checkpoint of `step` (created): every rank of this incarnation writes
        into the same one, and no other incarnation does (`checkpoints/step-N.incarnation-K/`)."""
        folder = self.run.checkpoint_folder(step, self.incarnation)
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    @property
    def resume_checkpoint(self) -> Path | None:
        """The folder to restore from, or None when starting from scratch."""
        return self.run.checkpoint(self.resume_step) if self.resume_step else None

    def checkpoint_due(self, step: int) -> bool:
        """True at every checkpoint_every-th step and at the last one."""
        return step % self.checkpoint_every == 0 or step == self.total_steps

    def commit_checkpoint(self, step: int) -> None:
        """Rank 0, after every rank has written `step` (barrier first): write the manifest, last.

        Until then the folder does not count and is never restored.
        """
        maybe_fail("checkpoint", step)
        if self.rank == 0:
            commit_or_say_why(self.run, step, self.incarnation)

    def save_survivor_state(self, step: int, state) -> bool:
        """After a collective broke (a peer's node died), and before anything changed the state
        after `step` steps: save this rank's share of it, `state` (anything torch.save takes,
        such as {"model": model.state_dict(), "optimizer": optimizer.state_dict()}; local
        tensors only, for no collective works now). Call it where the step failed, then re-raise.

        The next incarnation then starts from the last step every survivor completed instead of
        the newest checkpoint, if a survivor saved each (pp, dp_shard, tp) place. Returns False,
        saving nothing, when the spec does not set trainer.survivor_state or the controller has
        already ended this incarnation.
        """
        if not self.saves_survivors:
            return False
        from lazarus.trainer.sdk.survivors import write_state

        return write_state(self.run, self.incarnation, self.rank, self.coordinates, step, state)

    def keep_process(self, step: int, state):
        """With recovery.in_process, where a collective broke after `step` steps (a peer's node
        died) and before anything changed `state` (this rank's share, anything picklable): keep
        this process. The broken groups are left behind, the rank waits at this step boundary, and
        where it rejoins the next incarnation, the default process group is the new one (DDP and
        other wrappers must be built again over it) and the return value is the state every rank
        goes on from. None where the controller starts the next incarnation afresh (or without
        in_process, or on NCCL): then save_survivor_state and re-raise, as before. A checkpoint
        save still in flight must have ended, or been given up and never to be committed, before
        this call: once every survivor waits, the controller removes an uncommitted folder."""
        spec = RunSpec.model_validate_json(self.run.spec_file.read_text())
        if not spec.recovery.in_process:
            return None
        from lazarus.trainer.sdk.rejoin import keep_process

        return keep_process(self, step, state, spec.recovery.rejoin_timeout_seconds)

    def load_survivor_state(self):
        """The state to resume from when the controller chose the fault's survivors over the
        checkpoint: what the survivor at this rank's place passed to save_survivor_state, or, where
        the survivors kept their processes (keep_process), what the one at this rank's place holds,
        received over the new group: a collective, to call right after init_process_group, before
        DDP or any other collective. Its step is resume_step. None when the resume is from the
        checkpoint of resume_step or from scratch. Raises if a file does not match its manifest."""
        launch = read_launch(self.run, self.incarnation) if self.resume_step else None
        if launch is not None and launch.rejoin is not None:
            from lazarus.trainer.sdk.rejoin import share_state

            return share_state(self.layout, self.rank, launch.rejoin, None)
        if launch is None or launch.survivors is None:
            return None
        from lazarus.trainer.sdk.survivors import read_state

        source = launch.survivors
        return read_state(self.run, source.incarnation, source.ranks[self.rank])[1]

    def move_to(self, incarnation: int, resume_step: int) -> None:
        """Go on as the same rank of `incarnation`, in this process: a survivor the controller kept
        (RecoveryPolicy.in_process; trainer/sdk/rejoin.py). Its lock, pid record, environment,
        layout and heartbeats are that incarnation's from now on; the step it resumes is the one it
        waited at."""
        from lazarus.trainer.sdk.rejoin import move_rank

        move_rank(self.run, self.rank, self.node, incarnation)
        assignment = Assignment.model_validate_json(self.run.assignment_file(incarnation).read_text())
        os.environ.update(
            {
                ENV_INCARNATION: str(incarnation),
                ENV_RESUME_STEP: str(resume_step),
                "MASTER_ADDR": assignment.master_addr,
                "MASTER_PORT": str(assignment.master_port),
                "TORCHELASTIC_RESTART_COUNT": str(incarnation),
                "TORCHELASTIC_ERROR_FILE": str(self.run.error_file(incarnation, self.rank)),
            }
        )
        with self._beat_lock:
            self.incarnation, self.layout, self.resume_step = incarnation, assignment.layout, resume_step
            self.first_step_at, self._first_step, self._phases = None, None, {}
        self.heartbeat(resume_step, "starting")

    def heartbeat(self, step: int, phase: Phase = "training", compute_seconds: float | None = None) -> None:
        """Tell the controller this rank completed `step` (call after every optimizer step)."""
        now = time.time()
        if phase == "training" and self.first_step_at is None:
            self.first_step_at, self._first_step = now, step
        self._phases.setdefault(phase, now)
        self._step = step
        beat = Heartbeat(
            rank=self.rank,
            step=step,
            phase=phase,
            time=now,
            phases=dict(self._phases),
            first_step_at=self.first_step_at,
            first_step=self._first_step,
            warning=self.warning,
            alive_at=now,
            compute_seconds=compute_seconds,
        )
        with self._beat_lock:
            self._beat = beat
            write_heartbeat(self.run, self.incarnation, beat)
        if self._alive is None and phase not in ("done", "stopped"):
            self._alive = threading.Thread(target=self._keep_alive, name="lazarus-alive", daemon=True)
            self._alive.start()

    def _keep_alive(self) -> None:
        """Rewrite the newest heartbeat with a fresh alive_at every heartbeat interval, until the
        rank ends: a step blocked in a collective leaves its time (the progress) as it was."""
        while True:
            time.sleep(self._alive_every)
            with self._beat_lock:
                if self._beat is None or self._beat.phase in ("done", "stopped"):
                    return
                self._beat = self._beat.model_copy(update={"alive_at": time.time()})
                write_heartbeat(self.run, self.incarnation, self._beat)

    def warn(self, message: str) -> None:
        """Tell the controller something it should show though this rank trains on (a checkpoint
        lost to a full disk); it rides on this rank's heartbeats from the next one on."""
        self.warning = message

    def log_metrics(self, step: int, loss: float, **extra) -> None:
        """Rank 0: one line of metrics.jsonl for `step` (other ranks: nothing)."""
        if self._metrics:
            self._metrics.append(
                MetricsLine(step=step, loss=loss, incarnation=self.incarnation, dp=self.layout.dp, **extra)
            )

    def step_done(self, step: int, loss: float | None = None, compute_seconds: float | None = None) -> None:
        """Heartbeat, and on rank 0 the metrics line: the one call per step. A planned fault at
        this step (`faults` in the spec) ends the process here, the step trained but not reported.
        `compute_seconds`: this rank's own work on the step before it waited for its peers (the
        forward and backward before the gradients' all-reduce), from which a slow node is found."""
        maybe_fail("step", step)
        self.heartbeat(step, compute_seconds=compute_seconds)
        if loss is not None:
            self.log_metrics(step, loss)

    def stop_requested(self, agree=None) -> bool:
        """Whether the controller asked the run to checkpoint and stop.

        Every rank must stop at the same step, so the answer is rank 0's, shared with a small
        all-reduce over the default process group (or `agree(flag) -> flag`, e.g. your own
        collective); call it at the same point of every step on every rank.
        """
        asked = self.rank == 0 and self.run.stop_file(self.incarnation).exists()
        if agree is not None:
            return bool(agree(asked))
        import torch
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            return asked
        device = f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"
        flag = torch.tensor([1.0 if asked else 0.0], device=device)
        dist.all_reduce(flag)
        return flag.item() > 0

    def finish(self, step: int, stopped: bool = False) -> None:
        """Record that this rank ended on its own at `step` (the run is complete at total_steps)."""
        self.heartbeat(step, "stopped" if stopped else "done")
        write_exit(self.run, self.incarnation, RankExit(rank=self.rank, code=0, step=step, time=time.time()))
        if self._metrics:
            self._metrics.close()

    def fail(self, code: int, error: str) -> None:
        """Record that this rank is ending with `code` because of `error` (its last line is kept)."""
        last = error.strip().splitlines()[-1] if error.strip() else ""
        write_exit(
            self.run,
            self.incarnation,
            RankExit(rank=self.rank, code=code, step=self._step, time=time.time(), error=last),
        )
