"""make_plan: the decomposed search around the SCIP model.

The search is split so that no step grows with the number of GPUs except through integers:

1. **TP degrees** (outer enumeration). Symmetric TP (the default, DESIGN.md): one degree t for
   every TP group of the fleet, so every layer has the same TP degree in every replica and the
   layer-wise gradient sync is a plain shard-wise all-reduce; t must divide every node's GPU
   count (TP groups stay inside a node and every GPU is used). With ``allow_asymmetric_tp`` each
   GPU type gets its own degree, found by coordinate descent from the best symmetric choice.
2. **Activation recompute** (outer): off, and on only where memory limits a layer split
   (recompute only adds time), unless the caller fixes it.
3. **Pipeline shapes** (enumerated, independent of cluster size): stage sequences of at most
   ``max_stages`` TP groups over at most three GPU types, each type in one contiguous run (the
   orders of the runs are all tried). For each sequence, :func:`space.split_options` gives the
   min-period layer split and a few looser ones; options with the same GPU-count vector are
   Pareto-filtered on (fill, period, extra).
4. **Composition** (SCIP, planner/scip_model.py): integer multiplicities of the options that use
   every TP group exactly once and finish the global batch earliest.
5. **Micro-batches and placement**: exact greedy micro-batch split, best-fit placement of stage
   runs into nodes, and the full cost model on the resulting plan. The gradient-sync estimate
   used in steps 3-4 assumes many replicas; it is refined once with the replica count found.

Bounded work: the shape enumeration depends on the number of GPU types and ``max_stages``, the
SCIP model has one integer per surviving option and one equality per GPU type, and the bisection
takes a dozen solves; the number of GPUs only changes right-hand sides.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from dataclasses import dataclass

from tqdm import tqdm

from megatron_autohet.cost_model import PlanCost, stage_memory_bytes, GIB
from megatron_autohet.errors import ConfigError
from megatron_autohet.plan import Plan
from megatron_autohet.planner.scip_model import fluid_lower_bound_s, solve_composition
from megatron_autohet.planner.space import (PipelineOption, Pool, Problem, assign_microbatches,
                                            build_plan, check_batch, evaluate, make_pools,
                                            StageCoefficients, layer_splits,
                                            option_for_split, stage_coefficients)
from megatron_autohet.profiling.estimate import estimate_profile
from megatron_autohet.profiling.profile import Profile
from megatron_autohet.spec.cluster import Cluster
from megatron_autohet.spec.model import ModelSpec

# Pipeline shapes mix at most this many GPU types (3-type fleets need every mix; more types
# than that in one pipeline only add slow cross-type links).
MAX_TYPES_PER_PIPELINE = 3
# Upper bound on the default number of stages per pipeline (deeper ones only when memory needs).
MAX_STAGES_CAP = 16
# The grad-sync estimate when the replica count is not fixed: 2 (D - 1) / D with D large.
MANY_REPLICAS = 1024
# Replica counts up to this get an exact sync factor (one SCIP solve each).
EXACT_REPLICAS = 8
# Thresholds on the sync + optimizer time tried for the best replica range.
THRESHOLD_LEVELS = 6
# ... only for replica ranges whose first plan is within this factor of the best so far.
THRESHOLD_WITHIN = 1.1


@dataclass
class Candidate:
    plan: Plan
    cost: PlanCost
    tp_of_gpu: dict[str, int]
    recompute: bool


def resolve_profile(cluster: Cluster, model: ModelSpec, profile: Profile | None,
                    micro_batch_size: int, seq_length: int) -> Profile:
    """The given profile, with analytic estimates for the entries it lacks."""
    estimate = estimate_profile(model, cluster, micro_batch_size, seq_length)
    return estimate if profile is None else profile.merged_over(estimate)


def default_max_stages(problem: Problem, pools: list[Pool]) -> int:
    """Enough stages for the smallest-memory pool to hold the model alone, plus two; at least 8."""
    L = problem.model.num_layers
    needed = 1
    for pool in pools:
        entry = problem.entry(pool)
        limit = problem.cluster.gpu_types[pool.gpu].memory_gib * GIB
        m1 = stage_memory_bytes(entry, problem.model, 1, False, False, False, 1)
        m2 = stage_memory_bytes(entry, problem.model, 2, False, False, False, 1)
        per_stage = max(1, int((limit - m1) // (m2 - m1)) + 1) if limit > m1 else 1
        needed = max(needed, math.ceil(L / per_stage))
    return min(L, MAX_STAGES_CAP, max(8, needed + 2))


def stage_sequences(pools: list[Pool], max_stages: int) -> list[tuple[int, ...]]:
    """Every stage sequence: a count per pool (<= the pool's groups), contiguous runs in every
    order of the pools used."""
    out = []
    K = len(pools)
    for used in range(1, min(K, MAX_TYPES_PER_PIPELINE) + 1):
        for subset in itertools.combinations(range(K), used):
            ranges = [range(1, min(pools[k].count, max_stages) + 1) for k in subset]
            for counts in itertools.product(*ranges):
                if sum(counts) > max_stages:
                    continue
                for order in itertools.permutations(range(used)):
                    out.append(tuple(subset[i] for i in order for _ in range(counts[i])))
    return out


# Options kept per GPU-count vector after the Pareto filter: the extremes of each criterion and
# the best balance (more only slow the SCIP solves down; measured no better plans).
OPTIONS_PER_SHAPE = 4


def _pareto(options: list[PipelineOption]) -> list[PipelineOption]:
    options = sorted(options, key=lambda o: (o.period_s, o.fill_s, o.extra_s))
    kept: list[PipelineOption] = []
    for o in options:
        if not any(k.period_s <= o.period_s and k.fill_s <= o.fill_s and k.extra_s <= o.extra_s
                   for k in kept):
            kept.append(o)
    if len(kept) <= OPTIONS_PER_SHAPE:
        return kept
    picks = [min(kept, key=lambda o: o.period_s), min(kept, key=lambda o: o.fill_s),
             min(kept, key=lambda o: o.extra_s),
             min(kept, key=lambda o: o.period_s + o.extra_s)]
    return list({id(o): o for o in picks}.values())


@dataclass(frozen=True)
class Split:
    sequence: tuple[int, ...]
    coeffs: tuple[StageCoefficients, ...]
    layers: tuple[int, ...]


def candidate_splits(problem: Problem, pools: list[Pool], recompute: bool,
                     max_stages: int) -> tuple[list[Split], bool]:
    """Every stage sequence with its layer splits, and whether memory limited any split."""
    splits: list[Split] = []
    memory_bound = False
    L = problem.model.num_layers
    for seq in stage_sequences(pools, max_stages):
        coeffs = stage_coefficients(problem, pools, seq, recompute)
        if coeffs is None:
            memory_bound = True
            continue
        if any(c.max_layers < L for c in coeffs):
            memory_bound = True
        splits += [Split(seq, tuple(coeffs), layers) for layers in layer_splits(problem, coeffs)]
    return splits, memory_bound


def pipeline_options(problem: Problem, pools: list[Pool], splits: list[Split],
                     holders: int) -> list[PipelineOption]:
    """Options for SCIP: the splits costed with a sync estimate for ``holders`` replicas,
    Pareto-filtered per GPU-count vector."""
    by_counts: dict[tuple[int, ...], list[PipelineOption]] = {}
    for sp in splits:
        counts = tuple(sp.sequence.count(k) for k in range(len(pools)))
        by_counts.setdefault(counts, []).append(
            option_for_split(problem, sp.sequence, list(sp.coeffs), sp.layers, holders))
    return [o for group in by_counts.values() for o in _pareto(group)]


@dataclass
class Config:
    """One outer choice: a TP degree per GPU type and the recompute mode, with its options."""

    pools: list[Pool]
    recompute: bool
    splits: list[Split]
    options: list[PipelineOption]
    memory_bound: bool
    lower_bound_s: float


def make_config(problem: Problem, tp_of_gpu: dict[str, int], recompute: bool,
                max_stages: int | None) -> Config | None:
    pools = make_pools(problem.cluster, tp_of_gpu)
    if pools is None:
        return None
    stages = max_stages or default_max_stages(problem, pools)
    splits, bound = candidate_splits(problem, pools, recompute, stages)
    options = pipeline_options(problem, pools, splits, MANY_REPLICAS)
    return Config(pools, recompute, splits, options, bound,
                  fluid_lower_bound_s(options, [p.count for p in pools], problem.num_microbatches))


def solve_config(problem: Problem, config: Config, time_limit_s: float) -> Candidate | None:
    """Compose, split micro-batches, place and cost.

    Two refinements of the surrogate (each pipeline's time plus its own sync/optimizer estimate):

    * the gradient sync of D replicas costs 2 (D-1)/D of a full all-reduce, far from its limit 2
      when D is small, so each small D gets its own solve with the exact factor and the
      constraint sum_j x_j = D; one more covers D > EXACT_REPLICAS with the factor of
      EXACT_REPLICAS + 1;
    * the real iteration adds the *largest* sync/optimizer time to the *longest* pipeline, so for
      each replica range a few thresholds e on that extra time are solved exactly: only
      options with extra <= e, each charged e (THRESHOLD_LEVELS levels below the first's).
    """
    best: Candidate | None = None
    groups = sum(p.count for p in config.pools)
    fewest = max(1, math.ceil(groups / max(len(o.pools) for o in config.options))) \
        if config.options else 1
    rounds = [(d, (d, d)) for d in range(fewest, EXACT_REPLICAS + 1)]
    rounds.append((EXACT_REPLICAS + 1, (max(fewest, EXACT_REPLICAS + 1), None)))

    def attempt(options: list[PipelineOption], count_range) -> Candidate | None:
        nonlocal best
        comp = solve_composition(options, [p.count for p in config.pools],
                                 problem.num_microbatches, time_limit_s, count_range)
        if comp is None:
            return None
        pipelines = [o for o, x in zip(options, comp.multiplicities) for _ in range(x)]
        counts = assign_microbatches(pipelines, problem.num_microbatches)
        plan = build_plan(problem, config.pools, pipelines, counts, config.recompute)
        cost = evaluate(problem, plan)
        if not cost.fits_memory:
            return None
        cand = Candidate(plan, cost, {p.gpu: p.tp for p in config.pools}, config.recompute)
        if best is None or cost.iteration_time_s < best.cost.iteration_time_s:
            best = cand
        return cand

    for holders, count_range in rounds:
        if count_range[0] > problem.num_microbatches:
            break
        options = pipeline_options(problem, config.pools, config.splits, holders)
        found = attempt(options, count_range)
        if found is None or found.cost.iteration_time_s > THRESHOLD_WITHIN * best.cost.iteration_time_s:
            continue
        top = found.cost.grad_sync_s + found.cost.optimizer_s
        levels = sorted({o.extra_s for o in options if o.extra_s < top}, reverse=True)
        if len(levels) > THRESHOLD_LEVELS:
            step = len(levels) / THRESHOLD_LEVELS
            levels = [levels[int(i * step)] for i in range(THRESHOLD_LEVELS)]
        for level in levels:
            capped = [dataclasses.replace(o, extra_s=level) for o in options if o.extra_s <= level]
            attempt(capped, count_range)
    return best


def make_plan(cluster: Cluster, model: ModelSpec, profile: Profile | None,
              global_batch_size: int, micro_batch_size: int, seq_length: int | None = None, *,
              allow_asymmetric_tp: bool = False, activation_recompute: bool | None = None,
              time_limit_s: float = 60.0, progress: bool = True,
              tp_degrees: list[int] | None = None, max_stages: int | None = None) -> Plan:
    """The fastest plan the search finds (see module doc), annotated with its predictions.

    ``profile`` None plans on analytic estimates; a given profile (measured or estimated) wins
    over the estimates where it has entries. ``activation_recompute`` None decides per plan.
    ``tp_degrees`` restricts the TP degrees searched; ``max_stages`` the pipeline depth.
    Raises ConfigError when the batch cannot be split or no plan fits in memory.
    """
    return search(cluster, model, profile, global_batch_size, micro_batch_size, seq_length,
                  allow_asymmetric_tp=allow_asymmetric_tp,
                  activation_recompute=activation_recompute, time_limit_s=time_limit_s,
                  progress=progress, tp_degrees=tp_degrees, max_stages=max_stages).plan


def search(cluster: Cluster, model: ModelSpec, profile: Profile | None, global_batch_size: int,
           micro_batch_size: int, seq_length: int | None = None, *,
           allow_asymmetric_tp: bool = False, activation_recompute: bool | None = None,
           time_limit_s: float = 60.0, progress: bool = True, tp_degrees: list[int] | None = None,
           max_stages: int | None = None) -> Candidate:
    """make_plan, returning the plan with its cost and the TP/recompute choice."""
    seq_length = seq_length or model.seq_length
    profile = resolve_profile(cluster, model, profile, micro_batch_size, seq_length)
    problem = Problem(cluster, model, profile, global_batch_size, micro_batch_size, seq_length)
    check_batch(problem)
    gpus = sorted({n.gpu for n in cluster.nodes}, key=lambda g: [n.gpu for n in cluster.nodes].index(g))
    max_node = max(n.num_gpus for n in cluster.nodes)
    degrees = [t for t in model.valid_tp_degrees(max_node)
               if tp_degrees is None or t in tp_degrees]
    recompute_modes = [False, True] if activation_recompute is None else [activation_recompute]
    deadline = time.monotonic() + time_limit_s
    best: Candidate | None = None
    solved: dict[tuple, Candidate | None] = {}

    def configs_for(tp_of_gpu: dict[str, int]) -> list[Config]:
        out = []
        for recompute in recompute_modes:
            config = make_config(problem, tp_of_gpu, recompute, max_stages)
            if config is None:
                break
            out.append(config)
            if activation_recompute is None and not config.memory_bound:
                break   # recompute only adds time when memory never limited a split
        return out

    def solve_all(configs: list[Config], bar) -> None:
        """Solve in order of lower bound; stop where the bound cannot beat the best plan."""
        nonlocal best
        for config in sorted(configs, key=lambda c: c.lower_bound_s):
            bar.update()
            key = (tuple((p.gpu, p.tp) for p in config.pools), config.recompute)
            if key in solved or time.monotonic() > deadline:
                continue
            if best is not None and config.lower_bound_s >= best.cost.iteration_time_s:
                solved[key] = None
                continue
            cand = solve_config(problem, config, max(1.0, deadline - time.monotonic()))
            solved[key] = cand
            if cand and (best is None or cand.cost.iteration_time_s < best.cost.iteration_time_s):
                best = cand

    with tqdm(desc="planning", unit="config", disable=not progress, delay=0.5,
              leave=False) as bar:
        solve_all([c for t in degrees for c in configs_for({g: t for g in gpus})], bar)
        if allow_asymmetric_tp:
            per_gpu = {g: [t for t in model.valid_tp_degrees(max_node)
                           if (tp_degrees is None or t in tp_degrees)
                           and all(n.num_gpus % t == 0 for n in cluster.nodes if n.gpu == g)]
                       for g in gpus}
            current = dict(best.tp_of_gpu) if best else {g: per_gpu[g][0] for g in gpus}
            improved = True
            while improved and time.monotonic() < deadline:
                improved, before = False, best
                for g in gpus:
                    trials = [dict(current, **{g: t}) for t in per_gpu[g] if t != current[g]]
                    solve_all([c for trial in trials for c in configs_for(trial)], bar)
                    if best is not before and best is not None:
                        current, improved, before = dict(best.tp_of_gpu), True, best
    if best is None:
        raise ConfigError(cluster.name, "nodes", f"no plan for {model.name} fits in memory with "
                          f"global batch {global_batch_size} and micro-batch {micro_batch_size} "
                          f"(TP degrees tried: {degrees}, recompute: {recompute_modes})",
                          "more or larger GPUs, activation recompute, a smaller micro-batch or "
                          "sequence length, or a global batch with a micro-batch per pipeline")
    return best
