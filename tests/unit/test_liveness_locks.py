"""Liveness locks (schema/files.py): held for exactly as long as the process holding the descriptor
lives, and tested without being taken."""

from __future__ import annotations

import os
import subprocess
import sys

from lazarus.schema.files import lock_is_held, take_lock

PROBE = """
import sys
from lazarus.schema.files import lock_is_held
print("probing", flush=True)
while True:
    lock_is_held(sys.argv[1])
"""


def test_a_lock_passes_with_its_descriptor_and_ends_with_the_process(tmp_path):
    lock = tmp_path / "rank.lock"
    fd = take_lock(lock)
    assert fd is not None and lock_is_held(lock) and take_lock(lock) is None
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE, pass_fds=(fd,)
    )
    os.close(fd)
    assert lock_is_held(lock)  # the child's copy of the descriptor holds it
    child.communicate(b"")
    assert not lock_is_held(lock)


def test_testing_a_lock_never_makes_a_take_of_it_fail(tmp_path):
    """The controller tests ranks' and launchers' locks all the time; a take that met a test
    (a shared flock, before) failed as if the lock were held, and a node was left unlaunched."""
    lock = tmp_path / "node.lock"
    lock.touch()
    prober = subprocess.Popen([sys.executable, "-c", PROBE, str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert prober.stdout.readline() == "probing\n"
        failed = 0
        for _ in range(2000):
            fd = take_lock(lock)
            if fd is None:
                failed += 1
            else:
                os.close(fd)
    finally:
        prober.kill()
        prober.wait()
    assert failed == 0
