"""A survivor node's launcher follows its ranks into the next incarnation (RecoveryPolicy.in_process).

When the controller keeps the survivors of a fault, it starts the next incarnation with a launch
record that names them (`rejoin`), and starts launchers only on the replacement nodes. On a node
whose ranks all rejoin, this node's launcher, their parent, becomes the node's launcher of the new
incarnation: it takes that incarnation's node lock, records itself as its launcher (its process
group holds the ranks, so stopping the new incarnation stops them), and reports and records exits
there from then on.
"""

from __future__ import annotations

import os
import threading

from lazarus.schema.contract import read_launch
from lazarus.schema.files import take_lock, write_json_atomic
from lazarus.schema.records import Assignment
from lazarus.schema.rundir import RunDir

FOLLOW_POLL_SECONDS = 0.01
"""How often the launcher looks for the next incarnation's launch record (seconds): a stat."""


class Follower:
    """The thread of a launcher that moves it, with its ranks, into each next incarnation that
    its ranks rejoin; `incarnation` is the one it serves now."""

    def __init__(self, run: RunDir, incarnation: int, node_index: int, ranks: range, me: dict, movers: list):
        self.run, self.incarnation, self.node_index, self.ranks, self.me = run, incarnation, node_index, ranks, me
        self.movers = movers  # what else serves one incarnation: each has move_to(incarnation)
        self._locks: list[int] = []  # the node locks of the incarnations moved into, held while this runs
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="follow", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(FOLLOW_POLL_SECONDS):
            following = self.incarnation + 1
            launch = read_launch(self.run, following)
            if launch is None:
                continue
            rejoin = launch.rejoin
            if rejoin is None or rejoin.incarnation != self.incarnation or not set(self.ranks) <= set(rejoin.ranks):
                return  # the next incarnation starts its ranks afresh: these end with this one
            if not self._move(following):
                return

    def _move(self, incarnation: int) -> bool:
        """Become this node's launcher of `incarnation`; False where the node is not in it at the
        same place or another launcher holds it."""
        assignment = Assignment.model_validate_json(self.run.assignment_file(incarnation).read_text())
        index = self.node_index
        if index >= len(assignment.nodes) or assignment.nodes[index] != self.me["node"]:
            return False
        fd = take_lock(self.run.node_lock_file(incarnation, index))
        if fd is None:
            return False
        self._locks.append(fd)
        write_json_atomic(self.run.node_pid_file(incarnation, index), {**self.me, "pid": os.getpid()})
        for mover in self.movers:
            mover.move_to(incarnation)
        self.incarnation = incarnation
        print(f"lazarus launcher: node {self.me['node']}'s ranks rejoin incarnation {incarnation}", flush=True)
        return True
