"""How fast the planner is: 1,000 repetitions of a 54-day run on 16,384 GPUs.

    .venv/bin/python bench/simulate.py [--repetitions 1000] [--preset llama3-405b] [--markdown [PATH]]

Prints, per policy, the wall seconds of the repetitions alone (no interval sweep, no spare
search), the simulated faults per second, and the ETTR it found.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import perf_page
from lazarus.planner.model import run_policy
from lazarus.planner.simulate import load_scenario

PAGE_TITLE = "Planner speed"
ABOUT = """The planner (`lazarus simulate`) replays a long run's faults many times under each recovery
policy of the scenario. Per policy: the wall seconds of the repetitions alone (no interval sweep,
no spare search), the simulated faults per second, and the ETTR (effective training time ratio)
the repetitions found."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repetitions", type=int, default=1000)
    parser.add_argument("--preset", default="llama3-405b")
    perf_page.add_option(parser, __file__)
    args = parser.parse_args()
    sitting = perf_page.begin()
    scenario = load_scenario(None, args.preset)
    print(f"{args.repetitions} repetitions of {scenario.days:g} days at {scenario.gpus:,} GPUs ({scenario.name})")
    print(f"{'policy':<16}{'seconds':>9}{'faults/s':>12}{'ETTR':>9}")
    total = 0.0
    rows = []
    for policy in scenario.policies:
        start = time.perf_counter()
        result = run_policy(scenario, policy, args.repetitions)
        seconds = time.perf_counter() - start
        total += seconds
        faults_per_second = result.faults_per_run * args.repetitions / seconds
        print(f"{policy:<16}{seconds:>9.2f}{faults_per_second:>12,.0f}{result.ettr:>9.2%}")
        rows.append([policy, f"{seconds:.2f}", f"{faults_per_second:,.0f}", f"{result.ettr:.2%}"])
    print(f"{'all policies':<16}{total:>9.2f}")
    if args.markdown:
        rows.append(["all policies", f"{total:.2f}", None, None])
        caption = (
            f"{args.repetitions} repetitions of {scenario.days:g} days at {scenario.gpus:,} GPUs ({scenario.name})"
        )
        table = perf_page.Table(["policy", "seconds", "faults/s", "ETTR"], rows, caption)
        perf_page.write_page(args.markdown, sitting, title=PAGE_TITLE, doc=__doc__, about=ABOUT, tables=[table])


if __name__ == "__main__":
    main()
