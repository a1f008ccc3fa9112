"""compare: our plan against the baselines, all judged by the same cost model."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_autohet.cost_model import DEFAULT_CHARGE, DEFAULT_MEMORY_HEADROOM, PlanCost
from megatron_autohet.plan import DEFAULT_OBJECTIVE, Plan
from megatron_autohet.planner.baselines import all_baselines
from megatron_autohet.planner.candidate import STOP_COMPLETE
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

    def to_dict(self) -> dict:
        return {"name": self.name, "note": self.note,
                "iteration_time_s": self.cost.iteration_time_s if self.cost else None,
                "tokens_per_s": self.cost.tokens_per_s if self.cost else None,
                "usd_per_million_tokens": (self.cost.usd_per_million_tokens if self.cost
                                           else None),
                "usd_per_hour": self.cost.usd_per_hour if self.cost else None,
                "egress_usd_per_iteration": (self.cost.egress_usd_per_iteration if self.cost
                                             else None),
                "speedup": self.speedup,
                "idle_gpus": dict(self.cost.idle_gpus) if self.cost else None,
                # a baseline's grids are all judged (or bounded out, exactly): never cut
                "search": {"complete": True, "stopped_by": STOP_COMPLETE}}


@dataclass
class Comparison:
    plan: Plan
    cost: PlanCost
    baselines: list[BaselineResult]
    stopped_by: str = STOP_COMPLETE     # how our search ended (candidate.Candidate.stopped_by)
    work: int = 0                       # the SCIP nodes it used

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
                "baselines": [b.to_dict() for b in self.baselines]}


def compare(cluster: Cluster, model: ModelSpec, profile: Profile | None, global_batch_size: int,
            micro_batch_size: int, seq_length: int | None = None, *,
            allow_asymmetric_tp: bool = False, activation_recompute: bool | None = None,
            time_limit_s: float = 60.0, progress: bool = True,
            memory_headroom: float = DEFAULT_MEMORY_HEADROOM,
            objective: str = DEFAULT_OBJECTIVE, cluster_file: str = "<cluster>",
            min_tokens_per_s: float | None = None, charge: str = DEFAULT_CHARGE) -> Comparison:
    """Plan with make_plan's search and evaluate the baselines (planner/baselines.py) on the
    same cluster, model, profile and batch; speedup = baseline time / our time. Every plan
    carries its USD per million tokens when the nodes have prices, charged by ``charge``
    (``min_tokens_per_s``: the cost objective's floor, cost_search.py). All of them run on the GPUs
    that can train in the profile's precision (space.py ``trainable_for``, which the search
    applies too: a bf16 job of any kind has no use for V100s and T4s), the others counted
    idle. The comparison says how our search ended (``stopped_by``, ``work``)."""
    seq_length = seq_length or model.seq_length
    best = search(cluster, model, profile, global_batch_size, micro_batch_size, seq_length,
                  allow_asymmetric_tp=allow_asymmetric_tp,
                  activation_recompute=activation_recompute, time_limit_s=time_limit_s,
                  progress=progress, memory_headroom=memory_headroom, objective=objective,
                  min_tokens_per_s=min_tokens_per_s, charge=charge, cluster_file=cluster_file)
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
    return Comparison(best.plan, best.cost, results, best.stopped_by, best.work)
