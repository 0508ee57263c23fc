"""bench/large_run.py's simulated run, small: a run of 32 nodes x 8 ranks on the real dev server
and worker, two nodes killed, each replaced by a hot spare, and the figures the bench prints."""

from __future__ import annotations

from bench.large_run import one_size


async def test_a_simulated_run_replaces_each_killed_node_and_stays_small(dev_env, tmp_path):
    row = await one_size(dev_env, tmp_path, nodes=32, faults=2, say=lambda message: None)
    assert row["ranks"] == 256
    # Each incident replaced the node killed, by a spare the run did not hold.
    replaced = [lost for replacements in row["replacements"] for lost in replacements]
    assert replaced == row["killed"] and len(set(row["killed"])) == 2
    spares = [spare for replacements in row["replacements"] for spare in replacements.values()]
    assert all(int(spare.split("-")[1]) >= 32 for spare in spares)
    assert row["events_per_incident"] <= 30
    assert row["largest_payload_bytes"] < 256 * 1024 and "resume input" in row["payloads"]
    assert row["look_ms"] > 0 and row["report_to_decision_ms"] > 0 and row["decision_to_launch_ms"] > 0
