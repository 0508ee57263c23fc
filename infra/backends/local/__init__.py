"""The local backend: a run's nodes are launcher processes on this machine, sharing its paths."""
