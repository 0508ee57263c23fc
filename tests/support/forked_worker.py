"""`python -m tests.support.forked_worker worker ...`: `lazarus worker` whose local backend forks
the nodes' launchers and standbys from a forkserver (tests/support/forks.py), for a worker that
serves many runs of one test module (the chaos matrix's shared bed): its forkserver imports torch
once, where each run's standbys would import it again."""

from lazarus import cli
from lazarus.infra import processes, standbys
from tests.support import forks

processes.start_in_session = forks.start_in_session
standbys.start_in_session = forks.start_in_session

if __name__ == "__main__":
    cli.main()
