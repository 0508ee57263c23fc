"""The programs that run on a node, beside the controller (they never import temporalio):

- agent/: the node agent: the launcher that starts a node's ranks and watches them (output, idle,
  node reports, stacks, health checks), and the warm standby that forks them;
- sdk/: the script SDK, what a training script uses through `lazarus.session` (the session, the
  survivors' state, checkpoints);
- gpt/: the built-in trainer, a small GPT on every layout (`python -m lazarus.trainer`).

Imports go gpt -> sdk, and agent -> sdk/gpt only to warm a standby; all speak the contract of
schema/contract.py (CONTRACT.md).
"""
