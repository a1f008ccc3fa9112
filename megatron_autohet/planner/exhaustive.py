"""Brute-force search of the plan space, for small clusters: the yardstick for make_plan.

It enumerates, for every TP degree (per GPU type with ``allow_asymmetric_tp``) and recompute
mode: every multiset of pipelines, where a pipeline is *any* sequence of TP groups of at most
``max_stages`` stages (a superset of the planner's contiguous-type shapes), that uses every TP
group exactly once; for each, every layer split of every pipeline (each stage >= 1 layer, within
memory); then the optimal micro-batch split (exact: the sync and optimizer terms do not depend on
it), the planner's placement, and the full cost model. Nothing is estimated or pruned except
splits that cannot fit in memory, so the result is the optimum of the cost model over that space.
The work explodes quickly; ``max_evaluations`` guards against runaway cases.
"""

from __future__ import annotations

import itertools

from megatron_autohet.errors import ConfigError
from megatron_autohet.planner.search import Candidate, resolve_profile
from megatron_autohet.planner.space import (PipelineOption, Problem, assign_microbatches,
                                            build_plan, check_batch, evaluate, make_pools,
                                            stage_coefficients)
from megatron_autohet.profiling.profile import Profile
from megatron_autohet.spec.cluster import Cluster
from megatron_autohet.spec.model import ModelSpec


def _multisets(sequences: list[tuple[int, ...]], remaining: list[int], start: int, limit: int):
    """Multisets (non-decreasing index lists) of sequences that use exactly ``remaining``."""
    if not any(remaining):
        yield []
        return
    if limit == 0:
        return
    for i in range(start, len(sequences)):
        seq = sequences[i]
        need = [seq.count(k) for k in range(len(remaining))]
        if all(n <= r for n, r in zip(need, remaining)):
            rest = [r - n for r, n in zip(remaining, need)]
            for tail in _multisets(sequences, rest, i, limit - 1):
                yield [i] + tail


def _compositions(total: int, parts: int, caps: list[int]):
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0,) + cuts + (total,)
        layers = tuple(bounds[i + 1] - bounds[i] for i in range(parts))
        if all(n <= c for n, c in zip(layers, caps)):
            yield layers


def exhaustive_search(cluster: Cluster, model: ModelSpec, profile: Profile | None,
                      global_batch_size: int, micro_batch_size: int,
                      seq_length: int | None = None, *, tp_degrees: list[int] | None = None,
                      max_stages: int = 4, activation_recompute: bool | None = None,
                      allow_asymmetric_tp: bool = False,
                      max_evaluations: int = 200_000) -> Candidate:
    seq_length = seq_length or model.seq_length
    profile = resolve_profile(cluster, model, profile, micro_batch_size, seq_length)
    problem = Problem(cluster, model, profile, global_batch_size, micro_batch_size, seq_length)
    check_batch(problem)
    M, L = problem.num_microbatches, model.num_layers
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
        pools = make_pools(cluster, tp_of_gpu)
        if pools is None:
            continue
        counts = [p.count for p in pools]
        sequences = [seq for S in range(1, max_stages + 1)
                     for seq in itertools.product(range(len(pools)), repeat=S)
                     if all(seq.count(k) <= counts[k] for k in range(len(pools)))]
        for recompute in modes:
            splits: dict[int, list[PipelineOption]] = {}
            for i, seq in enumerate(sequences):
                coeffs = stage_coefficients(problem, pools, seq, recompute)
                splits[i] = [] if coeffs is None else [
                    PipelineOption(seq, layers, 0.0, 0.0, 0.0)
                    for layers in _compositions(L, len(seq), [c.max_layers for c in coeffs])]
            for chosen in _multisets(sequences, counts, 0, M):
                for combo in itertools.product(*(splits[i] for i in chosen)):
                    evaluations += 1
                    if evaluations > max_evaluations:
                        raise ConfigError(cluster.name, "nodes", f"exhaustive search exceeds "
                                          f"{max_evaluations} plans", "a smaller cluster, fewer "
                                          "layers, fewer TP degrees or stages")
                    cand = _evaluate(problem, pools, list(combo), recompute, tp_of_gpu)
                    if cand and (best is None or cand.cost.iteration_time_s
                                 < best.cost.iteration_time_s):
                        best = cand
    if best is None:
        raise ConfigError(cluster.name, "nodes", f"no plan for {model.name} fits in memory",
                          "more or larger GPUs, activation recompute, a smaller micro-batch")
    return best


def _evaluate(problem: Problem, pools, options: list[PipelineOption], recompute: bool,
              tp_of_gpu: dict[str, int]) -> Candidate | None:
    # Pipeline times for the micro-batch split come from a first costing of the plan.
    plan = build_plan(problem, pools, options, [1] * len(options), recompute)
    plan.global_batch_size = problem.micro_batch_size * len(options)
    cost = evaluate(problem, plan)
    timed = [PipelineOption(o.pools, o.layers, sum(s.time_s + s.p2p_s for s in p.stages),
                            max(s.time_s + s.p2p_s for s in p.stages), 0.0)
             for o, p in zip(options, cost.pipelines)]
    counts = assign_microbatches(timed, problem.num_microbatches)
    plan = build_plan(problem, pools, options, counts, recompute)
    cost = evaluate(problem, plan)
    if not cost.fits_memory:
        return None
    return Candidate(plan, cost, dict(tp_of_gpu), recompute)
