"""The planner: a Monte Carlo simulation of a long run on a large cluster (`lazarus simulate`).

Model, per repetition, in wall-clock seconds:
- The job trains in segments of `interval` training seconds followed by a save that stalls it
  for `save_stall` seconds; a checkpoint counts once its save is over.
- Faults strike while the job trains, as a Poisson process whose rate is proportional to the
  nodes in use (failures during a recovery are not modelled). A fault loses the training since
  the last complete checkpoint, then costs its recovery: each stage's cost (a hang is noticed
  after the hang time instead of the crash detector's time; drain stops the hung node first, so
  its survivors save as they do for a death), or a person's restart. A straggler or a sick node
  loses no step: the job trains on (slowed by the straggler until it is found) and the node is
  swapped for a spare in a planned recovery at a step boundary.
- The decision after a fault is the workflow's own policy, `lazarus.workflows.policy.plan_recovery`,
  called on an inventory of the scenario's shape: a hot spare if one is free (the failed node
  goes to repair and comes back as a spare after `repair_hours`), else reshard to the largest
  dp that fits (the broken replica's healthy nodes join the pool), else wait for a repair.
- With `regrow`, once the pool holds a whole replica the job checkpoints and restarts one
  replica larger (drain, reschedule, replace, resume).

Accounting, in GPU-seconds of the job's allocation (its GPUs plus the spares): useful work is
committed training at full size; a run at dp < target loses the missing replicas' share; a
recovery loses the whole job's GPUs for its duration; spares are idle whenever they exist.
ETTR = useful / (job GPUs x wall time); goodput = useful / (all GPUs x wall time).
"""

from __future__ import annotations

import heapq
import math
import random
import statistics
from dataclasses import dataclass, field

from lazarus.schema.layout import Layout
from lazarus.schema.records import Assignment, Inventory, NodeRecord
from lazarus.schema.scenario import Fixed, LogNormal, Measured, Scenario, Uniform
from lazarus.workflows.policy import plan_recovery

CAUSES = (
    "detect",
    "drain",
    "reschedule",
    "replace_or_reshard",
    "resume",
    "human",
    "waiting_for_capacity",
    "recomputed_steps",
    "checkpoint_stalls",
    "below_target_dp",
    "slow_nodes",
    "idle_spares",
)
"""Where lost GPU-hours go."""

RECOVERY_STAGES = ("detect", "drain", "reschedule", "replace_or_reshard", "resume")


def sampler(cost, rng: random.Random):
    """A function that draws one cost (seconds) from a scenario's cost model."""
    if isinstance(cost, Fixed):
        return lambda: cost.seconds
    if isinstance(cost, LogNormal):
        mu = math.log(cost.median)
        return lambda: rng.lognormvariate(mu, cost.sigma)
    if isinstance(cost, Uniform):
        return lambda: rng.uniform(cost.low, cost.high)
    if isinstance(cost, Measured):
        return lambda: rng.choice(cost.samples)
    raise TypeError(f"unknown cost model {cost!r}")


def mean_cost(cost) -> float:
    """Expected value of a cost model (seconds)."""
    if isinstance(cost, Fixed):
        return cost.seconds
    if isinstance(cost, LogNormal):
        return cost.median * math.exp(cost.sigma**2 / 2)
    if isinstance(cost, Uniform):
        return (cost.low + cost.high) / 2
    return statistics.fmean(cost.samples)


class PolicyTable:
    """plan_recovery's decision for one lost node, memoised by (current dp, is a spare free).

    The decision depends on the inventory only through those two facts, so each distinct
    state asks the real policy function once, on an inventory of the scenario's shape.
    """

    def __init__(self, scenario: Scenario, use_spares: bool):
        self.scenario = scenario
        self.use_spares = use_spares
        self.layout = Layout(dp=scenario.dp, pp=scenario.pp, tp=scenario.tp, ranks_per_node=scenario.gpus_per_node)
        self._cache: dict[tuple[int, bool], tuple[str, int, int]] = {}

    def decide(self, dp: int, spare_free: bool) -> tuple[str, int, int]:
        """(action, dp after, nodes released to the pool) after one node of the job fails."""
        key = (dp, spare_free and self.use_spares)
        if key not in self._cache:
            per_replica = self.scenario.nodes_per_replica
            names = [f"n{i}" for i in range(dp * per_replica)]
            nodes = [NodeRecord(name=n, role="active") for n in names]
            if key[1]:
                nodes.append(NodeRecord(name="spare", role="spare"))
            layout = self.layout.model_copy(update={"dp": dp})
            decision = plan_recovery(
                Inventory(nodes=nodes),
                Assignment(incarnation=0, nodes=names, layout=layout, master_port=1),
                [names[-1]],
                target_dp=self.scenario.dp,
                min_dp=self.scenario.min_dp,
            )
            self._cache[key] = (decision.action, decision.layout.dp, len(decision.released_nodes))
        return self._cache[key]


@dataclass
class Outcome:
    """One repetition: GPU-seconds useful and lost by cause, and what happened."""

    useful: float = 0.0
    lost: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CAUSES, 0.0))
    faults: int = 0
    reshards: int = 0
    regrows: int = 0


def simulate_once(
    scenario: Scenario,
    policy: str,
    table: PolicyTable | None,
    rng: random.Random,
    interval_minutes: float | None = None,
    spare_nodes: int | None = None,
) -> Outcome:
    """One run of the scenario under a policy; `interval_minutes` and `spare_nodes` override the scenario's."""
    return Simulation(scenario, policy, table, rng, interval_minutes, spare_nodes).run()


class Simulation:
    """One repetition's state: the clock, the job's dp, where it is in its train+save segment, the
    pool of healthy free nodes and the repairs under way."""

    def __init__(self, scenario, policy, table, rng, interval_minutes=None, spare_nodes=None):
        s = self.scenario = scenario
        self.policy, self.table, self.rng = policy, table, rng
        self.spares = s.spare_nodes if spare_nodes is None else spare_nodes
        self.horizon = s.days * 86400.0
        self.interval = (interval_minutes or s.checkpoint.interval_minutes) * 60.0
        self.stall = s.checkpoint.save_stall_seconds
        self.rate_per_node = s.failures.interruptions_per_day / 86400.0 / s.nodes
        self.stage_cost = {name: sampler(getattr(s.costs, name), rng) for name in RECOVERY_STAGES}
        self.human = sampler(s.human_restart, rng)
        self.out = Outcome()
        self.out.lost["idle_spares"] = self.spares * s.gpus_per_node * self.horizon
        self.t, self.dp, self.phase = 0.0, s.dp, 0.0  # phase: position within the current train+save segment
        # Healthy nodes free for the job: the spares (reshard-only leaves them idle), then the
        # broken replicas' released nodes and repaired ones.
        self.pool = self.spares if policy != "reshard-only" else 0
        self.repairs: list[float] = []  # when failed nodes come back

    @property
    def share(self) -> float:
        """The job's size as a share of its target (dp / target dp)."""
        return self.dp / self.scenario.dp

    def run(self) -> Outcome:
        """Simulate until the horizon; returns what was useful and what was lost."""
        while self.t < self.horizon:
            self.collect_repairs()
            if self.can_regrow():
                self.regrow()
            elif self.train_until_event():
                self.out.faults += 1
                if self.policy == "wait-for-human":
                    self.lose_pending_training(kept=False)
                    self.wait_for_human()
                else:
                    kind = self.fault_kind()
                    if kind in ("straggler", "sick"):
                        self.swap(kind)
                        continue
                    # Drain stops a hung node first, so its peers save as for a death; with one
                    # replica the lost node took a part of the only copy.
                    kept = self.policy == "survivors" and self.dp > 1
                    self.lose_pending_training(kept)
                    self.recover(kind == "hang", kept)
        return self.out

    def fault_kind(self) -> str:
        """What the fault is, drawn by the scenario's shares: hang, straggler, sick, or a crash."""
        failures, draw = self.scenario.failures, self.rng.random()
        for kind, share in (("hang", failures.hang_share), ("straggler", failures.straggler_share)):
            if draw < share:
                return kind
            draw -= share
        return "sick" if draw < failures.sick_share else "crash"

    def swap(self, kind: str) -> None:
        """A planned swap: a straggler slows the job until it is found; then the job checkpoints at a
        step boundary (nothing pending is lost) and the node goes for a spare (drain to resume)."""
        failures, gpus = self.scenario.failures, self.scenario.gpus
        if kind == "straggler":
            slowed = min(failures.straggler_detect_seconds, self.horizon - self.t)
            self.out.lost["slow_nodes"] += slowed * gpus * self.share * (1 - 1 / failures.straggler_factor)
            self.out.useful += slowed * gpus * self.share / failures.straggler_factor
            self.out.lost["below_target_dp"] += slowed * gpus * (1 - self.share)
            self.t += slowed
        self.out.useful += min(self.phase, self.interval) * gpus * self.share
        self.phase = 0.0
        self.collect_repairs()
        heapq.heappush(self.repairs, self.t + self.scenario.repair_hours * 3600.0)
        self.downtime(self.scenario.checkpoint.survivor_save_seconds, "drain")
        self.recover(False, True, detected=True)

    def downtime(self, seconds: float, cause: str) -> None:
        """The whole job stands still for `seconds`, lost to `cause` (cut at the horizon)."""
        seconds = min(max(seconds, 0.0), self.horizon - self.t)
        self.out.lost[cause] += seconds * self.scenario.gpus
        self.t += seconds

    def collect_repairs(self) -> None:
        while self.repairs and self.repairs[0] <= self.t:
            heapq.heappop(self.repairs)
            self.pool += 1

    def can_regrow(self) -> bool:
        s = self.scenario
        return s.regrow and self.policy != "wait-for-human" and self.dp < s.dp and self.pool >= s.nodes_per_replica

    def regrow(self) -> None:
        """A planned restart one or more replicas larger: checkpoint first (the pending training
        is kept), then every stage but detect."""
        s, gpus = self.scenario, self.scenario.gpus
        grow = min(s.dp - self.dp, self.pool // s.nodes_per_replica)
        self.pool -= grow * s.nodes_per_replica
        self.out.useful += min(self.phase, self.interval) * gpus * self.share
        save = min(self.stall, self.horizon - self.t)
        self.out.lost["checkpoint_stalls"] += save * gpus * self.share
        self.out.lost["below_target_dp"] += save * gpus * (1 - self.share)
        self.t += save
        for name in RECOVERY_STAGES[1:]:
            self.downtime(self.stage_cost[name]() + (s.checkpoint.load_seconds if name == "resume" else 0.0), name)
        self.dp += grow
        self.phase = 0.0
        self.out.regrows += 1

    def train_until_event(self) -> bool:
        """Train until the next fault (True), the next repair (it may allow a regrow) or the end."""
        s, gpus, share = self.scenario, self.scenario.gpus, self.share
        until_fault = self.rng.expovariate(self.rate_per_node * self.dp * s.nodes_per_replica)
        waiting_for_repair = self.repairs and self.dp < s.dp and self.policy != "wait-for-human"
        until_repair = self.repairs[0] - self.t if waiting_for_repair else math.inf
        busy = min(until_fault, until_repair, self.horizon - self.t)
        segment = self.interval + self.stall
        total = self.phase + busy
        segments = int(total // segment)
        # Training commits a segment at a time; the part of the current one is pending. The
        # stretch may start or end inside a save, whose stall counts once.
        stalls = (
            segments * self.stall
            + max(0.0, total - segments * segment - self.interval)
            - max(0.0, self.phase - self.interval)
        )
        self.phase = total - segments * segment
        self.out.useful += segments * self.interval * gpus * share
        self.out.lost["checkpoint_stalls"] += stalls * gpus * share
        self.out.lost["below_target_dp"] += busy * gpus * (1 - share)
        self.t += busy
        if busy < until_fault and self.t >= self.horizon:
            # The run is still going: its pending training counts.
            self.out.useful += min(self.phase, self.interval) * gpus * share
        return busy >= until_fault

    def lose_pending_training(self, kept: bool) -> None:
        """A fault: the training since the last checkpoint is lost (a save in progress never
        commits), unless the survivors `kept` it: then only the step in flight is (half a step on
        average), and their saved state is the new restore point; the failed node goes to repair."""
        pending = min(self.phase, self.interval)
        lost = min(pending, self.scenario.checkpoint.step_seconds / 2) if kept else pending
        self.out.useful += (pending - lost) * self.scenario.gpus * self.share
        self.out.lost["recomputed_steps"] += lost * self.scenario.gpus * self.share
        self.phase = 0.0
        self.collect_repairs()
        heapq.heappush(self.repairs, self.t + self.scenario.repair_hours * 3600.0)

    def wait_for_human(self) -> None:
        """A person restarts the run on a spare, once one is free."""
        while self.pool == 0 and self.t < self.horizon:
            self.downtime(self.repairs[0] - self.t, "waiting_for_capacity")
            self.collect_repairs()
        self.pool -= 1
        self.downtime(self.human() + self.scenario.checkpoint.load_seconds, "human")

    def recover(self, hang: bool, kept: bool, detected: bool = False) -> None:
        """Lazarus's recovery: the five stages, with the workflow's own decision; drain waits for
        the survivors' saves when they `kept` the state (a planned swap, `detected` while the job
        trained, saved at its step boundary already)."""
        failures, survivor_save = self.scenario.failures, self.scenario.checkpoint.survivor_save_seconds
        if not detected:
            self.downtime(failures.hang_detect_seconds if hang else self.stage_cost["detect"](), "detect")
        self.downtime(self.stage_cost["drain"]() + (survivor_save if kept and not detected else 0.0), "drain")
        while True:
            action, new_dp, released = self.table.decide(self.dp, self.pool > 0)
            self.downtime(self.stage_cost["reschedule"](), "reschedule")
            if action == "wait" and self.policy == "reshard-only" and self.pool > 0:
                # Below the minimum dp without spares: a repaired node takes the lost one's place.
                action = "replace"
            if action != "wait" or self.t >= self.horizon:
                break
            self.downtime((self.repairs[0] - self.t) if self.repairs else self.horizon - self.t, "waiting_for_capacity")
            self.collect_repairs()
        if action == "replace":
            self.pool -= 1
        elif action == "reshard":
            self.out.reshards += 1
            self.pool += released
            self.dp = new_dp
        self.downtime(self.stage_cost["replace_or_reshard"](), "replace_or_reshard")
        self.downtime(self.stage_cost["resume"]() + self.scenario.checkpoint.load_seconds, "resume")


@dataclass
class PolicyResult:
    """One policy over all repetitions."""

    name: str
    ettr: float
    ettr_ci95: tuple[float, float]
    goodput: float
    lost_gpu_hours: dict[str, float]
    faults_per_run: float
    reshards_per_run: float
    regrows_per_run: float

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "ettr": self.ettr,
            "ettr_ci95": list(self.ettr_ci95),
            "goodput": self.goodput,
            "lost_gpu_hours": self.lost_gpu_hours,
            "lost_gpu_hours_total": sum(self.lost_gpu_hours.values()),
            "faults_per_run": self.faults_per_run,
            "reshards_per_run": self.reshards_per_run,
            "regrows_per_run": self.regrows_per_run,
        }


def run_policy(
    scenario: Scenario,
    policy: str,
    repetitions: int | None = None,
    seed: int | None = None,
    interval_minutes: float | None = None,
    spare_nodes: int | None = None,
) -> PolicyResult:
    """Simulate one policy over many repetitions."""
    repetitions = repetitions or scenario.repetitions
    rng = random.Random(scenario.seed if seed is None else seed)
    table = PolicyTable(scenario, use_spares=policy in ("automatic", "survivors"))
    outcomes = [simulate_once(scenario, policy, table, rng, interval_minutes, spare_nodes) for _ in range(repetitions)]
    spares = scenario.spare_nodes if spare_nodes is None else spare_nodes
    job = scenario.gpus * scenario.days * 86400.0
    everything = job + spares * scenario.gpus_per_node * scenario.days * 86400.0
    ettrs = [o.useful / job for o in outcomes]
    mean = statistics.fmean(ettrs)
    half = 1.96 * statistics.stdev(ettrs) / math.sqrt(len(ettrs)) if len(ettrs) > 1 else 0.0
    return PolicyResult(
        name=policy,
        ettr=mean,
        ettr_ci95=(mean - half, mean + half),
        goodput=statistics.fmean(o.useful for o in outcomes) / everything,
        lost_gpu_hours={c: statistics.fmean(o.lost[c] for o in outcomes) / 3600.0 for c in CAUSES},
        faults_per_run=statistics.fmean(o.faults for o in outcomes),
        reshards_per_run=statistics.fmean(o.reshards for o in outcomes),
        regrows_per_run=statistics.fmean(o.regrows for o in outcomes),
    )


def job_mtbf_seconds(scenario: Scenario) -> float:
    """Mean time between faults of the whole job at full size (seconds)."""
    return 86400.0 / scenario.failures.interruptions_per_day


def young_daly_minutes(scenario: Scenario) -> float:
    """Young's first-order optimal checkpoint interval sqrt(2 x save cost x MTBF) (minutes)."""
    return math.sqrt(2 * scenario.checkpoint.save_stall_seconds * job_mtbf_seconds(scenario)) / 60.0


def analytic_ettr(interval_s: float, mtbf_s: float, downtime_s: float) -> float:
    """Closed form for exponential faults during training, a fixed downtime per fault, free saves.

    A segment of `interval_s` training commits only if no fault hits it; each fault costs the
    downtime and the partial segment. Expected wall time per committed segment:
    (e^(interval/MTBF) - 1) x (MTBF + downtime).
    """
    return interval_s / (math.expm1(interval_s / mtbf_s) * (mtbf_s + downtime_s))
