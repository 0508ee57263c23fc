"""The built-in trainer: a small GPT on every layout (dp, dp_shard, tp, pp) over gloo, written
with the script SDK, and what a warm standby prepares for its ranks."""
