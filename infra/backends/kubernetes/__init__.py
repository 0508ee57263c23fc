"""The Kubernetes backend: a run's nodes are labelled cluster nodes claimed from a pool, its launchers
pods; manifests/ holds the objects an operator applies (namespace, RBAC, worker, run)."""
