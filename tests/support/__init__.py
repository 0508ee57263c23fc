"""What the tests share: waiting, reference runs and run files, worker processes, the Kubernetes
emulator's helpers, and the fixtures built on them (fixtures.py, loaded as a pytest plugin)."""
