"""The built-in training program: one rank of a dp x pp x dp_shard x tp GPT run (contract: trainer/CONTRACT.md).

Run as `python -m lazarus.trainer` by the node launcher (trainer/agent/launcher.py), with torchrun's
environment plus LAZARUS_RUN_DIR, LAZARUS_INCARNATION, LAZARUS_NODE and LAZARUS_RESUME_STEP.
It uses lazarus.session for the contract, as a user's script would.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from datetime import timedelta

from lazarus.schema.contract import read_launch
from lazarus.schema.run import RunSpec
from lazarus.trainer.gpt.step import Trainer, check_layout
from lazarus.trainer.sdk.faults import maybe_fail
from lazarus.trainer.sdk.session import TrainingSession


def join(session: TrainingSession, spec: RunSpec) -> None:
    """Join the incarnation's process group: NCCL on GPUs, gloo on CPUs, one thread per rank."""
    import torch
    import torch.distributed as dist

    # One thread per rank: several ranks share few cores, and oversubscription costs ~10x.
    torch.set_num_threads(1)
    # NCCL on GPUs (the launcher sets TORCH_NCCL_ASYNC_ERROR_HANDLING, so a broken collective
    # fails instead of hanging), gloo on CPUs; either way a collective gives up after the
    # policy's longest hang time, by which time detect has already reported the hang.
    if torch.cuda.is_available():
        torch.cuda.set_device(session.rank % session.layout.ranks_per_node)
    session.wait_for_store()
    dist.init_process_group(
        "nccl" if torch.cuda.is_available() else "gloo",
        timeout=timedelta(seconds=spec.recovery.longest_hang_seconds + 30),
    )
    session.heartbeat(session.resume_step, "joined")


class SamplesLog:
    """What a data-parallel share trains on, a line per step as it starts (the data position's
    audit; a step trained again by a later incarnation has its lines there), written by the
    share's rank of the first stage and tp coordinate 0."""

    def __init__(self, session: TrainingSession, trainer: Trainer):
        path = session.run.samples_file(session.incarnation, session.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file, self.trainer = open(path, "a"), trainer

    def write(self, step: int, samples: int) -> None:
        """Step `step` trained on the replica's share of the global batch starting at sample `samples`."""
        first = samples + self.trainer.offsets.start
        line = {
            "step": step,
            "replica": self.trainer.replica,
            "start": first,
            "stop": first + len(self.trainer.offsets),
        }
        self.file.write(json.dumps(line) + "\n")
        self.file.flush()


def restore(session: TrainingSession, trainer: Trainer) -> tuple[int, int]:
    """Load the state the controller chose into `trainer`; returns its step and data position
    ((0, 0) from scratch): what the survivors that kept their processes send, where they rejoin
    this incarnation; what the fault's survivors saved, if the launch record names them; else the
    checkpoint of the resume step."""
    from lazarus.trainer.gpt import survivor_state as survivors
    from lazarus.trainer.sdk import checkpoint

    if not session.resume_step:
        return 0, 0
    run, launch = session.run, read_launch(session.run, session.incarnation)
    if launch is not None and launch.rejoin is not None:
        # The survivors kept their processes and state: the source replica's rank at this place sends it.
        step, samples = survivors.share(trainer, session.rank, launch.rejoin, None)
        if step != session.resume_step:
            raise RuntimeError(f"the survivors hold step {step}, expected {session.resume_step}")
        print(f"lazarus trainer: received step {step} from replica {launch.rejoin.source_replica}", flush=True)
        return step, samples
    if launch is not None and launch.survivors is not None:
        # The state of the step the fault interrupted, from a survivor at this rank's place.
        source = launch.survivors
        holder = source.ranks[session.rank]
        progress = survivors.load(run, source.incarnation, holder, trainer)
        if progress["step"] != session.resume_step:
            raise RuntimeError(f"survivor state holds step {progress['step']}, expected {session.resume_step}")
        read = "read by the node's standby before this rank started" if progress["prefetched"] else "read now"
        print(
            f"lazarus trainer: restored step {progress['step']} from survivor {holder} "
            f"of incarnation {source.incarnation} ({read})",
            flush=True,
        )
    else:
        progress = checkpoint.load(run, trainer.model, trainer.optimizer, session.resume_step)
    return progress["step"], progress["samples"]


class BrokenStep(Exception):
    """A step whose collective broke before the optimizer touched anything (a peer's node died):
    what the rank holds is exactly the state after `step` steps, at data position `samples`;
    `checkpointer` may have a save in flight over the broken incarnation's groups."""

    def __init__(self, step: int, samples: int, checkpointer=None):
        super().__init__(f"the collectives of step {step + 1} broke")
        self.step, self.samples, self.checkpointer = step, samples, checkpointer


def train(session: TrainingSession) -> tuple[int, bool]:
    """Train from the resume step to the last step; returns the last step trained and whether
    the controller stopped the run before it. With RecoveryPolicy.in_process, a step whose
    collectives break leaves this process waiting at its boundary for the next incarnation,
    which it joins (keep_process); else, or when the controller falls back, it saves the state
    for the next incarnation's ranks and ends."""
    from lazarus.trainer.gpt import survivor_state as survivors
    from lazarus.trainer.sdk.rejoin import remember_inherited_sockets

    run = session.run
    spec = RunSpec.model_validate_json(run.spec_file.read_text())
    check_layout(session.layout, spec.trainer, session.world_size)
    remember_inherited_sockets()
    join(session, spec)
    trainer = Trainer(spec.trainer, session.layout, session.rank)
    step, samples = restore(session, trainer)  # samples: the data position, index of the next sample
    while True:
        try:
            return train_steps(session, spec, trainer, step, samples)
        except BrokenStep as broken:
            kept = keep_process(session, spec, trainer, broken) if keeps_process(spec) else None
            if kept is None:
                survivors.save(run, session.incarnation, session.rank, trainer, broken.step, broken.samples)
                raise broken.__cause__ or broken from None
            trainer, step, samples = kept


SAVE_SETTLE_SECONDS = 1.0
"""How long a survivor keeping its process waits for its abandoned save's threads to end (seconds):
with the groups' connections cut its collectives fail at once, so only a write to a stuck disk is slower."""


def keeps_process(spec: RunSpec) -> bool:
    """Whether a survivor keeps its process at a broken step: the policy asks for it, and the
    group is gloo's, which can be abandoned (NCCL's would need aborting: not done yet)."""
    import torch.distributed as dist

    return spec.recovery.in_process and dist.get_backend() == "gloo"


def keep_process(session: TrainingSession, spec: RunSpec, trainer: Trainer, broken: BrokenStep):
    """A survivor at its step boundary: abandon the broken groups, wait for the next incarnation
    to take this rank in, move there, join its group, and share the state with the new ranks.
    Returns (the trainer to go on with, its step, its data position); None, with nothing moved,
    when the controller starts the next incarnation afresh (the caller saves the state and ends).
    A failure after the move saves the state as a survivor of the new incarnation and raises."""
    from lazarus.trainer.gpt import survivor_state as survivors
    from lazarus.trainer.sdk.rejoin import abandon_process_groups, wait_for_rejoin

    began = time.monotonic()
    held = survivors.snapshot(trainer, broken.step, broken.samples)  # local tensors: no collective
    abandon_process_groups()
    # A save in flight went over the abandoned groups: it is never committed, and once its threads
    # end, nothing of this incarnation writes into its folder, which drain then removes.
    if broken.checkpointer is not None and not broken.checkpointer.abandon(SAVE_SETTLE_SECONDS):
        print("lazarus trainer: the checkpoint in flight did not settle; saving as on the restart path", flush=True)
        return None
    print(f"lazarus trainer: left the broken groups; waiting at the boundary after step {broken.step}", flush=True)
    maybe_fail("boundary", broken.step)
    launch = wait_for_rejoin(session, broken.step, spec.recovery.rejoin_timeout_seconds)
    if launch is None or launch.rejoin is None:
        return None
    waited = time.monotonic() - began
    if launch.resume_step != broken.step:
        raise RuntimeError(f"the next incarnation resumes step {launch.resume_step}; this rank holds {broken.step}")
    session.move_to(session.incarnation + 1, launch.resume_step)
    try:
        join(session, spec)
        if trainer.mesh is not None:
            # The mesh's groups were the broken incarnation's: the same shares, laid out afresh.
            trainer = Trainer(spec.trainer, session.layout, session.rank)
            survivors.apply(trainer, held)
        step, samples = survivors.share(trainer, session.rank, launch.rejoin, held)
    except Exception:
        survivors.save(session.run, session.incarnation, session.rank, trainer, broken.step, broken.samples, held)
        raise
    print(
        f"lazarus trainer: kept this process at step {step}; waited {waited:.3f} s, joined incarnation "
        f"{session.incarnation} in {time.monotonic() - began - waited:.3f} s",
        flush=True,
    )
    return trainer, step, samples


def train_steps(session: TrainingSession, spec: RunSpec, trainer: Trainer, step: int, samples: int) -> tuple[int, bool]:
    """This incarnation's steps from `step` (data position `samples`) to the last; returns the last
    step trained and whether the controller stopped the run. BrokenStep: a step's collectives broke
    with the state intact."""
    import torch.distributed as dist

    from lazarus.trainer.gpt import survivor_state as survivors
    from lazarus.trainer.sdk import checkpoint

    run, settings = session.run, spec.trainer
    checkpointer = checkpoint.Checkpointer(
        run, session.incarnation, settings.keep_checkpoints, settings.async_checkpoint, warn=session.warn
    )
    session.heartbeat(step, "restored")
    consumed = SamplesLog(session, trainer) if trainer.writes_samples else None

    stopped = False
    while step < settings.steps:
        maybe_fail("step", step + 1)
        if consumed:
            # Before the step: a rank can die after its share reached the all-reduce that its
            # survivors complete, and the step it never logged is then restored from them.
            consumed.write(step + 1, samples)
        # Rank 0's stop request rides on the step's own collectives (no extra one per step).
        try:
            loss, stopped = trainer.step(samples, stop_requested=session.stop_requested(agree=lambda asked: asked))
        except Exception as error:
            # A broken collective (a peer's node died) fails the step before the optimizer
            # touched anything: what this rank holds is exactly the state after `step` steps.
            if not trainer.updating:
                raise BrokenStep(step, samples, checkpointer) from error
            raise
        step += 1
        samples += settings.global_batch

        session.step_done(step, loss, compute_seconds=trainer.compute_seconds)
        # A save's collectives break when a peer dies, an async one's found here a step or more
        # later: either way the state is still that after `step` steps, so it is a survivor's.
        with survivors.saved_on_failure(run, session, trainer, step, samples):
            checkpointer.poll()
            if session.checkpoint_due(step) or stopped:
                checkpointer.save(trainer.model, trainer.optimizer, step, samples)
        if session.checkpoint_due(step) or stopped:
            maybe_fail("checkpoint", step)
        if stopped:
            break

    with survivors.saved_on_failure(run, session, trainer, step, samples):
        checkpointer.wait()
    dist.barrier()
    return step, stopped


def main() -> None:
    """Entry point of one rank; always ends the process explicitly with an exit record."""
    session = TrainingSession.from_environ()
    print(
        f"lazarus trainer: rank {session.rank}/{session.world_size} pid {os.getpid()} on {session.node}, "
        f"incarnation {session.incarnation}, resume step {session.resume_step}",
        flush=True,
    )
    try:
        step, stopped = train(session)
    except BaseException as error:  # noqa: BLE001 - every ending must leave an exit record
        traceback.print_exc()
        if isinstance(error, SystemExit):
            code = error.code if isinstance(error.code, int) and error.code else 1
            message = str(error.code)
        else:
            code, message = 1, f"{type(error).__name__}: {error}"
        session.fail(code, message)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    session.finish(step, stopped=stopped)
    sys.stdout.flush()
    sys.stderr.flush()
    # torch with gloo sometimes aborts in its exit-time destructors; end explicitly instead.
    os._exit(0)
