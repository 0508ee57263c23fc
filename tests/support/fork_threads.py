"""The forkserver's first preload (tests/support/forks.py): one OpenMP thread, set before torch is
imported there, since libgomp reads OMP_NUM_THREADS once, when torch loads it (as the warm
standbys set it: infra/standbys.py)."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
