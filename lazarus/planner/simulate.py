"""`lazarus simulate`: what elasticity costs a large cluster, per policy, with the planner."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Group
from rich.table import Table
from rich.text import Text

from lazarus.console import table
from lazarus.planner.model import (
    CAUSES,
    RECOVERY_STAGES,
    job_mtbf_seconds,
    run_policy,
    young_daly_minutes,
)
from lazarus.schema.load import SpecError, load_spec
from lazarus.schema.scenario import Measured, Scenario

PRESETS = Path(__file__).resolve().parent / "scenarios"
NUMBERS_OF_A_POLICY = ("ETTR", "95% CI", "goodput", "faults", "reshards", "lost GPU-h")


class PlanError(ValueError):
    """A scenario or cost file the planner cannot use (a one-line message)."""


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESETS.glob("*.yaml"))


def load_scenario(path: str | None, preset: str | None) -> Scenario:
    """The scenario from a YAML file or a named preset."""
    if preset:
        if preset not in preset_names():
            raise PlanError(f"no preset {preset!r}; presets: {', '.join(preset_names())}")
        path = str(PRESETS / f"{preset}.yaml")
    if not path:
        raise PlanError("give a scenario file or --preset NAME (presets: " + ", ".join(preset_names()) + ")")
    try:
        return load_spec(path, Scenario)
    except SpecError as error:
        raise PlanError(str(error)) from None


def measured_costs(path: str) -> dict[str, Measured]:
    """Stage seconds of every incident in `lazarus run status --json` output (one status, or a list)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise PlanError(f"{path}: cannot read run status JSON ({error})") from None
    documents = data if isinstance(data, list) else [data]
    incidents = []
    for document in documents:
        if isinstance(document, dict) and "incidents" in document:
            incidents += document["incidents"]
        elif isinstance(document, dict) and "stages" in document:
            incidents.append(document)
    samples: dict[str, list[float]] = {name: [] for name in RECOVERY_STAGES}
    for incident in incidents:
        for name, stage in incident.get("stages", {}).items():
            if name in samples and stage.get("seconds") is not None:
                samples[name].append(float(stage["seconds"]))
    missing = [name for name, values in samples.items() if not values]
    if missing:
        raise PlanError(
            f"{path}: no measured seconds for {', '.join(missing)} "
            f"(expected `lazarus run status --json` output with recovered incidents)"
        )
    return {name: Measured(dist="measured", samples=values) for name, values in samples.items()}


def interval_sweep(
    scenario: Scenario, policy: str, intervals: list[float], repetitions: int
) -> list[tuple[float, float]]:
    """(interval minutes, ETTR) for each interval, same random streams for every interval."""
    return [
        (minutes, run_policy(scenario, policy, repetitions, interval_minutes=minutes).ettr) for minutes in intervals
    ]


def default_intervals(scenario: Scenario) -> list[float]:
    """Checkpoint intervals to try: log-spaced around the Young-Daly interval and the scenario's."""
    centre = young_daly_minutes(scenario) or scenario.checkpoint.interval_minutes
    grid = sorted({round(centre * 2 ** (k / 2), 3) for k in range(-6, 7)} | {scenario.checkpoint.interval_minutes})
    return [m for m in grid if m > 0]


def smallest_spares(scenario: Scenario, repetitions: int, limit: int = 256) -> int | None:
    """Fewest hot spares with which the automatic policy reaches the target ETTR (None: not within `limit`).

    Doubles the count until the target is met, then bisects between the last miss and the hit
    (ETTR grows with spares, up to the Monte Carlo noise).
    """

    def reaches(count: int) -> bool:
        return run_policy(scenario, "automatic", repetitions, spare_nodes=count).ettr >= scenario.target_ettr

    if reaches(0):
        return 0
    miss, hit = 0, 1
    while not reaches(hit):
        miss, hit = hit, hit * 2
        if hit > limit:
            return None
    while hit - miss > 1:
        middle = (miss + hit) // 2
        miss, hit = (miss, middle) if reaches(middle) else (middle, hit)
    return hit


def plan(scenario: Scenario, repetitions: int | None = None) -> dict:
    """Every policy's results, the best checkpoint interval and the spare count for the target ETTR."""
    repetitions = repetitions or scenario.repetitions
    policies = [run_policy(scenario, name, repetitions) for name in scenario.policies]
    sweep_reps = max(20, repetitions // 5)
    intervals = default_intervals(scenario)
    sweeps = {name: interval_sweep(scenario, name, intervals, sweep_reps) for name in scenario.policies}
    lead = "automatic" if "automatic" in sweeps else scenario.policies[0]
    best_minutes, best_ettr = max(sweeps[lead], key=lambda point: point[1])
    return {
        "scenario": scenario.model_dump(mode="json"),
        "mtbf_hours": job_mtbf_seconds(scenario) / 3600.0,
        "policies": [p.as_dict() for p in policies],
        "checkpoint_interval": {
            "policy": lead,
            "best_minutes": best_minutes,
            "best_ettr": best_ettr,
            "young_daly_minutes": young_daly_minutes(scenario),
            "repetitions": sweep_reps,
            "sweep": {name: [list(point) for point in points] for name, points in sweeps.items()},
            "best_by_policy": {name: list(max(points, key=lambda point: point[1])) for name, points in sweeps.items()},
        },
        "spares": {
            "target_ettr": scenario.target_ettr,
            "smallest_for_target": smallest_spares(scenario, sweep_reps) if "automatic" in scenario.policies else None,
            "repetitions": sweep_reps,
        },
    }


def _policies_table(result: dict) -> Table:
    policies = table(
        "policy", "ETTR", "95% CI", "goodput", "faults", "reshards", "lost GPU-h", right=NUMBERS_OF_A_POLICY
    )
    for p in result["policies"]:
        low, high = p["ettr_ci95"]
        policies.add_row(
            p["name"],
            f"{p['ettr']:.2%}",
            f"{low:.2%} - {high:.2%}",
            f"{p['goodput']:.2%}",
            f"{p['faults_per_run']:.0f}",
            f"{p['reshards_per_run']:.1f}",
            f"{p['lost_gpu_hours_total']:,.0f}",
        )
    return policies


def _causes_table(result: dict) -> Table:
    names = [p["name"] for p in result["policies"]]
    causes = table("cause", *names, right=tuple(names))
    for cause in CAUSES:
        values = [p["lost_gpu_hours"][cause] for p in result["policies"]]
        if any(values):
            causes.add_row(cause, *(f"{v:,.0f}" for v in values))
    return causes


def _advice(result: dict) -> list[str]:
    """The best checkpoint interval, and the hot spares the target ETTR needs."""
    interval = result["checkpoint_interval"]
    lines = [
        f"Checkpoint interval ({interval['policy']}, {interval['repetitions']} repetitions per point): "
        f"best {interval['best_minutes']:.1f} min (ETTR {interval['best_ettr']:.2%}); "
        f"Young-Daly sqrt(2 x save stall x MTBF) = {interval['young_daly_minutes']:.1f} min",
    ]
    for name, (minutes, ettr) in interval.get("best_by_policy", {}).items():
        if name not in (interval["policy"], "wait-for-human"):
            lines.append(f"  best for {name}: {minutes:.1f} min (ETTR {ettr:.2%})")
    spares = result["spares"]
    if spares["smallest_for_target"] is not None:
        lines.append(
            f"Hot spares for ETTR >= {spares['target_ettr']:.1%} (automatic): {spares['smallest_for_target']} node(s)"
        )
    elif "automatic" in [p["name"] for p in result["policies"]]:
        lines.append(f"Hot spares for ETTR >= {spares['target_ettr']:.1%}: not reached with up to 256 spare nodes")
    return lines


def report(result: dict) -> Group:
    """The plan as tables: each policy's ETTR and goodput, the lost GPU-hours by cause, then advice."""
    s = result["scenario"]
    nodes = s["gpus"] // s["gpus_per_node"]
    heading = (
        f"Scenario {s['name']}: {s['gpus']:,} GPUs ({nodes:,} nodes of {s['gpus_per_node']}), "
        f"tp{s['tp']} pp{s['pp']} dp{s['dp']}, {s['days']:g} days, "
        f"{s['failures']['interruptions_per_day']:g} interruptions/day (MTBF {result['mtbf_hours']:.1f} h), "
        f"{s['spare_nodes']} spare nodes, checkpoint every {s['checkpoint']['interval_minutes']:g} min"
    )
    return Group(
        Text(heading, style="bold"),
        Text(""),
        _policies_table(result),
        Text(""),
        Text("Lost GPU-hours by cause (mean per run)", style="bold"),
        _causes_table(result),
        Text(""),
        *(Text(line) for line in _advice(result)),
    )


def plot(result: dict, path: str) -> None:
    """ETTR against checkpoint interval per policy, and where the lost GPU-hours went."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    for name, points in result["checkpoint_interval"]["sweep"].items():
        minutes, ettr = zip(*points, strict=True)
        left.plot(minutes, [100 * e for e in ettr], marker="o", label=name)
    young = result["checkpoint_interval"]["young_daly_minutes"]
    left.axvline(young, color="grey", linestyle="--", label=f"Young-Daly {young:.1f} min")
    left.set_xscale("log")
    left.set_xlabel("checkpoint interval (minutes)")
    left.set_ylabel("ETTR (%)")
    left.set_title(f"{result['scenario']['name']}: ETTR against checkpoint interval")
    left.grid(True, which="both", alpha=0.3)
    left.legend()

    names = [p["name"] for p in result["policies"]]
    bottom = [0.0] * len(names)
    palette = plt.get_cmap("tab20")  # 20 colours: an index picks one
    for index, cause in enumerate(CAUSES):
        values = [p["lost_gpu_hours"][cause] / 1000 for p in result["policies"]]
        if any(values):
            right.bar(names, values, bottom=bottom, label=cause, color=palette(index % palette.N))
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    right.set_ylabel("lost GPU-hours per run (thousands)")
    right.set_title("Where the lost GPU-hours went")
    right.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
