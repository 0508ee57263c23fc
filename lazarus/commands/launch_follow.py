"""What `lazarus launch` shows of its run while it lasts (rank 0's output, each incident, a run that
waits for capacity, an operator's approval or a resume, with the command that moves it on) and how
it ends: said, with the script's exit status, or by a signal, which ends every process of the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys

from lazarus.schema.states import RunState

WAITING_STATES = frozenset({RunState.WAITING_FOR_CAPACITY, RunState.WAITING_FOR_APPROVAL, RunState.PAUSED})
"""States in which the run does nothing until capacity comes or someone acts."""

REPEAT_SECONDS = 60.0
"""How often a wait is said again while it lasts: a user who comes back to the terminal finds it
near the bottom, not a screen of output above (seconds)."""


class Follower:
    """Shows a run as torchrun would show its job: rank 0's output on stdout, as it is written,
    across incarnations; and, on stderr, each incident when it opens and when it ends."""

    def __init__(self, run, say):
        self.run, self.say = run, say
        self.incarnation, self.offset = 0, 0
        self.told: dict[int, str] = {}  # incident number -> the outcome last said

    def output(self, incarnation: int) -> None:
        """Copy what rank 0 wrote since the last look; on a new incarnation, finish the old log first."""
        while True:
            self._copy()
            if incarnation <= self.incarnation:
                return
            self.incarnation, self.offset = self.incarnation + 1, 0

    def _copy(self) -> None:
        try:
            with open(self.run.log_file(self.incarnation, 0), "rb") as log:
                log.seek(self.offset)
                data = log.read()
        except FileNotFoundError:
            return
        # Whole lines only: a line being written is shown once it is complete.
        data = data[: data.rfind(b"\n") + 1]
        if data:
            self.offset += len(data)
            sys.stdout.buffer.write(data)
            sys.stdout.flush()

    def incidents(self, status) -> None:
        """Say each incident as it opens and when its outcome is known."""
        for incident in status.incidents:
            fault = incident.fault
            if incident.number not in self.told:
                where = f" on {', '.join(fault.nodes)}" if fault.nodes else ""  # the program's failure blames none
                self.say(f"incident {incident.number}: {fault.kind}{where}: {fault.reason}")
                self.told[incident.number] = "recovering"
            if incident.outcome != self.told[incident.number]:
                self.told[incident.number] = incident.outcome
                self.say(f"incident {incident.number}: {incident.outcome}{_recovery_words(incident)}")


def _recovery_words(incident) -> str:
    decision = incident.decision
    words = []
    if decision and decision.replacements:
        words.append(
            "replaced " + ", ".join(f"{lost} by spare {spare}" for lost, spare in decision.replacements.items())
        )
    elif decision and decision.action == "replace" and incident.new_assignment:
        words.append("restarted in place")
    elif decision and decision.action == "reshard" and incident.new_assignment:
        words.append(f"resharded to dp={incident.new_assignment.layout.dp}")
    if incident.mttr_seconds is not None:
        words.append(f"MTTR {incident.mttr_seconds:.2f} s")
    elif "resume" in incident.stages and incident.stages["resume"].ended_at:
        up = (incident.stages["resume"].ended_at - incident.fault.occurred_at).total_seconds()
        words.append(f"ranks up again {up:.2f} s after the fault (the script reports no steps)")
    return f" ({'; '.join(words)})" if words else ""


def _capacity_words(status, node_limit: int | None) -> str:
    """Who can give a run waiting for capacity a node: a repaired node it quarantined, returned; a
    new node of the pool, unless the run already holds all the nodes its spec allows."""
    quarantined = ", ".join(status.quarantined_nodes)
    held = set(status.quarantined_nodes) | set(status.assignment.nodes if status.assignment else [])
    which = f"a node it quarantined ({quarantined})" if quarantined else "a dead node"
    give = f"`lazarus pool return NODE` once {which} is repaired"
    if node_limit is not None and len(held) >= node_limit:
        # A new node would not help: the run may hold no more (cluster.active_nodes + spare_nodes).
        return f"{give} (it holds the {node_limit} node(s) its spec allows)"
    return f"{give}, or `lazarus pool add 1` gives it a node"


def waiting_words(status, waited_seconds: float = 0.0, node_limit: int | None = None) -> str | None:
    """What a run in a waiting state waits for and the commands that move it on, in one line;
    None when the run is not waiting. `waited_seconds`: how long it has waited so far;
    `node_limit`: the most nodes the run may hold (cluster.active_nodes + spare_nodes), if known."""
    run = status.run_id
    since = f", {waited_seconds / 60:.0f} min so far" if waited_seconds >= REPEAT_SECONDS else ""
    abort = f"`lazarus run abort {run}` ends it"
    if status.state == RunState.WAITING_FOR_CAPACITY:
        decision = status.incidents[-1].decision if status.incidents else None
        why = f" ({decision.reason})" if decision is not None and decision.action == "wait" else ""
        policy = status.policy
        limit = f", and it fails by itself after {policy.capacity_wait_seconds:g} s" if policy else ""
        return (
            f"run {run} is waiting for capacity{since}{why}: {_capacity_words(status, node_limit)}; "
            f"{abort}{limit} (recovery.capacity_wait_seconds)"
        )
    if status.state == RunState.WAITING_FOR_APPROVAL:
        decision = status.awaiting_approval
        why = f" ({decision.reason})" if decision is not None else ""
        return (
            f"run {run} is waiting for an operator's approval{since}{why}: "
            f"`lazarus run approve {run} reshard-below-minimum` runs it on fewer nodes, "
            f"`lazarus run approve {run} wait-longer` waits longer for capacity; {abort}"
        )
    if status.state == RunState.PAUSED:
        why = f" ({status.reason})" if status.reason else ""
        return f"run {run} is paused{since}{why}: `lazarus run resume {run}` continues it; {abort}"
    return None


class WaitingNotice:
    """Says a wait at once and again every `every` seconds while it lasts (waiting_words, with the
    run's `node_limit`). The clock is the caller's (`now`, in seconds), so the repeat is tested
    without waiting a minute."""

    def __init__(self, every: float = REPEAT_SECONDS, node_limit: int | None = None):
        self.every, self.node_limit = every, node_limit
        self.state: RunState | None = None
        self.since = self.said = 0.0

    def line(self, status, now: float) -> str | None:
        """The line to say now about the run's wait; None when it is not waiting or was told recently."""
        if status.state not in WAITING_STATES:
            self.state = None
            return None
        if status.state != self.state:
            # A new wait is said at once.
            self.state, self.since, self.said = status.state, now, now - self.every
        if now - self.said < self.every:
            return None
        self.said = now
        return waiting_words(status, now - self.since, self.node_limit)


def exit_status(status) -> int:
    """The script's exit status, as torchrun would give it: 0 when the run completed; the failing
    rank's code when a rank's failure failed the run (128 + N for signal N); 1 otherwise."""
    if status.state == RunState.COMPLETED:
        return 0
    failure = status.failure
    if failure is not None and failure.exit_code:
        return failure.exit_code
    if failure is not None and failure.signal:
        return 128 + signal.Signals[failure.signal].value
    return 1


def say_end(final, say) -> int:
    """Say how the run ended (a failed rank's last lines too); returns the exit status."""
    code = exit_status(final)
    if code == 0:  # completed
        say(f"run {final.run_id} COMPLETED at step {final.progress} after {len(final.incidents)} incident(s)")
        return code
    failure = final.failure
    reason = final.reason.split("; last lines of")[0].splitlines()[0] if final.reason else ""
    say(f"run {final.run_id} {final.state.value}: {reason}")
    if failure is not None and failure.log_tail:
        node = failure.node or (failure.nodes[0] if failure.nodes else None)
        say(f"last lines of rank {failure.rank}'s log" + (f" ({node}):" if node else ":"))
        sys.stderr.write(failure.log_tail.rstrip("\n") + "\n")
    return code


class Interruption:
    """SIGINT, SIGTERM and SIGHUP, taken as torchrun takes them: the first cancels the launch's task,
    which ends the run and every process it started; `received` is the signal, for the exit status
    (128 + its number). A signal repeated while that happens is said, not obeyed: quitting halfway
    would leave the ranks running."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self, say):
        self.say = say
        self.received: signal.Signals | None = None

    @contextlib.contextmanager
    def installed(self):
        """Handle the signals in the running loop, for the current task, while the block runs."""
        loop, task = asyncio.get_running_loop(), asyncio.current_task()
        assert task is not None, "a coroutine runs in a task"
        for sig in self.SIGNALS:
            loop.add_signal_handler(sig, self._received, sig, task)
        try:
            yield self
        finally:
            for sig in self.SIGNALS:
                loop.remove_signal_handler(sig)

    def _received(self, sig: signal.Signals, task: asyncio.Task) -> None:
        if self.received is not None:
            self.say(f"{sig.name}: still stopping the run's processes")
            return
        self.received = sig
        task.cancel()


async def terminate(client, run_id: str, say) -> None:
    """A signal: end the workflow, as torchrun ends its workers (the processes are stopped next)."""
    say(f"interrupted: terminating run {run_id} and stopping its processes")
    # The SDK logs each activity the termination cancels (a traceback; "Activity not found on
    # completion" from its core): an ended run's news, not a warning for the user.
    for name in ("temporalio.activity", "lazarus.temporal_core"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        await client.get_workflow_handle(run_id).terminate("lazarus launch was interrupted (a signal, Ctrl-C)")
    except Exception:  # noqa: BLE001 - the run may have ended meanwhile, or never started; its processes are stopped anyway
        pass


def stop_processes(cluster, run_id: str) -> None:
    """Every rank, launcher and standby of the run ends; its active nodes go back to the pool (the
    workflow, terminated, will not release them) and, on Slurm, its allocation ends (release_nodes:
    scancel, which ends every step of it on every node). The nodes go back even when a process
    outlives the stop (ClusterError, raised after the release)."""
    from lazarus.infra.backend import ClusterError

    try:
        cluster.stop_run(run_id)
    finally:
        with contextlib.suppress(ClusterError):
            cluster.release_nodes(run_id)
