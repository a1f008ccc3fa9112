"""Brute-force search of the plan space, for small clusters: the yardstick for make_plan.

Independent of the planner on purpose: it shares only the cost model (cost_model.evaluate_plan)
and the plan dataclasses, so a weakness of the planner's option generation, estimates, SCIP model
or placement shows up as a gap. For every TP degree (per GPU type with ``allow_asymmetric_tp``)
and recompute mode it enumerates:

* **grouping**: every node of n GPUs gives ``n // t`` TP groups of consecutive local ranks (GPUs
  of a node are interchangeable, so which GPUs form a group does not matter to the cost model);
* **mapping**: every way to arrange the TP groups into pipelines: each group is idle or one stage
  of one pipeline, a pipeline is an ordered list of at most ``max_stages`` groups in any order of
  GPU types and nodes, at most one pipeline per micro-batch. Arrangements that differ only by
  swapping two groups of the same node are the same plan to the cost model and are costed once;
* **layer split**: every split of the model's layers over each pipeline's stages (>= 1 each);
* **micro-batch split**: the split minimising the longest pipeline, computed exactly: the
  gradient sync and optimizer terms do not depend on it, and pipeline p finishes m micro-batches
  at ``fill_p + (m - 1) period_p`` (cost_model.pipeline_time_s), so the smallest feasible
  makespan is one of those values and is found by trying them in order. When that split does
  not fit in memory, the split within each pipeline's most micro-batches: a pipeline running
  m < S of them keeps fewer in flight on its first stages (1F1B), so fewer may fit.

Every candidate is costed by the full cost model and kept only if it fits in memory, so the
result is the optimum of the cost model over this space (plans that leave GPUs idle included).
The work explodes quickly; ``max_evaluations`` guards against runaway cases.
"""

from __future__ import annotations

import itertools
import math

from megatron_autohet.cost_model import (DEFAULT_CHARGE, DEFAULT_MEMORY_HEADROOM, annotate_plan,
                                         evaluate_plan)
from megatron_autohet.errors import ConfigError
from megatron_autohet.plan import DEFAULT_OBJECTIVE, Pipeline, Plan, RankInfo, Stage
from megatron_autohet.planner.candidate import Candidate
from megatron_autohet.planner.cost_search import check_prices
from megatron_autohet.planner.objective import objective_named
from megatron_autohet.planner.search import with_left_out
from megatron_autohet.planner.space import resolve_profile, trainable_for
from megatron_autohet.planner.warmup import choose_warmups
from megatron_autohet.profiling.profile import Profile
from megatron_autohet.spec.cluster import Cluster, Device
from megatron_autohet.spec.model import ModelSpec


def _tp_groups(cluster: Cluster, tp_of_gpu: dict[str, int]) -> list[tuple[Device, ...]]:
    devices = cluster.devices()
    groups = []
    for node in cluster.nodes:
        tp = tp_of_gpu[node.gpu]
        mine = [d for d in devices if d.node == node.name]
        groups += [tuple(mine[g * tp:(g + 1) * tp]) for g in range(node.num_gpus // tp)]
    return groups


def _arrangements(n: int, max_stages: int, max_pipelines: int):
    """Every set of disjoint non-empty ordered lists of group indices 0..n-1 (the rest idle)."""
    def extend(i: int, pipelines: list[list[int]]):
        if i == n:
            if pipelines:
                yield [tuple(p) for p in pipelines]
            return
        yield from extend(i + 1, pipelines)                      # group i idle
        for p in pipelines:                                      # group i joins a pipeline
            if len(p) < max_stages:
                for pos in range(len(p) + 1):
                    p.insert(pos, i)
                    yield from extend(i + 1, pipelines)
                    p.pop(pos)
        if len(pipelines) < max_pipelines:                       # group i starts a pipeline
            pipelines.append([i])
            yield from extend(i + 1, pipelines)
            pipelines.pop()
    yield from extend(0, [])


def _layer_splits(num_layers: int, stages: int):
    for cuts in itertools.combinations(range(1, num_layers), stages - 1):
        bounds = (0,) + cuts + (num_layers,)
        yield tuple(bounds[i + 1] - bounds[i] for i in range(stages))


def _plan(cluster: Cluster, model: ModelSpec, groups, arrangement, splits, microbatches,
          global_batch_size, micro_batch_size, seq_length, recompute) -> Plan:
    used = sorted((d for pipe in arrangement for g in pipe for d in groups[g]),
                  key=lambda d: d.rank)
    rank_of = {d.rank: i for i, d in enumerate(used)}
    pipelines = []
    for pipe, layers, m in zip(arrangement, splits, microbatches):
        stages, start = [], 0
        for g, n in zip(pipe, layers):
            stages.append(Stage(ranks=[rank_of[d.rank] for d in groups[g]],
                                layers=(start, start + n)))
            start += n
        pipelines.append(Pipeline(stages=stages, num_microbatches=m))
    return Plan(cluster=cluster.name, model=model, micro_batch_size=micro_batch_size,
                global_batch_size=global_batch_size, seq_length=seq_length,
                ranks=[RankInfo(i, d.node, d.local_rank, d.gpu) for i, d in enumerate(used)],
                pipelines=pipelines, activation_recompute=recompute)


def best_microbatch_split(fills: list[float], periods: list[float], total: int,
                          most: list[int] | None = None) -> list[int] | None:
    """Micro-batches per pipeline (each 1 <= m_p <= most[p]) minimising
    max_p fill_p + (m_p - 1) period_p; None when the caps cannot take the batch."""
    most = most or [total] * len(fills)
    if sum(min(total, c) for c in most) < total:
        return None
    candidates = sorted({f + k * p for f, p in zip(fills, periods) for k in range(total)})
    for limit in candidates:
        if limit < max(fills):
            continue
        caps = [min(total, c, int((limit - f) / p + 1e-9) + 1)
                for f, p, c in zip(fills, periods, most)]
        if sum(caps) >= total:
            excess = sum(caps) - total
            for i in range(len(caps)):      # fewer micro-batches never lengthen a pipeline
                cut = min(excess, caps[i] - 1)
                caps[i] -= cut
                excess -= cut
            return caps
    raise AssertionError("unreachable: the largest candidate admits every micro-batch")


def _most_microbatches(cluster, model, profile, groups, arrangement, splits, args,
                       memory_headroom) -> list[int]:
    """Per pipeline, the most micro-batches it may run within memory: a pipeline of S stages
    that fits running S of them fits running any number (1F1B keeps at most S in flight)."""
    deepest = max(len(p) for p in arrangement)
    most = [0] * len(arrangement)
    for k in range(1, deepest + 1):
        probe = _plan(cluster, model, groups, arrangement, splits, [k] * len(arrangement), *args)
        probe.global_batch_size = probe.micro_batch_size * k * len(arrangement)
        cost = evaluate_plan(probe, cluster, profile, with_timeline=False,
                             memory_headroom=memory_headroom)
        for p, pipe in enumerate(cost.pipelines):
            if most[p] == k - 1 and all(s.fits for s in pipe.stages):
                most[p] = k if k < len(arrangement[p]) else args[0] // args[1]
    return most


def exhaustive_optimum(cluster: Cluster, model: ModelSpec, profile: Profile | None,
                       global_batch_size: int, micro_batch_size: int,
                       seq_length: int | None = None, *, tp_degrees: list[int] | None = None,
                       max_stages: int = 4, activation_recompute: bool | None = None,
                       allow_asymmetric_tp: bool = False,
                       max_evaluations: int = 200_000,
                       memory_headroom: float = DEFAULT_MEMORY_HEADROOM,
                       objective: str = DEFAULT_OBJECTIVE, charge: str = DEFAULT_CHARGE,
                       min_tokens_per_s: float | None = None) -> tuple[Candidate, Candidate]:
    """The cost model's optimum over the space in the module doc (ConfigError when too big),
    before and after the HAPT warm-up pass the planner gives its best plan (planner/warmup.py):
    the best score of ``objective`` (planner/objective.py: the shortest iteration, or with
    "cost" the fewest USD per million tokens, charged by ``charge``, among the plans reaching
    ``min_tokens_per_s``; the micro-batch split that minimises the iteration time minimises the
    price too: the arrangement fixes the GPUs paid for)."""
    goal = objective_named(objective).from_arguments(min_tokens_per_s)
    # the GPUs the planner may use (search.search decides so: no V100 or T4 in a bf16 plan)
    cluster, left_out = trainable_for(cluster, profile)
    if goal.priced:
        check_prices(cluster)

    def score(cost) -> float:
        return goal.score(cost) if goal.meets(cost) else math.inf

    seq_length = seq_length or model.seq_length
    if global_batch_size % micro_batch_size:
        raise ConfigError("<arguments>", "global_batch_size", f"{global_batch_size} is not a "
                          f"multiple of micro_batch_size {micro_batch_size}",
                          "a multiple of the micro-batch size")
    profile = resolve_profile(cluster, model, profile, micro_batch_size, seq_length)
    M, L = global_batch_size // micro_batch_size, model.num_layers
    gpus = list(dict.fromkeys(n.gpu for n in cluster.nodes))
    degrees = [t for t in model.valid_tp_degrees(max(n.num_gpus for n in cluster.nodes))
               if tp_degrees is None or t in tp_degrees]
    if allow_asymmetric_tp:
        tp_maps = [dict(zip(gpus, combo)) for combo in itertools.product(degrees, repeat=len(gpus))]
    else:
        tp_maps = [{g: t for g in gpus} for t in degrees]
    modes = [False, True] if activation_recompute is None else [activation_recompute]
    best: Candidate | None = None
    evaluations = 0
    for tp_of_gpu in tp_maps:
        groups = _tp_groups(cluster, tp_of_gpu)
        if not groups:
            continue
        seen: set = set()
        for arrangement in _arrangements(len(groups), max_stages, M):
            # Groups of one node are interchangeable: the nodes along each pipeline identify
            # the plan up to rank numbering, which the cost model does not see.
            key = tuple(sorted(tuple(groups[g][0].node for g in p) for p in arrangement))
            if key in seen:
                continue
            seen.add(key)
            if any(len(p) > L for p in arrangement):
                continue
            for recompute in modes:
                for splits in itertools.product(*(_layer_splits(L, len(p)) for p in arrangement)):
                    evaluations += 1
                    if evaluations > max_evaluations:
                        raise ConfigError(cluster.name, "nodes", f"exhaustive search exceeds "
                                          f"{max_evaluations} plans", "a smaller cluster, fewer "
                                          "layers, fewer TP degrees or stages")
                    # Stage periods from a costing with one micro-batch per pipeline.
                    args = (global_batch_size, micro_batch_size, seq_length, recompute)
                    probe = _plan(cluster, model, groups, arrangement, splits,
                                  [1] * len(arrangement), *args)
                    probe.global_batch_size = micro_batch_size * len(arrangement)
                    cost = evaluate_plan(probe, cluster, profile, with_timeline=False,
                                         memory_headroom=memory_headroom)
                    fills = [sum(s.time_s + s.p2p_s for s in p.stages) for p in cost.pipelines]
                    periods = [max(s.time_s + s.p2p_s for s in p.stages) for p in cost.pipelines]
                    counts = best_microbatch_split(fills, periods, M)
                    plan = _plan(cluster, model, groups, arrangement, splits, counts, *args)
                    cost = evaluate_plan(plan, cluster, profile, with_timeline=False,
                                         memory_headroom=memory_headroom, charge=charge)
                    if not cost.fits_memory:
                        # A pipeline running m < S micro-batches keeps fewer in flight: the
                        # best split within what each pipeline's memory allows.
                        most = _most_microbatches(cluster, model, profile, groups, arrangement,
                                                  splits, args, memory_headroom)
                        counts = best_microbatch_split(fills, periods, M, most)
                        if counts is None:
                            continue
                        plan = _plan(cluster, model, groups, arrangement, splits, counts, *args)
                        cost = evaluate_plan(plan, cluster, profile, with_timeline=False,
                                             memory_headroom=memory_headroom, charge=charge)
                        if not cost.fits_memory:
                            continue
                    if best is None or score(cost) < score(best.cost):
                        plan.validate()
                        annotate_plan(plan, cost)
                        best = Candidate(plan, cost, dict(tp_of_gpu), recompute)
    if best is None:
        raise ConfigError(cluster.name, "nodes", f"no plan for {model.name} fits in memory",
                          "more or larger GPUs, activation recompute, a smaller micro-batch")
    if score(best.cost) == math.inf:
        raise ConfigError("<arguments>", "min_tokens_per_s", "no plan reaches it")
    plan, cost = choose_warmups(best.plan, best.cost, cluster, profile,   # the same post-pass
                                memory_headroom, max_stages, goal.rank)
    after = Candidate(plan, cost, best.tp_of_gpu, best.recompute)
    if left_out:
        for cand in (best, after):
            cand.cost = with_left_out(cand.cost, left_out)
            annotate_plan(cand.plan, cand.cost)
    return best, after


def exhaustive_search(*args, **kwargs) -> Candidate:
    """:func:`exhaustive_optimum` after the warm-up pass: what the planner's result is held to."""
    return exhaustive_optimum(*args, **kwargs)[1]
