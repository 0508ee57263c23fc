"""The planner against a closed form, its use of the real policy, and the simulate command."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from lazarus.planner.model import PolicyTable, analytic_ettr, run_policy
from lazarus.planner.simulate import measured_costs
from lazarus.schema.scenario import Measured, Scenario


def closed_form_scenario(**changes) -> Scenario:
    data = {
        "name": "closed-form",
        "gpus": 8,
        "gpus_per_node": 8,
        "tp": 8,
        "pp": 1,
        "dp": 1,
        "days": 200,
        "failures": {"interruptions_per_day": 12},  # MTBF 2 h
        "costs": {"detect": 0, "drain": 0, "reschedule": 0, "replace_or_reshard": 0, "resume": 600},
        "checkpoint": {"interval_minutes": 30, "save_stall_seconds": 0, "load_seconds": 0},
        "spare_nodes": 100_000,
        "repair_hours": 1,
        "policies": ["automatic"],
        "repetitions": 100,
        "seed": 7,
    }
    data.update(changes)
    return Scenario.model_validate(data)


@pytest.mark.parametrize("interval_minutes, resume_seconds", [(30, 600), (10, 60), (90, 1800)])
def test_simulated_ettr_matches_the_closed_form(interval_minutes, resume_seconds):
    scenario = closed_form_scenario(
        checkpoint={"interval_minutes": interval_minutes, "save_stall_seconds": 0, "load_seconds": 0},
        costs={"detect": 0, "drain": 0, "reschedule": 0, "replace_or_reshard": 0, "resume": resume_seconds},
    )
    expected = analytic_ettr(interval_minutes * 60, 7200, resume_seconds)
    simulated = run_policy(scenario, "automatic").ettr
    assert abs(simulated - expected) / expected < 0.01, (simulated, expected)


def test_with_survivors_a_fault_costs_half_a_step_and_the_survivors_save():
    # dp 2: a replica always survives; no hangs. Between faults (MTBF 2 h of training) the run
    # loses half a 60 s step and stands still for resume (600 s) plus the survivors' save (60 s).
    scenario = closed_form_scenario(
        gpus=16,
        dp=2,
        checkpoint={
            "interval_minutes": 30,
            "save_stall_seconds": 0,
            "load_seconds": 0,
            "step_seconds": 60,
            "survivor_save_seconds": 60,
        },
        policies=["survivors"],
    )
    expected = (7200 - 30) / (7200 + 600 + 60)
    simulated = run_policy(scenario, "survivors").ettr
    assert abs(simulated - expected) / expected < 0.01, (simulated, expected)
    assert simulated > run_policy(scenario, "automatic").ettr


def test_decisions_come_from_the_workflow_policy():
    scenario = Scenario.model_validate(
        {
            "name": "pp",
            "gpus": 64,
            "gpus_per_node": 8,
            "tp": 8,
            "pp": 2,
            "dp": 4,
            "min_dp": 2,
            "failures": {"interruptions_per_day": 1},
        }
    )
    automatic = PolicyTable(scenario, use_spares=True)
    assert automatic.decide(4, spare_free=True) == ("replace", 4, 0)
    # Without a spare: the broken replica's other node goes back to the pool.
    assert automatic.decide(4, spare_free=False) == ("reshard", 3, 1)
    assert automatic.decide(2, spare_free=False) == ("wait", 2, 0)
    assert PolicyTable(scenario, use_spares=False).decide(4, spare_free=True) == ("reshard", 3, 1)


def test_more_spares_and_faster_recovery_never_lose_ettr():
    base = closed_form_scenario(dp=1, days=30, repetitions=40, spare_nodes=0, repair_hours=12)
    without = run_policy(base, "automatic").ettr
    with_spares = run_policy(base.model_copy(update={"spare_nodes": 4}), "automatic").ettr
    human = run_policy(base.model_copy(update={"spare_nodes": 4}), "wait-for-human").ettr
    assert with_spares > without and with_spares > human


def small_scenario(failures: dict, **more) -> Scenario:
    """256 GPUs (tp8 x pp4 x dp8) for 20 days, 6 interruptions a day, with `failures` and `more`."""
    return Scenario.model_validate(
        {
            "name": "small",
            "gpus": 256,
            "gpus_per_node": 8,
            "tp": 8,
            "pp": 4,
            "dp": 8,
            "days": 20,
            "failures": {"interruptions_per_day": 6, **failures},
            **more,
        }
    )


def test_lost_hours_and_useful_work_add_up_to_the_allocation():
    kinds = {"hang_share": 0.3, "straggler_share": 0.2, "sick_share": 0.1}
    scenario = small_scenario(kinds, spare_nodes=2, repetitions=30, repair_hours=30)
    for policy in scenario.policies:
        result = run_policy(scenario, policy)
        allocation_hours = (scenario.gpus + scenario.spare_nodes * scenario.gpus_per_node) * scenario.days * 24
        useful_hours = result.goodput * allocation_hours
        assert math.isclose(useful_hours + sum(result.lost_gpu_hours.values()), allocation_hours, rel_tol=1e-6), policy


def test_hangs_stragglers_and_sick_nodes_cost_what_their_recoveries_cost():
    def scenario(**failures) -> Scenario:
        checkpoint = {"interval_minutes": 60, "survivor_save_seconds": 10}
        return small_scenario(failures, spare_nodes=4, checkpoint=checkpoint, repetitions=40)

    crashes = run_policy(scenario(), "survivors")
    # A hang costs a death's recovery and its detection time, no more: its survivors keep the state too.
    hangs = run_policy(scenario(hang_share=1.0, hang_detect_seconds=600), "survivors")
    assert hangs.lost_gpu_hours["recomputed_steps"] <= 1.2 * crashes.lost_gpu_hours["recomputed_steps"]
    assert hangs.lost_gpu_hours["detect"] > 10 * crashes.lost_gpu_hours["detect"]
    # A straggler slows the job until it is found and loses no step; a sick node loses nothing to detection.
    slow = run_policy(scenario(straggler_share=1.0, straggler_factor=2.0), "automatic")
    sick = run_policy(scenario(sick_share=1.0), "automatic")
    assert slow.lost_gpu_hours["slow_nodes"] > 0 and slow.lost_gpu_hours["recomputed_steps"] == 0
    assert sick.lost_gpu_hours["slow_nodes"] == sick.lost_gpu_hours["detect"] == 0
    assert sick.lost_gpu_hours["recomputed_steps"] == 0 and sick.ettr > crashes.ettr
    with pytest.raises(ValueError, match="must be at most 1"):
        scenario(hang_share=0.6, sick_share=0.6)


def test_measured_costs_come_from_run_status_json(tmp_path):
    stages = {
        name: {"seconds": seconds}
        for name, seconds in [
            ("detect", 0.1),
            ("drain", 0.05),
            ("reschedule", 0.01),
            ("replace_or_reshard", 0.01),
            ("resume", 4.5),
        ]
    }
    path = tmp_path / "status.json"
    path.write_text(json.dumps([{"incidents": [{"stages": stages}]}, {"incidents": [{"stages": stages}]}]))
    costs = measured_costs(str(path))
    assert costs["resume"] == Measured(dist="measured", samples=[4.5, 4.5])


def test_simulate_command_prints_json_and_writes_a_plot(tmp_path):
    scenario = tmp_path / "small.yaml"
    scenario.write_text(
        "name: small\ngpus: 128\ngpus_per_node: 8\ntp: 8\npp: 2\ndp: 8\ndays: 10\nspare_nodes: 2\n"
        "failures: {interruptions_per_day: 5}\nhuman_restart: 1200\nrepetitions: 20\n"
    )
    plot = tmp_path / "plan.png"
    done = subprocess.run(
        [sys.executable, "-m", "lazarus.cli", "simulate", str(scenario), "--json", "--plot", str(plot)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    names = [p["name"] for p in result["policies"]]
    assert names == ["automatic", "survivors", "reshard-only", "wait-for-human"]
    for policy in result["policies"]:
        assert 0 < policy["ettr"] < 1 and 0 < policy["goodput"] <= policy["ettr"]
        assert set(policy["lost_gpu_hours"]) >= {"detect", "resume", "recomputed_steps", "idle_spares"}
    automatic, survivors, _, human = result["policies"]
    assert human["lost_gpu_hours"]["human"] > 0 and human["ettr"] < automatic["ettr"]
    recomputed = survivors["lost_gpu_hours"]["recomputed_steps"]
    assert recomputed < automatic["lost_gpu_hours"]["recomputed_steps"] / 10
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulate_refuses_a_bad_scenario_in_one_line(tmp_path):
    scenario = tmp_path / "bad.yaml"
    scenario.write_text("name: bad\ngpus: 100\ntp: 8\npp: 2\ndp: 8\nfailures: {interruptions_per_day: 5}\n")
    done = subprocess.run(
        [sys.executable, "-m", "lazarus.cli", "simulate", str(scenario)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert done.stderr == "lazarus: error: dp*pp*tp = 128 but gpus is 100; make them equal\n"
