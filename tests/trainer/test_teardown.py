"""A forked rank's destroy_process_group keeps the groups it destroys from their C++ destructors
(lazarus.trainer.agent.teardown.keep_destroyed_groups): no gloo teardown runs while the GIL is held."""

from __future__ import annotations

import subprocess
import sys

RANK = """
import os, sys, torch.distributed as dist
from lazarus.trainer.agent import teardown as standby
standby.keep_destroyed_groups()
standby.keep_destroyed_groups()  # a second call wraps nothing twice
from torch.distributed import destroy_process_group  # as a script imports it, after the patch
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
pair = dist.new_group([0])
world = dist.group.WORLD
destroy_process_group(pair)
destroy_process_group()
assert not dist.is_initialized()
assert standby._KEPT_GROUPS.count(pair) == 1 and world in standby._KEPT_GROUPS, standby._KEPT_GROUPS
assert dist.destroy_process_group is destroy_process_group
print("kept", len(standby._KEPT_GROUPS), flush=True)
os._exit(0)
"""


def test_destroyed_groups_are_unregistered_and_kept(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", RANK, str(tmp_path / "store")], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "kept 2"
