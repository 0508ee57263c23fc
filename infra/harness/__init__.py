"""The dev harnesses, apart from the backends: the Temporal dev server a demo or test starts, and the
one-machine Slurm cluster the tests and benches run on."""
