"""How fast the planner is: 1,000 repetitions of a 54-day run on 16,384 GPUs.

    .venv/bin/python bench/simulate.py [--repetitions 1000] [--preset llama3-405b]

Prints, per policy, the wall seconds of the repetitions alone (no interval sweep, no spare
search), the simulated faults per second, and the ETTR it found.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lazarus.planner import run_policy
from lazarus.simulate import load_scenario


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repetitions", type=int, default=1000)
    parser.add_argument("--preset", default="llama3-405b")
    args = parser.parse_args()
    scenario = load_scenario(None, args.preset)
    print(f"{args.repetitions} repetitions of {scenario.days:g} days at {scenario.gpus:,} GPUs ({scenario.name})")
    print(f"{'policy':<16}{'seconds':>9}{'faults/s':>12}{'ETTR':>9}")
    total = 0.0
    for policy in scenario.policies:
        start = time.perf_counter()
        result = run_policy(scenario, policy, args.repetitions)
        seconds = time.perf_counter() - start
        total += seconds
        faults_per_second = result.faults_per_run * args.repetitions / seconds
        print(f"{policy:<16}{seconds:>9.2f}{faults_per_second:>12,.0f}{result.ettr:>9.2%}")
    print(f"{'all policies':<16}{total:>9.2f}")


if __name__ == "__main__":
    main()
