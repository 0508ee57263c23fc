"""bench/large_kubernetes.py, small: a pool followed by the watch, a run's claim of every node, its
pods created and deleted through the rate-limited client, against the emulator."""

from __future__ import annotations

from bench.large_kubernetes import emulated_pool
from lazarus.infra.rate import TokenBucket, fan_out


def test_a_pool_is_claimed_launched_and_drained_through_the_client(tmp_path):
    result = emulated_pool(tmp_path, 48, qps=1000.0, burst=1000, say=lambda message: None)
    steps = result["steps"]
    # A claim reads the node, patches it and leaves an Event; a launch creates a pod a node.
    assert steps["claim 48 nodes"]["requests"] >= 3 * 48
    assert steps["launch 48 rank pods"]["requests"] == 48 + 1  # and a list of those that exist
    assert steps["drain 48 rank pods (deleted, gone)"]["requests"] >= 48


def test_the_bucket_holds_calls_to_its_rate_after_the_burst():
    now = [0.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    bucket = TokenBucket(qps=200.0, burst=5, clock=lambda: now[0], sleep=sleep)
    for _ in range(45):
        bucket.take()
    # 5 at once, then 40 at 200 a second.
    assert abs(now[0] - 40 / 200) < 1e-9
    assert fan_out([lambda i=i: i * i for i in range(20)]) == [i * i for i in range(20)]
