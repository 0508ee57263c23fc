"""`lazarus simulate`: the Monte Carlo planner, as tables or as one JSON document."""

from __future__ import annotations

import argparse

from lazarus.client.config import Settings
from lazarus.commands.common import UserError


def register(commands: argparse._SubParsersAction) -> None:
    """Add `simulate` to the top-level commands."""
    simulate = commands.add_parser(
        "simulate",
        help="Monte Carlo planner: what elasticity costs a large cluster, per recovery policy",
        description="Simulate a long run on a large cluster under each recovery policy: ETTR, goodput, "
        "lost GPU-hours by cause, the best checkpoint interval and the spares needed.",
    )
    simulate.add_argument("scenario", nargs="?", metavar="SCENARIO.yaml", help="scenario file (see schema/scenario.py)")
    simulate.add_argument("--preset", help="a built-in scenario: llama3-405b, human-vs-automatic")
    simulate.add_argument(
        "--costs",
        metavar="FILE",
        help="stage costs measured on real runs: `lazarus run status --json` output (one status or a list)",
    )
    simulate.add_argument(
        "--repetitions", type=int, help="Monte Carlo repetitions per policy (default: the scenario's)"
    )
    simulate.add_argument("--json", action="store_true", help="print the results as one JSON object")
    simulate.add_argument(
        "--plot", metavar="FILE", help="write a PNG: ETTR against checkpoint interval, lost GPU-hours by cause"
    )
    simulate.set_defaults(handler=simulate_plan)


def _planned(args: argparse.Namespace) -> dict:
    """The plan of the scenario asked for, with a plot when asked; a bad scenario is said in one line."""
    from lazarus.planner.simulate import PlanError, load_scenario, measured_costs, plan, plot

    try:
        scenario = load_scenario(args.scenario, args.preset)
        if args.costs:
            scenario = scenario.model_copy(
                update={"costs": scenario.costs.model_copy(update=measured_costs(args.costs))}
            )
        if args.repetitions is not None and args.repetitions < 2:
            raise PlanError(f"--repetitions {args.repetitions}: use at least 2 (for a confidence band)")
    except PlanError as error:
        raise UserError(str(error)) from None
    result = plan(scenario, args.repetitions)
    if args.plot:
        plot(result, args.plot)
    return result


def simulate_plan(args: argparse.Namespace, settings: Settings) -> int:
    """Print the plan's tables, or with --json the whole result as one document."""
    from lazarus.console import stdout, stdout_reserved_for_json
    from lazarus.planner.simulate import report

    if args.json:
        with stdout_reserved_for_json() as emit:
            emit(_planned(args))
        return 0
    stdout.print(report(_planned(args)))
    if args.plot:
        stdout.print(f"\nPlot: {args.plot}")
    return 0
