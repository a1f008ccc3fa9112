"""compare: our plan against the baselines, all judged by the same cost model.

On a fleet across zones two more plans stand beside them (:func:`zone_plans`): the
zone-oblivious plan, this planner's on the same nodes with the zones ignored (every link the
NICs, no egress), then priced with them; and the best single-zone plan, this planner's on each
zone's nodes alone, the best of them by the objective. They say what seeing the zones is worth:
against the first, what a planner blind to them loses on the links it crosses; against the
second, what spreading over zones gains over keeping to one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from megatron_autohet.cost_model import (DEFAULT_CHARGE, DEFAULT_MEMORY_HEADROOM, PlanCost,
                                         evaluate_plan)
from megatron_autohet.errors import ConfigError
from megatron_autohet.plan import DEFAULT_OBJECTIVE, Plan
from megatron_autohet.planner.baselines import all_baselines
from megatron_autohet.planner.candidate import STOP_COMPLETE, Candidate
from megatron_autohet.planner.objective import objective_named
from megatron_autohet.planner.search import search, with_left_out
from megatron_autohet.planner.space import Problem, check_batch, resolve_profile, trainable_for
from megatron_autohet.profiling.profile import Profile
from megatron_autohet.spec.cluster import Cluster
from megatron_autohet.spec.model import ModelSpec


@dataclass
class BaselineResult:
    name: str
    note: str                       # the grid chosen, or why there is none
    plan: Plan | None
    cost: PlanCost | None
    speedup: float | None           # baseline iteration time / ours
    # how the search that made it ended: a baseline's grids are all judged (or bounded out,
    # exactly), never cut; a zone plan's search may be (candidate.Candidate.stopped_by)
    stopped_by: str = STOP_COMPLETE
    work: int = 0                   # the SCIP nodes that search used
    zone: str | None = None         # the zone a single-zone plan keeps to

    def to_dict(self) -> dict:
        return {"name": self.name, "note": self.note, **({"zone": self.zone} if self.zone
                                                         else {}),
                "iteration_time_s": self.cost.iteration_time_s if self.cost else None,
                "tokens_per_s": self.cost.tokens_per_s if self.cost else None,
                "usd_per_million_tokens": (self.cost.usd_per_million_tokens if self.cost
                                           else None),
                "usd_per_hour": self.cost.usd_per_hour if self.cost else None,
                "egress_usd_per_iteration": (self.cost.egress_usd_per_iteration if self.cost
                                             else None),
                "speedup": self.speedup,
                "idle_gpus": dict(self.cost.idle_gpus) if self.cost else None,
                # a baseline's grids are judged without SCIP: no work to report
                "search": {"complete": self.stopped_by == STOP_COMPLETE,
                           "stopped_by": self.stopped_by,
                           **({"work": self.work} if self.work else {})}}


@dataclass
class Comparison:
    plan: Plan
    cost: PlanCost
    baselines: list[BaselineResult]
    stopped_by: str = STOP_COMPLETE     # how our search ended (candidate.Candidate.stopped_by)
    work: int = 0                       # the SCIP nodes it used
    # on a fleet across zones: the zone-oblivious and the best single-zone plan (module doc);
    # empty on a fleet without zones
    zone_plans: list[BaselineResult] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        """Whether our search completed: nothing left that could beat its plan (not cut by the
        work budget, the cost search's budget or the wall-clock safety net)."""
        return self.stopped_by == STOP_COMPLETE

    def baseline(self, name: str) -> BaselineResult:
        return next(b for b in self.baselines if b.name == name)

    def to_dict(self) -> dict:
        return {"autohet": {"iteration_time_s": self.cost.iteration_time_s,
                            "tokens_per_s": self.cost.tokens_per_s,
                            "usd_per_million_tokens": self.cost.usd_per_million_tokens,
                            "usd_per_hour": self.cost.usd_per_hour,
                            "egress_usd_per_iteration": self.cost.egress_usd_per_iteration,
                            "charge": self.cost.charge,
                            "pipelines": len(self.plan.pipelines),
                            "activation_recompute": self.plan.activation_recompute,
                            "idle_gpus": dict(self.cost.idle_gpus),
                            "search": {"complete": self.complete,
                                       "stopped_by": self.stopped_by, "work": self.work}},
                "baselines": [b.to_dict() for b in self.baselines],
                **({"zone_plans": [z.to_dict() for z in self.zone_plans]}
                   if self.zone_plans else {})}


def compare(cluster: Cluster, model: ModelSpec, profile: Profile | None, global_batch_size: int,
            micro_batch_size: int, seq_length: int | None = None, *,
            allow_asymmetric_tp: bool = False, activation_recompute: bool | None = None,
            time_limit_s: float = 60.0, progress: bool = True,
            memory_headroom: float = DEFAULT_MEMORY_HEADROOM,
            objective: str = DEFAULT_OBJECTIVE, cluster_file: str = "<cluster>",
            min_tokens_per_s: float | None = None, charge: str = DEFAULT_CHARGE,
            virtual_stages: bool = True) -> Comparison:
    """Plan with make_plan's search and evaluate the baselines (planner/baselines.py) on the
    same cluster, model, profile and batch; speedup = baseline time / our time. Every plan
    carries its USD per million tokens when the nodes have prices, charged by ``charge``
    (``min_tokens_per_s``: the cost objective's floor, cost_search.py). All of them run on the GPUs
    that can train in the profile's precision (space.py ``trainable_for``, which the search
    applies too: a bf16 job of any kind has no use for V100s and T4s), the others counted
    idle. The comparison says how our search ended (``stopped_by``, ``work``);
    ``virtual_stages``: search()'s (the baselines keep one model chunk per stage)."""
    seq_length = seq_length or model.seq_length

    def plan_on(fleet: Cluster, show_progress: bool) -> Candidate:
        return search(fleet, model, profile, global_batch_size, micro_batch_size, seq_length,
                      allow_asymmetric_tp=allow_asymmetric_tp,
                      activation_recompute=activation_recompute, time_limit_s=time_limit_s,
                      progress=show_progress, memory_headroom=memory_headroom,
                      objective=objective, min_tokens_per_s=min_tokens_per_s, charge=charge,
                      cluster_file=cluster_file, virtual_stages=virtual_stages)

    best = plan_on(cluster, progress)
    zoned = cluster
    # the baselines on the fleet the search planned on (its GPUs left out counted idle)
    cluster, left_out = trainable_for(cluster, profile, cluster_file)
    problem = Problem(cluster, model, resolve_profile(cluster, model, profile, micro_batch_size,
                                                      seq_length),
                      global_batch_size, micro_batch_size, seq_length,
                      memory_headroom=memory_headroom, charge=charge)
    check_batch(problem)
    modes = [False, True] if activation_recompute is None else [activation_recompute]
    results = []
    for b in all_baselines(problem, modes):
        speedup = b.cost.iteration_time_s / best.cost.iteration_time_s if b.cost else None
        results.append(BaselineResult(b.name, b.note, b.plan,
                                      b.cost and with_left_out(b.cost, left_out), speedup))
    zone_results = []
    if zoned.regions:
        goal = objective_named(objective).from_arguments(min_tokens_per_s)
        zone_results = zone_plans(zoned, best, lambda fleet: plan_on(fleet, False),
                                  lambda plan: with_left_out(evaluate_plan(
                                      plan, cluster, problem.profile, with_timeline=False,
                                      memory_headroom=memory_headroom, charge=charge),
                                      left_out),
                                  goal.rank, goal.meets)
    return Comparison(best.plan, best.cost, results, best.stopped_by, best.work, zone_results)


ZONE_OBLIVIOUS = "zone-oblivious"
SINGLE_ZONE = "single zone"


def zone_plans(cluster: Cluster, ours: Candidate, plan_on: Callable[[Cluster], Candidate],
               price: Callable[[Plan], PlanCost], rank: Callable[[PlanCost], tuple],
               meets: Callable[[PlanCost], bool]) -> list[BaselineResult]:
    """The zone-oblivious plan and the best single-zone plan of a fleet across zones (module
    doc): ``plan_on`` is the planner's search with compare's arguments, ``price`` the cost
    model on the whole fleet with its zones (a single-zone plan's other zones idle), ``rank``
    and ``meets`` the objective's (the best zone: the smallest rank among the plans that meet
    it). A zone where no plan fits (or reaches the floor) has none; where none has, the row
    says so."""
    oblivious = plan_on(cluster.without_zones())
    cost = price(oblivious.plan)
    out = [_zone_result(f"{ZONE_OBLIVIOUS}", "planned without zones", oblivious, cost, ours)]
    singles = []
    for zone in cluster.regions:
        try:
            found = plan_on(cluster.subset(cluster.zone_nodes(zone)))
        except ConfigError:         # no plan fits on this zone alone, or none reaches the floor
            continue
        singles.append((zone, found, price(found.plan)))
    kept = [z for z in singles if meets(z[2])] or singles
    if not kept:
        out.append(BaselineResult(SINGLE_ZONE, "no zone alone holds a plan", None, None, None))
        return out
    zone, found, cost = min(kept, key=lambda z: rank(z[2]))
    out.append(_zone_result(f"{SINGLE_ZONE} ({zone})", f"{zone} alone", found, cost, ours,
                            zone))
    return out


def _zone_result(name: str, what: str, found: Candidate, cost: PlanCost, ours: Candidate,
                 zone: str | None = None) -> BaselineResult:
    plan = found.plan
    note = (f"{what}: {len(plan.pipelines)} pipeline{'s' if len(plan.pipelines) != 1 else ''}"
            f", recompute {'on' if plan.activation_recompute else 'off'}")
    return BaselineResult(name, note, plan, cost,
                          cost.iteration_time_s / ours.cost.iteration_time_s,
                          found.stopped_by, found.work, zone)
