"""The script SDK: what a training script imports through `lazarus.session` to be recoverable (the
session, survivors' state, committed checkpoints, planned faults); torch and schema only."""
