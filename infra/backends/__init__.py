"""The backends: one folder each (local, slurm, kubernetes, simulated), each a `Cluster` (infra/backend.py)
registered by name in infra/registry.py. Nothing outside the registry imports a backend by name."""
