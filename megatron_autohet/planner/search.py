"""The planner's entry points: :func:`make_plan` and :func:`search`, for any objective.

The objective (objective.py) is named by its plan-file name and its arguments, and runs its
search: ``objective`` "throughput" (the default) the fastest plan, by the throughput search
(throughput_search.py, its options in options.py, its branch and bound over the SCIP model in
branch_and_bound.py and scip_model.py); ``objective`` "cost" the cheapest plan reaching a
throughput floor, by the cost search (cost_search.py), which runs the throughput search on sets
of nodes or GPU types. Either way the result records the profile it was priced on and the
objective it was made for, so its re-plans (replan.py) keep both.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

from megatron_autohet.cost_model import (DEFAULT_CHARGE, DEFAULT_MEMORY_HEADROOM, PlanCost,
                                         annotate_plan, check_charge, check_memory_headroom,
                                         record_profile)
from megatron_autohet.errors import ConfigError
from megatron_autohet.plan import DEFAULT_OBJECTIVE, Plan
from megatron_autohet.planner import candidate
from megatron_autohet.planner.candidate import Candidate
from megatron_autohet.planner.interleave import choose_virtual_stages
from megatron_autohet.planner.objective import objective_named
from megatron_autohet.planner.space import resolve_profile, trainable_for
from megatron_autohet.planner.throughput_search import WORK_BUDGET
from megatron_autohet.profiling.profile import Profile
from megatron_autohet.spec.cluster import Cluster
from megatron_autohet.spec.model import ModelSpec


def with_left_out(cost: PlanCost, left_out: dict[str, int]) -> PlanCost:
    """``cost`` with the GPUs ``trainable_for`` left out among its idle GPUs: a plan records
    every GPU of its cluster it leaves idle (the re-planner's unchanged-fleet test compares the
    fleet with that record)."""
    if not left_out:
        return cost
    idle = dict(cost.idle_gpus)
    for gpu, count in left_out.items():
        idle[gpu] = idle.get(gpu, 0) + count
    return dataclasses.replace(cost, idle_gpus=idle)


def make_plan(cluster: Cluster, model: ModelSpec, profile: Profile | None,
              global_batch_size: int, micro_batch_size: int, seq_length: int | None = None, *,
              allow_asymmetric_tp: bool = False, activation_recompute: bool | None = None,
              time_limit_s: float = 60.0, progress: bool = True,
              tp_degrees: list[int] | None = None, max_stages: int | None = None,
              distributed_optimizer: bool = False,
              memory_headroom: float = DEFAULT_MEMORY_HEADROOM,
              work_budget: int = WORK_BUDGET, objective: str = DEFAULT_OBJECTIVE,
              virtual_stages: bool = True) -> Plan:
    """The plan the search finds (see module doc), annotated with its predictions.

    ``profile`` None plans on analytic estimates; a given profile (measured or estimated) wins
    over the estimates where it has entries. ``activation_recompute`` None decides per plan.
    ``tp_degrees`` restricts the TP degrees searched; ``max_stages`` the pipeline depth;
    ``memory_headroom`` is the fraction of every GPU's memory the plan leaves free.
    ``distributed_optimizer``: plans for Megatron-LM's --use-distributed-optimizer, priced so
    and recorded in the plan (the options' memory limits stay those of unsharded Adam state:
    the search does not look for splits that fit only thanks to the sharding).
    ``work_budget`` bounds the search deterministically (throughput_search.py,
    "Deterministic budget"); ``time_limit_s`` is the
    wall-clock safety net. ``objective`` "cost" minimises USD per million tokens instead of
    the iteration time (every node needs a spot price). ``virtual_stages`` False keeps one
    model chunk per stage (planner/interleave.py).
    Raises ConfigError when the batch cannot be split or no plan fits in memory.
    """
    return search(cluster, model, profile, global_batch_size, micro_batch_size, seq_length,
                  allow_asymmetric_tp=allow_asymmetric_tp,
                  activation_recompute=activation_recompute, time_limit_s=time_limit_s,
                  progress=progress, tp_degrees=tp_degrees, max_stages=max_stages,
                  distributed_optimizer=distributed_optimizer,
                  memory_headroom=memory_headroom, work_budget=work_budget,
                  objective=objective, virtual_stages=virtual_stages).plan


def search(cluster: Cluster, model: ModelSpec, profile: Profile | None, global_batch_size: int,
           micro_batch_size: int, seq_length: int | None = None, *,
           allow_asymmetric_tp: bool = False, activation_recompute: bool | None = None,
           time_limit_s: float = 60.0, progress: bool = True, tp_degrees: list[int] | None = None,
           max_stages: int | None = None, seeds: Sequence[Candidate] = (),
           baselines: bool = True, work_budget: int = WORK_BUDGET,
           objective: str = DEFAULT_OBJECTIVE,
           on_candidate: Callable[[Candidate], None] | None = None,
           distributed_optimizer: bool = False,
           memory_headroom: float = DEFAULT_MEMORY_HEADROOM,
           sub_fleets: bool = True, min_tokens_per_s: float | None = None,
           charge: str = DEFAULT_CHARGE, max_searches: int | None = None,
           cluster_file: str = "<cluster>", precision: str | None = None,
           virtual_stages: bool = True) -> Candidate:
    """make_plan, returning the plan with its cost and the TP/recompute choice.

    The plan uses only the GPUs that train in ``precision`` (None: the one it is priced in;
    space.py ``trainable_for``: no V100 or T4 in a bf16 plan), as ``autohet plan``,
    ``compare``, ``replan`` and ``train`` have it; the others are among its idle GPUs
    (recorded in the plan too); a cluster of none of them is a ConfigError naming
    ``cluster_file``.

    ``charge`` prices the plans (cost_model.py, "Price": per-node or per-gpu); with objective
    "cost", ``min_tokens_per_s`` is the throughput floor the cheapest plan must reach
    (cost_search.cheapest; None: none, the degenerate cheapest plan) and ``max_searches`` its
    budget of throughput searches (cost_search.py; None: the default); ``on_candidate`` then
    sees its result only, and ``sub_fleets`` applies to its whole-fleet fallback.

    For the re-planner (planner/replan.py): ``seeds`` are extra incumbents (plans of this
    cluster and batch, evaluated), ``baselines`` False skips the baseline plans (they cost
    seconds on large fleets; the seeds take their place), ``sub_fleets`` False skips the
    sub-fleet searches (throughput_search.SubFleets; a re-plan trades iteration time for state moved
    anyway, and is on the recovery path), and ``on_candidate`` sees every plan the search
    judges that fits in memory (the warm-up post-pass then still changes the best one's plan
    in place).

    ``virtual_stages`` (default True): the plan found then gets interleaved pipelines where the
    cost model prices a gain (planner/interleave.py: after the search, on its chosen plan, so
    the search's own work is unchanged); False keeps one model chunk per stage.
    """
    kind = objective_named(objective)
    if not 0 < time_limit_s < math.inf:
        raise ConfigError("<arguments>", "time_limit_s", f"got {time_limit_s}",
                          "a finite number of seconds > 0")
    goal = kind.from_arguments(min_tokens_per_s, max_searches)
    check_charge(charge, "charge")
    cluster, left_out = trainable_for(cluster, profile, cluster_file, precision)
    deadline = candidate.clock() + time_limit_s
    best = goal.search(cluster, model, profile, global_batch_size, micro_batch_size, seq_length,
                       deadline, allow_asymmetric_tp=allow_asymmetric_tp,
                       activation_recompute=activation_recompute, progress=progress,
                       tp_degrees=tp_degrees, max_stages=max_stages, seeds=seeds,
                       baselines=baselines, work_budget=work_budget, on_candidate=on_candidate,
                       distributed_optimizer=distributed_optimizer,
                       memory_headroom=memory_headroom, sub_fleets=sub_fleets, charge=charge)
    if virtual_stages:
        seq = seq_length or model.seq_length
        plan, cost = choose_virtual_stages(
            best.plan, best.cost, cluster,
            resolve_profile(cluster, model, profile, micro_batch_size, seq),
            check_memory_headroom(memory_headroom), goal.rank, goal.meets)
        if plan is not best.plan:
            best = dataclasses.replace(best, plan=plan, cost=cost)
    if left_out:
        best = dataclasses.replace(best, cost=with_left_out(best.cost, left_out))
        annotate_plan(best.plan, best.cost)
    record_profile(best.plan, profile)
    goal.record(best.plan)
    return best

