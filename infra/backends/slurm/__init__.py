"""The Slurm backend: a run's nodes are the nodes of one Slurm allocation, its launchers job steps."""
