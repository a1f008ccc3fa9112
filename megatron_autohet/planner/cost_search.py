"""The cost search (:func:`cheapest`, objective ``cost``): the cheapest plan that still trains
fast enough.

A job trains T tokens by a deadline of H hours (a floor of ``T / (3600 H)`` tokens/s) or at a
throughput floor ``min_tokens_per_s``; among the plans that reach the floor, the one with the
fewest USD per million tokens wins (cost_model.py, "Price"). Without a floor the cheapest plan
is degenerate: a couple of GPUs training for months (on the bundled a100-h800-h20 fleet it
trained GPT-3 6.7B on 3 of its 24 GPUs, 3.5x slower than the fastest plan), so ``autohet plan
--objective cost`` insists on one; the API reads ``min_tokens_per_s=None`` as no floor.

Per-node charging (the default): a plan pays every GPU of every node it uses, so on a given set
of nodes the fastest plan is also the cheapest. :func:`cheapest` therefore searches node sets:
nodes of one kind (GPU type, size, links, price) are interchangeable, so a set is a count per
kind (every count up to ALL_NODE_COUNTS, a geometric grid above). A set's price per token is at
least its rate over an upper bound on its throughput, the fluid bound (options.py
:func:`~megatron_autohet.planner.options.fluid_bound_s`: layer passes per second, additive over
nodes, each kind at its best TP degree and recompute mode, the embedding and output layer at
their cheapest). Sets run the throughput search (throughput_search.py :func:`fastest_before`,
sub-fleets off: smaller sets are sets of their own here) in order of that bound, smallest fleet
first among equals, skipping sets whose throughput bound is below the floor, until the next
bound cannot beat the cheapest plan found that reaches the floor. Where the throughput search is
exact, so is this: the cheapest plan runs on some set U, and the fastest plan on U is at least
as fast at no higher rate. The bound is the same for every multiple of a set and loose for large
ones (pipeline bubbles and gradient sync are not in it: on 512 GPUs of four types with GPT-3
1.3B the sets searched reached 0.94 of it on one node, 0.56-0.6 on 16-19 nodes), so proving the
cheapest plan can take many searches: at most ``max_searches`` (default MAX_NODE_SETS) are
searched, a deterministic budget (``stopped_by`` says when it binds).

Per-GPU charging (``charge="per-gpu"``, fleets that rent single GPUs): idle GPUs of a used node
cost nothing, so fewer pipelines can be cheaper on the same nodes. The throughput search runs
once per non-empty set of GPU types (the other types' nodes left out) and TP degree (the fastest
degree is often not the cheapest: wider TP buys speed with GPUs), every plan it judges that
reaches the floor is priced, and each run's cheapest is thinned: first to its n fastest
pipelines for the best n (every n up to THIN_ALL_COUNTS pipelines, else a geometric grid; the
price per token is not monotone in n, uneven micro-batch shares make it jump), then greedily
while dropping one pipeline (one of each shape is tried) lowers the price and keeps the floor;
the cheapest thinned plan wins. ``max_searches`` bounds the runs (the larger sets of types first;
default: every one). A heuristic over the throughput search's plans, checked against
the exhaustive search on small fleets (tests).

Either way the whole fleet's fastest plan is the fallback: when no set reached the floor (the
budget or the safety net cut the enumeration, the bound being loose) it is the result if it
reaches the floor, else the floor is out of reach and :class:`FloorNotMet` says how fast the
fleet can go.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from collections.abc import Callable, Sequence

import numpy as np

from megatron_autohet.cost_model import (DEFAULT_CHARGE, DEFAULT_MEMORY_HEADROOM, PlanCost,
                                         check_charge, stage_compute_s, stage_memory_bytes)
from megatron_autohet.errors import ConfigError
from megatron_autohet.plan import Pipeline, RankInfo, Stage
from megatron_autohet.planner import candidate
from megatron_autohet.planner.candidate import (STOP_COMPLETE, STOP_SETS, STOP_TIME, STOP_WORK,
                                                Candidate)
from megatron_autohet.planner.space import Problem, evaluate, make_pools, resolve_profile
from megatron_autohet.planner.throughput_search import fastest_before, no_plan_fits
from megatron_autohet.planner.warmup import choose_warmups
from megatron_autohet.profiling.profile import Profile
from megatron_autohet.spec.cluster import Cluster
from megatron_autohet.spec.model import ModelSpec

# Node counts per kind tried one by one; above, a grid NODE_COUNT_RATIO apart (and the count).
ALL_NODE_COUNTS = 8
NODE_COUNT_RATIO = 1.25
# Node sets searched at most (each a throughput search): the default deterministic budget of the
# per-node enumeration (Candidate.stopped_by is STOP_SETS when it binds).
MAX_NODE_SETS = 24
# Rounds of the per-GPU pipeline thinning (module doc), each one pipeline dropped.
MAX_DROP_ROUNDS = 32
# Plans of up to this many pipelines try every pipeline count when thinned (module doc).
THIN_ALL_COUNTS = 16


def check_prices(cluster: Cluster, file=None, needed_by: str = "--objective cost") -> None:
    """Every node has a spot price (the cost objective prices every plan); ``file`` names the
    cluster file in the error (default: the cluster's name), ``needed_by`` what needs them."""
    for i, node in enumerate(cluster.nodes):
        if node.spot_price is None:
            raise ConfigError(file or cluster.name, f"nodes[{i}].spot_price",
                              f"node {node.name} has no price; {needed_by} needs one on every node",
                              "USD per GPU-hour, a number >= 0")


class FloorNotMet(ConfigError):
    """No plan reaches the throughput floor; ``fastest_tokens_per_s`` is the whole fleet's
    fastest plan's (what the caller can offer as the most the floor may ask)."""

    def __init__(self, floor: float, fastest_tokens_per_s: float):
        self.fastest_tokens_per_s = fastest_tokens_per_s
        super().__init__("<arguments>", "min_tokens_per_s", f"{floor:,.0f} tokens/s is more "
                         f"than the fastest plan found reaches ({fastest_tokens_per_s:,.0f})",
                         f"a floor up to {fastest_tokens_per_s:,.0f} tokens/s, or more GPUs")


def usd_per_million_tokens(cand: Candidate) -> float:
    return cand.cost.usd_per_million_tokens


def cheapest(cluster: Cluster, model: ModelSpec, profile: Profile | None,
             global_batch_size: int, micro_batch_size: int, seq_length: int | None = None, *,
             on_candidate: Callable[[Candidate], None] | None = None, deadline: float,
             tp_degrees: list[int] | None = None, seeds: Sequence[Candidate] = (),
             min_tokens_per_s: float | None = None, charge: str = DEFAULT_CHARGE,
             max_searches: int | None = None, sub_fleets: bool = True,
             rank: Callable[[PlanCost], tuple[float, ...]], **options) -> Candidate:
    """The cost objective's search (module doc; objective.Cost): the plan with the fewest USD per
    million tokens among those reaching ``min_tokens_per_s`` (None: no floor), charged by
    ``charge``, running at most ``max_searches`` throughput searches (None: MAX_NODE_SETS per
    node, every set of GPU types and TP degree per GPU); ``sub_fleets`` is the whole-fleet
    fallback's (fastest_before), ``rank`` the warm-up pass's (objective.Cost.rank). Raises
    :class:`FloorNotMet` when no plan reaches the floor."""
    check_prices(cluster)
    check_charge(charge, "charge")
    floor = min_tokens_per_s or 0.0
    seq_length = seq_length or model.seq_length
    resolved = resolve_profile(cluster, model, profile, micro_batch_size, seq_length)
    problem = Problem(cluster, model, resolved, global_batch_size, micro_batch_size, seq_length,
                      distributed_optimizer=options.get("distributed_optimizer", False),
                      memory_headroom=options.get("memory_headroom", DEFAULT_MEMORY_HEADROOM),
                      charge=charge)
    degrees = [t for t in model.valid_tp_degrees(max(n.num_gpus for n in cluster.nodes))
               if tp_degrees is None or t in tp_degrees]
    if charge == "per-node":
        best, stops, work = _per_node(problem, degrees, floor, deadline, seeds, options,
                                      max_searches or MAX_NODE_SETS)
    else:
        best, stops, work = _per_gpu(problem, degrees, floor, deadline, seeds, options,
                                     max_searches)
    if best is None:
        # The whole fleet's fastest plan: the result if it reaches the floor (the enumeration
        # was cut), else the proof that nothing does.
        try:
            fastest = fastest_before(cluster, model, resolved, global_batch_size,
                                     micro_batch_size, seq_length, deadline, seeds=seeds,
                                     tp_degrees=degrees, charge=charge, sub_fleets=sub_fleets,
                                     **options)
        except ConfigError:
            raise no_plan_fits(problem, degrees, [False, True] if options.get(
                "activation_recompute") is None else [options["activation_recompute"]])
        stops.append(fastest.stopped_by)
        work += fastest.work
        if fastest.cost.tokens_per_s < floor:
            raise FloorNotMet(floor, fastest.cost.tokens_per_s)
        best = fastest
    if on_candidate is not None:
        on_candidate(best)
    plan, cost = choose_warmups(best.plan, best.cost, cluster, problem.profile,
                                problem.memory_headroom, options.get("max_stages"), rank)
    stopped = next((s for s in (STOP_TIME, STOP_SETS, STOP_WORK) if s in stops), STOP_COMPLETE)
    return dataclasses.replace(best, plan=plan, cost=cost, stopped_by=stopped, work=work)


# ---- per-node charging ---------------------------------------------------------------------------

def _node_kinds(cluster: Cluster) -> list[list[str]]:
    """Node names by kind (GPU type, size, links, price), kinds in file order."""
    kinds: dict[tuple, list[str]] = {}
    for n in cluster.nodes:
        kinds.setdefault((n.gpu, n.num_gpus, n.intra_node_bandwidth_gbs,
                          n.inter_node_bandwidth_gbs, n.spot_price), []).append(n.name)
    return list(kinds.values())


def _count_grid(n: int) -> list[int]:
    """Node counts of one kind tried: all up to ALL_NODE_COUNTS, then a geometric grid, and n."""
    counts = set(range(min(n, ALL_NODE_COUNTS) + 1)) | {n}
    c = float(ALL_NODE_COUNTS)
    while c < n:
        counts.add(int(round(c)))
        c *= NODE_COUNT_RATIO
    return sorted(counts)


def _node_rates(problem: Problem, node: str, degrees: list[int], recompute_modes: list[bool]
                ) -> tuple[float, float, float]:
    """(layer passes per second of one node of this kind at its best TP degree and recompute
    mode, the cheapest embedding and output layer in layer passes of the same config): the
    per-node terms of options.fluid_bound_s."""
    cluster = problem.cluster.subset([node])
    best, embed, output = 0.0, math.inf, math.inf
    for tp in degrees:
        for pool in make_pools(cluster, {cluster.nodes[0].gpu: tp}):
            entry = problem.entry(pool)
            for recompute in recompute_modes:
                if stage_memory_bytes(entry, problem.model, 1, False, False, recompute, 1,
                                      problem.profile.precision) > problem.memory_limit_bytes(pool):
                    continue
                per_layer = sum(stage_compute_s(entry, 1, False, False, recompute))
                best = max(best, pool.count / per_layer)
                embed = min(embed, sum(stage_compute_s(entry, 0, True, False, recompute))
                            / per_layer)
                output = min(output, sum(stage_compute_s(entry, 0, False, True, recompute))
                             / per_layer)
    return best, embed, output


def _per_node(problem: Problem, degrees: list[int], floor: float, deadline: float,
              seeds: Sequence[Candidate], options: dict, max_sets: int):
    """The node-set enumeration (module doc), at most ``max_sets`` sets: (best candidate or
    None, stops, work)."""
    cluster, model = problem.cluster, problem.model
    kinds = _node_kinds(cluster)
    modes = ([False, True] if options.get("activation_recompute") is None
             else [options["activation_recompute"]])
    terms = [_node_rates(problem, names[0], degrees, modes) for names in kinds]
    rate = np.array([t[0] for t in terms])
    extra = min(t[1] for t in terms) + min(t[2] for t in terms)
    price = np.array([cluster.node(names[0]).spot_price * cluster.node(names[0]).num_gpus
                      for names in kinds])
    gpus = np.array([cluster.node(names[0]).num_gpus for names in kinds])
    grid = np.array(list(itertools.product(*(_count_grid(len(names)) for names in kinds))))
    grid = grid[grid.sum(axis=1) > 0]
    tokens = problem.global_batch_size * problem.seq_length
    # The fluid bound's makespan M (L + e + o) / sum c_k r_k, with e, o the fleet's cheapest.
    max_tps = tokens * (grid @ rate) / (problem.num_microbatches * (model.num_layers + extra))
    with np.errstate(divide="ignore"):
        bound = np.where(max_tps > 0, (grid @ price) / 3600 / max_tps * 1e6, np.inf)
    keep = (max_tps >= floor) & np.isfinite(bound)
    order = np.lexsort((grid @ gpus, bound))
    best: Candidate | None = None
    stops, work, searched = [], 0, 0
    for i in order:
        if not keep[i]:
            continue
        if best is not None and bound[i] >= usd_per_million_tokens(best):
            break
        if searched == max_sets:
            stops.append(STOP_SETS)
            break
        if candidate.clock() >= deadline:
            stops.append(STOP_TIME)
            break
        searched += 1
        names = [n for names, c in zip(kinds, grid[i]) for n in names[:c]]
        sub = cluster.subset(names)
        mine = [c for c in seeds if {r.node for r in c.plan.ranks} <= set(names)]
        try:
            found = fastest_before(sub, model, problem.profile, problem.global_batch_size,
                                   problem.micro_batch_size, problem.seq_length, deadline,
                                   tp_degrees=degrees, seeds=mine, sub_fleets=False,
                                   charge=problem.charge, **options)
        except ConfigError:
            continue            # nothing fits on these nodes
        stops.append(found.stopped_by)
        work += found.work
        if found.cost.tokens_per_s < floor:
            continue
        # Judged on the node set: re-costed on the whole fleet (its idle GPUs).
        found = dataclasses.replace(found, cost=evaluate(problem, found.plan))
        if best is None or usd_per_million_tokens(found) < usd_per_million_tokens(best):
            best = found
    return best, stops, work


# ---- per-GPU charging ----------------------------------------------------------------------------

def _per_gpu(problem: Problem, degrees: list[int], floor: float, deadline: float,
             seeds: Sequence[Candidate], options: dict, max_runs: int | None):
    """One throughput search per set of GPU types and TP degree, thinned (module doc), at most
    ``max_runs`` of them (None: every one)."""
    cluster, model = problem.cluster, problem.model
    gpus = list(dict.fromkeys(n.gpu for n in cluster.nodes))
    # With asymmetric TP the search mixes degrees itself: one search over all of them.
    per_search = [degrees] if options.get("allow_asymmetric_tp") else [[t] for t in degrees]
    winners: list[Candidate] = []
    stops, work = [], 0
    runs = [(kept, tps) for size in range(len(gpus), 0, -1)
            for kept, tps in itertools.product(itertools.combinations(gpus, size), per_search)]
    if max_runs is not None and len(runs) > max_runs:
        runs = runs[:max_runs]
        stops.append(STOP_SETS)
    for kept, tps in runs:
        sub = cluster.subset([n.name for n in cluster.nodes if n.gpu in kept])
        judged: list[Candidate] = []
        # Seeds are incumbents of the run whose GPUs they all use.
        runs_on = {n.name for n in sub.nodes}
        mine = [c for c in seeds if {r.node for r in c.plan.ranks} <= runs_on
                and set(c.tp_of_gpu.values()) <= set(tps)]
        try:
            best = fastest_before(sub, model, problem.profile, problem.global_batch_size,
                                  problem.micro_batch_size, problem.seq_length, deadline,
                                  on_candidate=judged.append, tp_degrees=tps, seeds=mine,
                                  sub_fleets=False, charge=problem.charge, **options)
        except ConfigError:
            continue            # no plan of these GPU types and degrees fits in memory
        judged.append(best)
        stops.append(best.stopped_by)
        work += best.work
        judged = [c for c in judged if c.cost.tokens_per_s >= floor]
        if not judged:
            continue
        # Judged on the sub-cluster: re-costed on the whole fleet (idle GPUs), then thinned.
        cheap = min(judged, key=usd_per_million_tokens)
        winners.append(_thin(problem, dataclasses.replace(
            cheap, cost=evaluate(problem, cheap.plan)), floor))
    return min(winners, key=usd_per_million_tokens, default=None), stops, work


def _thin(problem: Problem, cand: Candidate, floor: float) -> Candidate:
    """Fewer pipelines while that lowers USD per million tokens and keeps the floor (module
    doc): the n fastest for the best n, then rounds that each try dropping the last pipeline of
    each shape (GPU types and layers per stage)."""
    def ok(c: Candidate) -> bool:
        return c.cost.fits_memory and c.cost.tokens_per_s >= floor

    D = len(cand.plan.pipelines)
    periods = [max(s.time_s + s.p2p_s for s in p.stages) for p in cand.cost.pipelines]
    by_speed = sorted(range(D), key=lambda p: (periods[p], p))
    counts = (range(1, D) if D <= THIN_ALL_COUNTS
              else sorted({max(1, int(D / 1.25 ** k)) for k in range(1, 64)} - {D}))
    fewer = [_without_pipelines(problem, cand, set(by_speed[n:])) for n in counts]
    cand = min([cand] + [f for f in fewer if ok(f)], key=usd_per_million_tokens)
    for _ in range(MAX_DROP_ROUNDS):
        plan = cand.plan
        if len(plan.pipelines) < 2:
            break
        shapes = {}
        for p, pipe in enumerate(plan.pipelines):
            shapes[tuple((plan.ranks[s.ranks[0]].gpu, s.tp, s.layers) for s in pipe.stages)] = p
        tries = [_without_pipelines(problem, cand, {p}) for p in sorted(shapes.values())]
        better = min([t for t in tries if ok(t)], key=usd_per_million_tokens, default=None)
        if better is None or not (usd_per_million_tokens(better) < usd_per_million_tokens(cand)):
            break
        cand = better
    return cand


def _without_pipelines(problem: Problem, cand: Candidate, drop: set[int]) -> Candidate:
    """The plan without the pipelines ``drop``: ranks renumbered in cluster order, micro-batches
    re-split over the others (greedy on each pipeline's fill and period, as
    space.assign_microbatches)."""
    plan, cost = cand.plan, cand.cost
    keep = [p for p in range(len(plan.pipelines)) if p not in drop]
    used = sorted(r for p in keep for r in plan.pipelines[p].ranks)
    new_rank = {r: i for i, r in enumerate(used)}
    fills = [sum(s.time_s + s.p2p_s for s in cost.pipelines[p].stages) for p in keep]
    periods = [max(s.time_s + s.p2p_s for s in cost.pipelines[p].stages) for p in keep]
    counts = [1] * len(keep)
    heap = [(f + pd, i) for i, (f, pd) in enumerate(zip(fills, periods))]
    heapq.heapify(heap)
    for _ in range(problem.num_microbatches - len(keep)):
        _, i = heapq.heappop(heap)
        counts[i] += 1
        heapq.heappush(heap, (fills[i] + counts[i] * periods[i], i))
    pipelines = [Pipeline([Stage([new_rank[r] for r in s.ranks], s.layers)
                           for s in plan.pipelines[p].stages], m)
                 for p, m in zip(keep, counts)]
    ranks = [RankInfo(i, plan.ranks[r].node, plan.ranks[r].local_rank, plan.ranks[r].gpu)
             for i, r in enumerate(used)]
    thinner = dataclasses.replace(plan, ranks=ranks, pipelines=pipelines, predicted={})
    return dataclasses.replace(cand, plan=thinner, cost=evaluate(problem, thinner))
