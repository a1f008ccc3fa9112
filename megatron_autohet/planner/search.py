"""make_plan: a best-first branch and bound around the SCIP composition model.

The iteration time of a plan is ``max_p T_pipe(p) + sync(D) + optimizer`` (cost_model.py): the
longest pipeline plus the gradient sync and optimizer step of the busiest stages, where the sync
depends on the number of pipelines D. The search fixes everything that couples pipelines
non-linearly in an outer enumeration, and leaves an exact integer program to SCIP:

1. **Configs**: a TP degree (symmetric TP, the default: one degree for every TP group,
   so every layer has the same degree in every replica; nodes it does not divide stay idle; with
   ``allow_asymmetric_tp`` one degree per GPU type, by coordinate descent from the best symmetric
   choice) and the recompute mode (on only where memory limits a split, unless fixed). A config
   enters the search unbuilt at its fluid bound (:func:`fluid_bound_s`: the layer passes of the
   whole batch over the pools' total layer throughput); its options are built only if the search
   reaches that bound, so configs that cannot win (often the recompute and the widest-TP ones)
   cost nothing.
2. **Pipeline options** per config (independent of the cluster size): stage sequences of at most
   ``max_stages`` TP groups: every order of pools for pipelines of up to ALL_ORDERS_UP_TO
   stages, and for deeper ones at every depth that has at most ALL_ORDERS_BUDGET orders
   (:func:`orders_of`: three pools of 8+ TP groups get every order up to 5 stages, five one-GPU
   pools all 120 orders of 5 stages), so the fast GPUs can sit at both ends, which
   carry the embedding and the output layer, and share a node for the tied-embedding sync; at
   depths with more orders, contiguous runs of at most MAX_TYPES_PER_PIPELINE pools in every
   order, plus the same with one stage of the first run moved to the end. Each sequence gets its
   layer splits (space.py :func:`layer_splits`: all of them for small models, else the min-fill
   split under every period cap, exact for the pipeline time, or a few caps for long pipelines
   of deep models), and per GPU-count vector only the options that are best for some pipeline
   count are kept (:func:`_keep_best`; all of them priced at once as arrays, space.py
   :func:`sequence_options`). Why every order, not a dominance rule: a pipeline's time ``fill +
   (m - 1) period`` does not depend on the order of its stages (fill is their sum, period their
   maximum); the order changes only (a) the links between stages, (b) which stages carry the
   embedding and the output layer (the ends), (c) the tied embedding's link (inside a node when
   the first and last runs of one pool fit it together) and (d) memory, since stage s keeps
   ``S - s`` micro-batches in flight. (d) can part a type's stages: a fast type short of memory
   wants late stages, which keep few micro-batches in flight, a type with memory to spare early
   ones, and the output layer's logits may fit on neither. (a) orders one-GPU nodes with their
   own NICs (each a pool) by their links: a pipeline over five of them is fastest in one of the
   120 orders of five pools, 9.5% faster than the best contiguous pipeline
   (tests/planner/test_planner_optimality.py). Where no memory binds, every node's intra-node
   link is at least its NIC and the ends' runs of one pool fill at most one node, an interleaved
   order is no better than a contiguous one with the same end stages (an argument, checked by
   the exhaustive search only up to five stages): each pool's run has at least as many
   intra-node links as its stages had apart, its other links cross its own NIC where an
   interleaved stage crosses the slower of two NICs, and the run orders include every pair of
   end pools. So depths that take every order are exact
   (tests/planner/test_planner_optimality.py checks the planner against the exhaustive search on
   random small fleets and on that five-pool pipeline); deeper pipelines rest on that argument
   under those three conditions and are a heuristic otherwise, since the orders grow as K^S
   (five pools of 8+ groups: 3125 orders of 5 stages, 390,625 of 8). A
   pool is one kind of node (GPU type, size, intra-node link, NIC), so the links an option is
   priced with are the ones its stages get. Where memory limits a split, the splits that fit
   only when the pipeline runs m < S micro-batches (1F1B then keeps m in flight on its first
   stages) are options of their own, capped at m micro-batches in the SCIP model and the
   micro-batch split.
3. **Branches** (config, D range, level E): D in a bin of pipeline counts (exact for D <= 4,
   bins of a few percent of sync error above), E a level on sync(D) + optimizer of the options
   allowed (a geometric grid LEVEL_RATIO apart). A branch's iteration time is at least
   ``E_min + lower bound on the makespan``, with E_min the smallest exact sync + optimizer of
   the options at level E (not E, which would overstate the bound by up to LEVEL_RATIO and
   prune the best plan): the makespan bound is the largest of the shortest fill, the D-bin
   bound, the option-rate bound M / sum_k G_k r_k, the config's fluid bound and (once its
   (config, bin) is first reached) SCIP's bound on the makespan with every option allowed; also
   at least the (config, bin)'s relaxation that charges each pipeline only its own option's
   sync. It is at most ``E + SCIP's makespan`` (scip_model.py).
4. **Best first**: branches are solved in order of their lower bound. Each first asks SCIP
   whether any composition beats the incumbent (one solve prunes most branches), then bisects
   on the makespan. The search stops when the next bound cannot beat the best plan by more than
   the tolerance. Every branch's composition is turned into a plan (exact micro-batch split,
   placement) and judged by the full cost model, which decides the incumbent.
5. **Incumbents from the baselines**: the Megatron-LM, Whale-style and fastest-type-only plans
   (planner/baselines.py) are points of this space (uniform grids, a subset of the GPUs); they
   seed the incumbent, as a MIP start does, so the result is never slower than any of them and
   their bound prunes branches from the start.
6. **Node-local sync**: the branches price every layer's gradient sync over its pool's NIC,
   but with few pipelines the holders of a layer can share a node. Two closed-form families
   cover that and are judged by the cost model when a config is built: stacks of D <=
   MAX_STACK identical pipelines, each stage's sync at its own nodes' intra-node link (the tied
   embedding too when the pipelines have one stage), the STACKS_TRIED best per D
   (:meth:`BranchAndBound._stacks`), and every pair of options that fits the pools, with the
   layers both hold on one pool synced at the intra-node rate (:meth:`BranchAndBound._pairs`).
   tests/planner/test_planner_optimality.py checks the result against the exhaustive search on
   random small fleets: within 1% on every one.
7. **HAPT warm-up post-pass** (planner/warmup.py): the best plan's pipelines that set the
   iteration time get deeper 1F1B warm-ups where the event-level simulation says they overlap
   a slow boundary with compute, within memory; where that is cheap (small fleets and models)
   the plans next to it (other layer splits, two stages' GPUs swapped, an idle GPU as one
   stage more) get the pass too, since deeper warm-ups can favour a plan the closed form ranks
   equal. The exhaustive search's best gets the same pass, the baselines never (Megatron-LM has
   no such option).

8. **Never slower than a sub-fleet** (:class:`SubFleets`): the plan of every fleet the fleet
   holds minus one GPU type (recursively, each set of types searched once, and only where its
   lower bound is below the best plan found by then) is a candidate, as are the baselines and,
   for the re-planner, the previous plan adapted to the fleet. The search's own space holds those
   plans (GPUs may stay idle), but its heuristics (option and split selection, SCIP's node limit,
   the pruning tolerance, pools that change with the fleet) do not guarantee it finds them: a 32-GPU
   fleet of H100, A100, V100 and T4 found a plan 2.8% slower than the same fleet without its V100s.
   With them, adding GPUs never slows the plan, which tests/planner/test_planner_limits.py checks
   on random fleets. The fleet's own best plan gets the warm-up pass (step 7) before the
   sub-fleets' plans, which have had theirs, compete with it: compared at standard depths against
   a warmed-up sub-fleet plan it lost the bundled quick start (a100-h800-h20, GPT-3 1.3B, global
   batch 64), 0.2656 s warmed up against the A100 + H800 plan's 0.2744 s.

Bounded work: options depend on the GPU types and ``max_stages``, the SCIP model has one
integer per option and one row per GPU type, the bins grow logarithmically with the GPU count;
the number of GPUs otherwise only changes right-hand sides.

Objective ``cost`` (:func:`cheapest`): the cheapest plan that still trains fast enough.
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
least its rate over an upper bound on its throughput, the fluid bound (:func:`fluid_bound_s`:
layer passes per second, additive over nodes, each kind at its best TP degree and recompute
mode, the embedding and output layer at their cheapest). Sets run the throughput search
(:func:`fastest_before`, sub-fleets off: smaller sets are sets of their own here) in order of
that bound, smallest fleet first among equals, skipping sets whose throughput bound is below
the floor, until the next bound cannot beat the cheapest plan found that reaches the floor.
Where the throughput search is exact, so is this: the cheapest plan runs on some set U, and the
fastest plan on U is at least as fast at no higher rate. The bound is the same for every
multiple of a set and loose for large ones (pipeline bubbles and gradient sync are not in it:
on 512 GPUs of four types with GPT-3 1.3B the sets searched reached 0.94 of it on one node,
0.56-0.6 on 16-19 nodes), so proving the cheapest plan can take many searches: at most
``max_searches`` (default MAX_NODE_SETS) are searched, a deterministic budget (``stopped_by``
says when it binds).

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

Deterministic budget: the search's budget is counted in work, not wall time: SCIP
branch-and-bound nodes summed over all solves (each solve at least one, and at most
scip_model.SOLVE_NODE_LIMIT), checked between branches. The same input therefore gives the same
plan on an idle or a loaded machine. The wall-clock ``time_limit_s`` (a finite number > 0) is
only a safety net; when it cuts the search (or a single SCIP solve), :attr:`Candidate.stopped_by`
says so, since the plan then depends on the machine's speed. It is checked before every SCIP
solve (whose own limit is what the search has left), between branches, sub-fleet searches,
a sub-fleet's baseline grids, each block of stage sequences of an option build (one length, or
one micro-batch cap),
every block of the pair pricing and every stacked plan costed, and a cut search skips the
warm-up pass: at most 0.4 CPU-s between two checks on a 32-GPU fleet of four types, 0.8 CPU-s
on 4096 GPUs of four types (LLaMA-2 7B). The fleet's own baselines always run, first (they are
the floor of the result: 1.2 CPU-s at 4096 GPUs with the profile), so a cut search, which
returns the best plan judged so far, is never slower than the best baseline.
"""

from __future__ import annotations

import copy
import dataclasses
import heapq
import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from megatron_autohet.cost_model import (DEFAULT_CHARGE, DEFAULT_MEMORY_HEADROOM, PlanCost,
                                         check_charge, check_memory_headroom, stage_compute_s,
                                         record_profile, stage_memory_bytes)
from megatron_autohet.errors import ConfigError
from megatron_autohet.plan import OBJECTIVES, Pipeline, Plan, RankInfo, Stage
from megatron_autohet.planner.baselines import all_baselines
from megatron_autohet.planner.scip_model import BOUND_TOLERANCE, Composition, CompositionModel
from megatron_autohet.planner.space import (OptionTable, PipelineOption, Pool, Problem,
                                            assign_microbatches, build_plan, check_batch, evaluate,
                                            layer_sync_s, make_pools, ring_factor,
                                            sequence_options, sequence_terms)
from megatron_autohet.planner.warmup import choose_warmups
from megatron_autohet.profiling.estimate import estimate_profile
from megatron_autohet.profiling.profile import Profile
from megatron_autohet.spec.cluster import Cluster
from megatron_autohet.spec.model import ModelSpec
from megatron_autohet.spec.precision import PLANNING_PRECISION

# Pipelines of S stages take every order of pools up to ALL_ORDERS_UP_TO stages, and beyond
# while there are at most ALL_ORDERS_BUDGET orders of S stages (module doc, step 2); other
# depths contiguous runs of at most MAX_TYPES_PER_PIPELINE pools. A larger budget cost CPU time
# and, on 1024 GPUs with LLaMA-2 7B, a 0.7% slower plan (2500: every order of three pools up to
# 7 stages; the orders it added displaced, among the options kept per GPU-count vector, one that
# wins once its stages share nodes).
ALL_ORDERS_UP_TO = 4
ALL_ORDERS_BUDGET = 300
MAX_TYPES_PER_PIPELINE = 3
# Upper bound on the default number of stages per pipeline (deeper ones only when memory needs).
MAX_STAGES_CAP = 16
# Pipeline-count bins: exact below 5; above, the bin's smallest count prices the sync (its ring
# factor 2 (D-1)/D is then at most ~4% below the bin's largest).
PIPELINE_BINS = ((1, 1), (2, 2), (3, 3), (4, 4), (5, 6), (7, 9), (10, 16), (17, 32), (33, 64),
                 (65, 128), (129, 256), (257, 512), (513, 1 << 30))
# Sync + optimizer levels: a geometric grid this far apart (options are grouped by the level at
# or above their own value; the bounds use the exact values, and the plans are judged exactly).
LEVEL_RATIO = 1.02
# Stop when no branch's lower bound is this much below the best plan.
PRUNE_TOLERANCE = 1e-3
# Pipeline counts for which each GPU-count vector keeps its best option.
KEEP_FOR_COUNTS = (1, 2, 4, 8, 32, 1024)
# Two-pipeline plans with node-local layer sync judged by the cost model per config.
PAIRS_TRIED = 3
# Elements of the pair matrix (and of the per-pair layer arrays) priced at once.
PAIR_BLOCK_ELEMENTS = 1 << 20
# Stacks of up to this many identical pipelines are tried with their stages sharing nodes,
# the best few options per stack height judged by the cost model.
MAX_STACK = 4
STACKS_TRIED = 3
# Default work budget (SCIP branch-and-bound nodes over the whole search, module doc): well above
# what the bundled fleets and the 8-4096-GPU benchmark fleets use to finish, so it binds only on
# unusual inputs.
WORK_BUDGET = 5000
# Why a search stopped (Candidate.stopped_by).
STOP_COMPLETE, STOP_WORK, STOP_TIME = "complete", "work budget", "time limit"
STOP_SETS = "search budget"       # the cost objective's ``max_searches`` (module doc)
# The wall clock of the safety net (a module attribute, so tests can play a loaded machine).
clock = time.monotonic


@dataclass
class Candidate:
    plan: Plan
    cost: PlanCost
    tp_of_gpu: dict[str, int]
    recompute: bool
    # How the search that returned this candidate ended: STOP_COMPLETE (nothing left that could
    # beat it), STOP_WORK (the work budget ran out: deterministic), STOP_SETS (the cost search
    # ran its budget of throughput searches: deterministic) or STOP_TIME (the wall-clock safety net
    # cut it: the plan may differ on a faster or less loaded machine).
    stopped_by: str = STOP_COMPLETE
    work: int = 0               # SCIP branch-and-bound nodes the search used


def resolve_profile(cluster: Cluster, model: ModelSpec, profile: Profile | None,
                    micro_batch_size: int, seq_length: int) -> Profile:
    """The given profile, with analytic estimates for the entries it lacks, calibrated by its
    measured entries (Profile.calibrated_over)."""
    if profile is None:
        return estimate_profile(model, cluster, micro_batch_size, seq_length)
    # estimated for the attention the profile's layers ran (its activation bytes depend on it)
    estimate = estimate_profile(model, cluster, micro_batch_size, seq_length,
                                attention=profile.attention)
    return profile.calibrated_over(estimate)


def priced_precision(profile: Profile | None) -> str:
    """The precision a plan made from ``profile`` is priced in, hence the one it is made to train
    in (spec/cluster.py ``trainable_fleet`` chooses its GPUs by it): the profile's, else the
    analytic estimates' (spec/precision.py PLANNING_PRECISION, bf16)."""
    return (profile.precision if profile is not None else PLANNING_PRECISION).name


def with_left_out(cost: PlanCost, left_out: dict[str, int]) -> PlanCost:
    """``cost`` with the GPUs ``trainable_fleet`` left out among its idle GPUs: a plan records
    every GPU of its cluster it leaves idle (the re-planner's unchanged-fleet test compares the
    fleet with that record)."""
    if not left_out:
        return cost
    idle = dict(cost.idle_gpus)
    for gpu, count in left_out.items():
        idle[gpu] = idle.get(gpu, 0) + count
    return dataclasses.replace(cost, idle_gpus=idle)


def default_max_stages(problem: Problem, pools: list[Pool]) -> int:
    """Enough stages for the smallest-memory pool to hold the model alone, plus two; at least 8."""
    L = problem.model.num_layers
    needed = 1
    for pool in pools:
        entry = problem.entry(pool)
        limit = problem.memory_limit_bytes(pool)
        m1 = stage_memory_bytes(entry, problem.model, 1, False, False, False, 1,
                                problem.profile.precision)
        m2 = stage_memory_bytes(entry, problem.model, 2, False, False, False, 1,
                                problem.profile.precision)
        per_stage = max(1, int((limit - m1) // (m2 - m1)) + 1) if limit > m1 else 1
        needed = max(needed, math.ceil(L / per_stage))
    return min(L, MAX_STAGES_CAP, max(8, needed + 2))


def stage_sequences(pools: list[Pool], max_stages: int) -> list[tuple[int, ...]]:
    """Pipelines of S stages in every order of pools (any number of GPU types: a type of
    one-GPU nodes with their own NICs is several pools) up to ALL_ORDERS_UP_TO stages and where
    the orders of S stages are at most ALL_ORDERS_BUDGET; at other depths contiguous runs of at
    most MAX_TYPES_PER_PIPELINE pools in every order, and the same with one stage of the first
    run moved to the end (both ends on the fast GPUs)."""
    K, counts = len(pools), [p.count for p in pools]
    out: dict[tuple[int, ...], None] = {}
    every = set()
    for S in range(1, max_stages + 1):
        if S <= ALL_ORDERS_UP_TO or orders_of(counts, S) <= ALL_ORDERS_BUDGET:
            every.add(S)
            out.update(dict.fromkeys(_orders(counts, S)))
    for used in range(1, min(K, MAX_TYPES_PER_PIPELINE) + 1):
        for subset in itertools.combinations(range(K), used):
            ranges = [range(1, min(counts[k], max_stages) + 1) for k in subset]
            for n in itertools.product(*ranges):
                if sum(n) > max_stages or sum(n) in every:
                    continue
                for order in itertools.permutations(range(used)):
                    seq = tuple(subset[i] for i in order for _ in range(n[i]))
                    out[seq] = None
                    if used > 1 and n[order[0]] > 1:
                        out[seq[1:] + seq[:1]] = None
    return list(out)


def orders_of(counts: list[int], stages: int) -> int:
    """How many sequences of ``stages`` pools use pool k at most ``counts[k]`` times:
    ``S! [x^S] prod_k sum_{j <= c_k} x^j / j!``."""
    poly = [1] + [0] * stages             # exact: integer multiples of 1 / S!
    for c in counts:
        poly = [sum(poly[i - j] * math.comb(i, j) for j in range(min(c, i) + 1))
                for i in range(stages + 1)]
    return poly[stages]


def _orders(counts: list[int], stages: int) -> list[tuple[int, ...]]:
    """The sequences orders_of counts, in lexicographic order."""
    out = []

    def extend(prefix: list[int], left: list[int]) -> None:
        if len(prefix) == stages:
            out.append(tuple(prefix))
            return
        for k, c in enumerate(left):
            if c:
                left[k] -= 1
                prefix.append(k)
                extend(prefix, left)
                prefix.pop()
                left[k] += 1

    extend([], list(counts))
    return out


def _keep_best(table: OptionTable, group: np.ndarray, cap: np.ndarray, problem: Problem
               ) -> np.ndarray:
    """Indices of the options to keep: of the options of one group (GPU-count vector and
    micro-batch cap ``cap``), those that are best for a pipeline running its share of the batch
    (at most the cap) for some pipeline count (KEEP_FOR_COUNTS), or best in period alone; in
    group order (groups numbered by first appearance), then option order."""
    total = problem.num_microbatches

    # Options by group (stable: option order within a group) and where each group starts.
    by_group = np.argsort(group, kind="stable")
    starts = np.flatnonzero(np.append(True, group[by_group][1:] != group[by_group][:-1]))

    def best_per_group(key: np.ndarray) -> np.ndarray:
        """Per group, its first option of the smallest key."""
        values = key[by_group]
        smallest = np.minimum.reduceat(values, starts)
        at_min = by_group[values == np.repeat(smallest, np.diff(np.append(starts,
                                                                          len(values))))]
        _, first = np.unique(group[at_min], return_index=True)
        return at_min[first]

    # best in period, ties by fill
    by_period = best_per_group(table.period_s)
    keep = [best_per_group(np.where(table.period_s == table.period_s[by_period][
        np.searchsorted(group[by_period], group)], table.fill_s, np.inf))]
    for d in KEEP_FOR_COUNTS:
        share = math.ceil(total / d)
        extras = table.extras_s(d)
        for x in (max(1, share // 2), share, 2 * share):
            # pipelines get uneven shares
            m = np.minimum(x, cap)
            keep.append(best_per_group(table.fill_s + (m - 1) * table.period_s + extras))
    kept = np.unique(np.concatenate(keep))
    return kept[np.lexsort((kept, group[kept]))]


@dataclass
class Config:
    """One outer choice: a TP degree per GPU type and the recompute mode. Its options are built
    only when the search reaches its fluid bound (``build_options``)."""

    pools: list[Pool]
    recompute: bool
    fluid_bound_s: float
    options: list[PipelineOption] | None = None
    memory_bound: bool = False
    table: OptionTable | None = None
    extras: dict[int, list[float]] = dataclasses.field(default_factory=dict)

    def extras_at(self, pipelines: int) -> list[float]:
        """Each option's sync + optimizer level (grid value) with this many pipelines."""
        if pipelines not in self.extras:
            self.extras[pipelines] = [_level(e) for e in self.table.extras_s(pipelines)]
        return self.extras[pipelines]

    @property
    def key(self) -> tuple:
        return tuple((p.gpu, p.tp) for p in self.pools), self.recompute


def fluid_bound_s(problem: Problem, pools: list[Pool], recompute: bool) -> float:
    """Lower bound on the makespan of any plan of these pools: every micro-batch passes all L
    layers, the embedding and the output layer once, and a TP group of pool k spends at least
    ``l_k`` seconds per layer and micro-batch (forward + backward; its stage period also has
    P2P and the other layers), so within a makespan tau the groups do at most
    ``tau * sum_k G_k / l_k`` layer passes:

        tau >= M (L + min_k e_k / l_k + min_k o_k / l_k) / sum_k (G_k / l_k)

    with ``e_k``, ``o_k`` the embedding's and the output layer's time on pool k (in layer units
    on the pool doing them; the minimum over pools keeps the bound valid wherever they sit).
    Pools that cannot hold one layer in memory do no work."""
    model, M = problem.model, problem.num_microbatches
    rate, embed, output = 0.0, math.inf, math.inf
    for pool in pools:
        entry = problem.entry(pool)
        limit = problem.memory_limit_bytes(pool)
        if stage_memory_bytes(entry, model, 1, False, False, recompute, 1,
                              problem.profile.precision) > limit:
            continue
        per_layer = sum(stage_compute_s(entry, 1, False, False, recompute))
        rate += pool.count / per_layer
        embed = min(embed, sum(stage_compute_s(entry, 0, True, False, recompute)) / per_layer)
        output = min(output, sum(stage_compute_s(entry, 0, False, True, recompute)) / per_layer)
    if rate == 0:
        return math.inf
    return M * (model.num_layers + embed + output) / rate


def make_config(problem: Problem, tp_of_gpu: dict[str, int], recompute: bool) -> Config | None:
    """The config of this TP choice and recompute mode, options not built yet (None: no pool)."""
    pools = make_pools(problem.cluster, tp_of_gpu)
    if not pools:
        return None
    return Config(pools, recompute, fluid_bound_s(problem, pools, recompute))


def build_options(problem: Problem, config: Config, max_stages: int | None,
                  out_of_time: Callable[[], bool] = lambda: False) -> bool:
    """The config's pipeline options (module doc, step 2) and whether memory limited a split;
    False, the config left unbuilt, when ``out_of_time`` says so (checked before each block of
    sequences: the sequences of one length, or those of one micro-batch cap)."""
    pools, K = config.pools, len(config.pools)
    stages = max_stages or default_max_stages(problem, pools)
    L = problem.model.num_layers
    M = problem.num_microbatches
    found = stage_sequences(pools, min(stages, L))
    by_length: dict[int, list[int]] = {}
    for i, seq in enumerate(found):
        by_length.setdefault(len(seq), []).append(i)
    # Entries (a sequence, uncapped or capped at m micro-batches) by block: their sequences,
    # their cap (0: none), their stage terms and their GPU-count vectors.
    blocks: list[tuple[np.ndarray, int, np.ndarray, np.ndarray]] = []
    memory_bound = False
    for S, members in by_length.items():
        if out_of_time():
            return False
        index = np.array(members)
        seqs = np.array([found[i] for i in members], dtype=np.int64).reshape(len(members), S)
        terms, fits = sequence_terms(problem, pools, seqs, config.recompute)
        limits = terms[:, :, 2]
        counts = (seqs[:, :, None] == np.arange(K)).sum(axis=1)
        blocks.append((index[fits], 0, terms[fits], counts[fits]))
        bound = np.flatnonzero(~fits | (limits < L).any(axis=1))
        memory_bound |= len(bound) > 0
        # With m < S micro-batches the first stages keep fewer in flight: splits memory allows
        # only then are options capped at m (where some stage then holds more layers).
        for cap in range(min(S, M) - 1, 0, -1) if len(bound) else ():
            if out_of_time():
                return False
            capped, ok = sequence_terms(problem, pools, seqs[bound], config.recompute, cap)
            more = ok & ~(fits[bound] & (capped[:, :, 2] <= limits[bound]).all(axis=1))
            blocks.append((index[bound][more], cap, capped[more], counts[bound][more]))
    config.memory_bound = memory_bound
    config.options, config.table = [], None
    seq_of = np.concatenate([b[0] for b in blocks]) if blocks else np.zeros(0, dtype=np.int64)
    if not len(seq_of):
        return True
    cap_of = np.concatenate([np.full(len(b[0]), b[1]) for b in blocks])
    # Entries in sequence order, each sequence's capped ones first (largest cap first).
    order = np.lexsort((np.where(cap_of == 0, 1, -cap_of), seq_of))
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    sequences = [(found[i], int(c) or None) for i, c in zip(seq_of[order].tolist(),
                                                          cap_of[order].tolist())]
    # One block per length, as layer_splits is cheapest on few large blocks.
    starts = np.cumsum([0] + [len(b[0]) for b in blocks])
    by_stages: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
    for a, b, block in zip(starts[:-1], starts[1:], blocks):
        by_stages.setdefault(block[2].shape[1], []).append((rank[a:b], block[2]))
    built = sequence_options(problem, sequences, [
        (np.concatenate([r for r, _ in parts]), np.concatenate([t for _, t in parts]))
        for parts in by_stages.values()])
    if not len(built.sequence):
        return True
    # Groups of equal GPU-count vector and cap, numbered by first appearance (entry order).
    keys = np.column_stack([np.concatenate([b[3] for b in blocks])[order], cap_of[order]])
    _, first, inverse = np.unique(keys, axis=0, return_index=True, return_inverse=True)
    group_of = np.argsort(np.argsort(first))[inverse.reshape(-1)]
    caps = np.where(cap_of[order] == 0, np.iinfo(np.int64).max, cap_of[order])
    kept = _keep_best(built.table, group_of[built.sequence], caps[built.sequence], problem)
    config.options = [built.option(j) for j in kept]
    config.table = built.table.subset(kept, problem)
    return True


@dataclass(order=True)
class Branch:
    lower_bound_s: float
    level_s: float              # options whose sync + optimizer level is at most this allowed
    config_index: int
    bin_index: int
    # The smallest exact sync + optimizer of the options at this level: a plan that needs this
    # level pays at least that much (the level itself is up to LEVEL_RATIO above it, so the
    # bounds use this instead; a bound above the true value would prune the best plan).
    sync_floor_s: float = 0.0


def _branches(problem: Problem, config: Config, index: int) -> list[Branch]:
    """Every (pipeline-count bin, sync + optimizer level) of a config with its lower bound."""
    M = problem.num_microbatches
    counts = np.array([p.count for p in config.pools], dtype=float)
    groups = int(counts.sum())
    # Each option's layer rate on the pools it uses: 1 / (stages x period) per TP group.
    rates = np.zeros((len(config.options), len(counts)))
    for j, o in enumerate(config.options):
        rates[j, list(set(o.pools))] = 1.0 / (len(o.pools) * o.period_s)
    out = []
    for b, (lo, hi) in enumerate(PIPELINE_BINS):
        if lo > min(M, groups):
            break
        hi = min(hi, M, groups)
        # Options sorted by their sync + optimizer at the bin's smallest count; sweeping the
        # levels upwards, each level's bound uses the best rate per pool and the shortest fill
        # and period of the options at or below it.
        extras = np.array(config.extras_at(lo))
        order = np.argsort(extras, kind="stable")
        levels = extras[order]
        last = np.flatnonzero(np.append(levels[1:] != levels[:-1], True))
        floors = np.minimum.reduceat(config.table.extras_s(lo)[order],
                                     np.append(0, last[:-1] + 1))
        throughput = np.maximum.accumulate(rates[order], axis=0)[last] @ counts
        fill = np.minimum.accumulate(config.table.fill_s[order])[last]
        period = np.minimum.accumulate(config.table.period_s[order])[last]
        bound = np.maximum(np.maximum(fill + (math.ceil(M / hi) - 1) * period, M / throughput),
                           config.fluid_bound_s)
        out.extend(Branch(float(e + b_s), float(level), index, b, float(e))
                   for level, e, b_s in zip(levels[last], floors, bound))
    return out


def _level(value: float) -> float:
    """The grid point at or above ``value`` (LEVEL_RATIO apart)."""
    if value <= 0:
        return 0.0
    return LEVEL_RATIO ** math.ceil(math.log(value) / math.log(LEVEL_RATIO) - 1e-9)


class BranchAndBound:
    """Best-first search over the branches of several configs (module doc, steps 3-4)."""

    def __init__(self, problem: Problem, deadline: float, work_budget: int,
                 max_stages: int | None, skip_needless_recompute: bool,
                 on_candidate: Callable[[Candidate], None] | None = None):
        self.problem = problem
        self.on_candidate = on_candidate
        self.deadline = deadline
        self.work_budget = work_budget
        self.work = 0               # SCIP nodes of the finished runs (module doc)
        self.stopped_by = STOP_COMPLETE
        self.max_stages = max_stages
        self.skip_needless_recompute = skip_needless_recompute
        self.best: Candidate | None = None
        self.built: dict[tuple, Config] = {}
        self.solves = 0

    def may_continue(self, models: dict | None = None) -> bool:
        """False once the work budget or the wall-clock safety net is spent (and why, in
        ``stopped_by``; the work budget is checked first, so it decides whenever both are)."""
        live = sum(m.nodes for m in models.values()) if models else 0
        if self.work + live >= self.work_budget:
            self.stopped_by = STOP_WORK
        elif clock() >= self.deadline or (models and any(m.timed_out
                                                         for m in models.values())):
            self.stopped_by = STOP_TIME
        else:
            return True
        return False

    def offer(self, cand: Candidate | None) -> None:
        if cand is None or not cand.cost.fits_memory:
            return
        if self.on_candidate is not None:
            self.on_candidate(cand)
        if self.best is None or cand.cost.iteration_time_s < self.best.cost.iteration_time_s:
            self.best = cand

    def _build(self, config: Config) -> bool:
        """Build a config's options when the search reaches it; False when it has none, when
        it is the recompute twin of a config that memory never limited (recompute only adds
        time there), or when the safety net cut the building."""
        twin = self.built.get((config.key[0], False))
        if config.recompute and self.skip_needless_recompute and twin is not None \
                and not twin.memory_bound:
            return False
        if not build_options(self.problem, config, self.max_stages,
                             lambda: clock() >= self.deadline):
            return False            # cut by the safety net: the loop's next check stops
        self.built[config.key] = config
        return bool(config.options)

    def run(self, configs: list[Config], bar) -> None:
        configs = [c for c in configs if c.key not in self.built]
        # Configs enter the heap unbuilt at their fluid bound (bin index -1); a config's options
        # are built, and its branches pushed, only when no plan found by then beats that bound.
        # No-recompute configs come first at equal bounds (their recompute twins look at them).
        heap = [Branch(c.fluid_bound_s, 0.0, i, -1) for i, c in enumerate(configs)]
        heapq.heapify(heap)
        models: dict[tuple[int, int], CompositionModel] = {}
        known: dict[tuple[int, int], list[tuple[float, Composition]]] = {}
        # The relaxation that charges each pipeline only its own option's sync + optimizer
        # (instead of the maximum over all pipelines) bounds every level of its (config, bin)
        # from below, and its composition is usually close to the best: it is solved first.
        floor: dict[tuple[int, int], float] = {}
        fastest: dict[tuple[int, int], float] = {}
        while heap and self.may_continue(models):
            br = heapq.heappop(heap)
            best_s = self.best.cost.iteration_time_s if self.best else math.inf
            if br.lower_bound_s >= best_s * (1 - PRUNE_TOLERANCE):
                break
            config = configs[br.config_index]
            if br.bin_index < 0:
                if self._build(config):
                    self._stacks(config)
                    self._pairs(config)
                    for branch in _branches(self.problem, config, br.config_index):
                        heapq.heappush(heap, branch)
                continue
            bar.update()
            lo = PIPELINE_BINS[br.bin_index][0]
            key = (br.config_index, br.bin_index)
            model = models.get(key) or self._model(config, br.bin_index)
            models[key] = model
            if key not in floor:
                offsets = config.table.extras_s(lo).tolist()
                everything = [True] * len(config.options)
                comp, floor[key] = model.min_makespan(
                    everything, br.lower_bound_s - br.sync_floor_s + min(offsets),
                    None, best_s, BOUND_TOLERANCE, offsets)
                if comp is not None:
                    self.offer(self._candidate(config, comp))
                # No level's makespan is below the makespan with every option allowed.
                comp, fastest[key] = model.min_makespan(
                    everything, config.fluid_bound_s, None, best_s - min(offsets),
                    BOUND_TOLERANCE)
                if comp is not None:
                    self.offer(self._candidate(config, comp))
            bound = max(floor[key], br.sync_floor_s + fastest[key])
            if bound > br.lower_bound_s * (1 + PRUNE_TOLERANCE):
                heapq.heappush(heap, dataclasses.replace(br, lower_bound_s=bound))
                continue
            allowed = [e <= br.level_s for e in config.extras_at(lo)]
            # A composition feasible at a lower level stays feasible here.
            start = min((c for level, c in known.get(key, []) if level <= br.level_s),
                        key=lambda c: c.makespan_s, default=None)
            comp, _ = model.min_makespan(allowed,
                                         max(br.lower_bound_s, floor[key]) - br.sync_floor_s,
                                         start, best_s - br.sync_floor_s)
            if comp is None:
                continue
            known.setdefault(key, []).append((br.level_s, comp))
            if comp is not start:
                self.offer(self._candidate(config, comp))
        self.solves += sum(m.solves for m in models.values())
        self.work += sum(m.nodes for m in models.values())

    def _stacks(self, config: Config) -> None:
        """Plans of D <= MAX_STACK identical pipelines whose stage s all sit on one node, so
        every layer's gradients sync inside a node (the SCIP branches price the sync over the
        NIC). Closed form: per D, the STACKS_TRIED options with the smallest makespan plus sync
        (layers and tied embedding, each stage's at its nodes' intra-node rate) and optimizer
        step; the exact plans are judged by the cost model like every other candidate."""
        M, pools = self.problem.num_microbatches, config.pools
        # seconds at the sync link -> at the intra-node link, per pool
        to_intra = [self.problem.sync_bandwidth_gbs(p) / p.intra_gbs for p in pools]
        for d in range(2, min(MAX_STACK, M) + 1):
            stackable = [o for o in config.options
                         if all(d * o.pools.count(k) <= pools[k].count
                                and d <= pools[k].groups_per_node for k in set(o.pools))]

            def estimate(o: PipelineOption) -> float:
                # the tied embedding's 2D holders (D with one stage) share a node only then
                single = len(o.pools) == 1
                tied = ring_factor(d if single else 2 * d)
                sync = max(ring_factor(d) * a * to_intra[k] + tied * t * (to_intra[k] if single
                                                                          else 1.0)
                           for a, t, k in zip(o.sync_shared_s, o.sync_tied_s, o.pools))
                return o.time_s(math.ceil(M / d)) + sync + o.optimizer_s

            for best in sorted(stackable, key=estimate)[:STACKS_TRIED]:
                if clock() >= self.deadline:
                    return          # each plan costs a tenth of a second on 4096 GPUs
                self.offer(self._candidate(config, Composition(
                    [d if o is best else 0 for o in config.options], 0.0)))

    def _pairs(self, config: Config) -> None:
        """Two-pipeline plans whose layer-wise sync may stay inside a node: a layer both
        pipelines hold on one pool of 2+ TP groups per node syncs over NVLink once placement
        puts the two stages together (the SCIP branches price every layer over the NIC). Every
        pair of options that fits the pools is priced in closed form: the best two-way
        micro-batch split (the crossing point of the two pipelines' times, rounded both ways),
        plus the busier pipeline's sync with the co-held layers at the intra-node rate, plus the
        slower optimizer step; the PAIRS_TRIED best are judged by the cost model."""
        problem, options, pools = self.problem, config.options, config.pools
        M, L, n = problem.num_microbatches, problem.model.num_layers, len(config.options)
        saving = np.array([layer_sync_s(problem, p) * (
            1 - problem.sync_bandwidth_gbs(p) / max(problem.sync_bandwidth_gbs(p), p.intra_gbs))
            if p.groups_per_node >= 2 else 0.0 for p in pools])
        table = config.table
        best_s = self.best.cost.iteration_time_s if self.best else math.inf
        if M < 2 or n < 2 or not saving.any() or (
                table.fill_s.min() + (math.ceil(M / 2) - 1) * table.period_s.min() >= best_s):
            return
        use = np.array([[o.pools.count(k) for k in range(len(pools))] for o in options])
        counts = np.array([p.count for p in pools])
        # Whether two options fit the pools together, per pair of GPU-count vectors.
        vectors, vector_of = np.unique(use, axis=0, return_inverse=True)
        vector_of = vector_of.reshape(-1)
        fit_vectors = ((vectors[:, None, :] + vectors[None, :, :]) <= counts).all(axis=2)
        layer_pool = np.array([[k for k, c in zip(o.pools, o.layers) for _ in range(c)]
                               for o in options])
        width = table.shared.shape[1]
        bounds = np.array([list(itertools.accumulate(o.layers, initial=0))
                           + [L] * (width - len(o.layers)) for o in options])
        tied_factor = np.where(table.multi_stage, ring_factor(4), ring_factor(2))
        fill, period, optimizer = table.fill_s, table.period_s, table.optimizer_s

        def makespan_of(fill_i, period_i, fill_j, period_j):
            """Two pipelines' makespan under the best split (the crossing point, rounded both
            ways; the exact integer optimum, as each side's time is linear in its share)."""
            crossing = (fill_j - fill_i + period_i + (M - 1) * period_j) / (period_i + period_j)
            out = np.full(np.shape(crossing), math.inf)
            for m in (np.floor(crossing), np.ceil(crossing)):
                m = np.clip(m, 1, M - 1)
                out = np.minimum(out, np.maximum(fill_i + (m - 1) * period_i,
                                                 fill_j + (M - m - 1) * period_j))
            return out

        # Lower bounds that prune without changing the pairs judged: per option, its busiest
        # stage's sync were every layer it holds co-held (the most a partner saves it), and its
        # estimate beside a partner of the smallest fill, period and optimizer step of all.
        held = np.array([list(o.layers) + [0] * (width - len(o.layers)) for o in options])
        pool_at = np.array([list(o.pools) + [0] * (width - len(o.pools)) for o in options])
        sync_floor = (ring_factor(2) * (table.shared - held * saving[pool_at])
                      + tied_factor[:, None] * table.tied).max(axis=1)
        alone = (makespan_of(fill, period, fill.min(), period.min())
                 + optimizer + sync_floor)
        # (bounds and estimates round differently: a relative margin far above rounding)
        live = np.flatnonzero(alone < best_s * (1 + 1e-9))
        best: list[tuple[float, int, int]] = []         # (estimate, i, j), the best few

        def threshold() -> float:
            """A pair whose estimate is not below this is not judged (nor, being after the
            best few in (estimate, i, j) order, kept)."""
            return min(best_s, best[-1][0]) if len(best) == PAIRS_TRIED else best_s

        # Rows of the live x live pair matrix a block at a time, pairs a batch at a time (the
        # memory stays bounded, the safety net is checked between blocks), each block's pairs
        # in the order of their lower bound, until the bound reaches the best few.
        rows_per_block = max(1, PAIR_BLOCK_ELEMENTS // max(1, len(live)))
        per_batch = PAIR_BLOCK_ELEMENTS // max(1, L)
        for first in range(0, len(live), rows_per_block):
            if clock() >= self.deadline:
                return
            rows = live[first:first + rows_per_block]
            makespan = makespan_of(fill[rows, None], period[rows, None], fill[None, live],
                                   period[None, live])
            makespan += np.maximum(optimizer[rows, None], optimizer[None, live])
            fits = fit_vectors[vector_of[rows][:, None], vector_of[live][None, :]]
            # Pairs (i < j) that fit and could beat the best plan even with no sync at all.
            r, c = np.nonzero(fits & (makespan < best_s) & (live[None, :] > rows[:, None]))
            i_all, j_all = rows[r], live[c]
            bound = makespan[r, c] + np.maximum(sync_floor[i_all], sync_floor[j_all])
            by_bound = np.argsort(bound, kind="stable")
            for batch in range(0, len(by_bound), per_batch):
                sel = by_bound[batch:batch + per_batch]
                sel = sel[bound[sel] < threshold() * (1 + 1e-9)]
                if not len(sel):
                    break
                i, j = i_all[sel], j_all[sel]
                # Per pair, the seconds (ring factor 1) each side saves on its co-held layers.
                save = np.where(layer_pool[i] == layer_pool[j], saving[layer_pool[i]], 0.0)
                cum = np.concatenate([np.zeros((len(i), 1)), np.cumsum(save, axis=1)], axis=1)

                def busiest_sync(side: np.ndarray) -> np.ndarray:
                    at = np.arange(len(side))[:, None]
                    stage_save = cum[at, bounds[side, 1:]] - cum[at, bounds[side, :-1]]
                    return (ring_factor(2) * (table.shared[side] - stage_save)
                            + tied_factor[side, None] * table.tied[side]).max(axis=1)

                estimate = makespan[r[sel], c[sel]] + np.maximum(busiest_sync(i),
                                                                 busiest_sync(j))
                top = np.lexsort((j, i, estimate))[:PAIRS_TRIED]
                best = sorted(best + [(float(estimate[p]), int(i[p]), int(j[p]))
                                      for p in top])[:PAIRS_TRIED]
        for estimate, i, j in best:
            if not estimate < best_s:
                break
            self.offer(self._candidate(config, Composition(
                [int(k in (i, j)) for k in range(n)], 0.0)))

    def _model(self, config: Config, bin_index: int) -> CompositionModel:
        lo, hi = PIPELINE_BINS[bin_index]
        groups = sum(p.count for p in config.pools)
        M = self.problem.num_microbatches
        return CompositionModel(config.options, [p.count for p in config.pools], M,
                                (lo, min(hi, M, groups)), lambda: self.deadline - clock())

    def _candidate(self, config: Config, comp: Composition) -> Candidate | None:
        """The plan of a composition, judged by the cost model (None: its pipelines' micro-batch
        caps cannot take the batch)."""
        problem = self.problem
        pipelines = [o for o, x in zip(config.options, comp.multiplicities) for _ in range(x)]
        if sum(o.cap(problem.num_microbatches) for o in pipelines) < problem.num_microbatches:
            return None
        counts = assign_microbatches(pipelines, problem.num_microbatches)
        plan = build_plan(problem, config.pools, pipelines, counts, config.recompute)
        cost = evaluate(problem, plan)
        return Candidate(plan, cost, {p.gpu: p.tp for p in config.pools}, config.recompute)


def make_plan(cluster: Cluster, model: ModelSpec, profile: Profile | None,
              global_batch_size: int, micro_batch_size: int, seq_length: int | None = None, *,
              allow_asymmetric_tp: bool = False, activation_recompute: bool | None = None,
              time_limit_s: float = 60.0, progress: bool = True,
              tp_degrees: list[int] | None = None, max_stages: int | None = None,
              distributed_optimizer: bool = False,
              memory_headroom: float = DEFAULT_MEMORY_HEADROOM,
              work_budget: int = WORK_BUDGET, objective: str = "throughput") -> Plan:
    """The fastest plan the search finds (see module doc), annotated with its predictions.

    ``profile`` None plans on analytic estimates; a given profile (measured or estimated) wins
    over the estimates where it has entries. ``activation_recompute`` None decides per plan.
    ``tp_degrees`` restricts the TP degrees searched; ``max_stages`` the pipeline depth;
    ``memory_headroom`` is the fraction of every GPU's memory the plan leaves free.
    ``distributed_optimizer``: plans for Megatron-LM's --use-distributed-optimizer, priced so
    and recorded in the plan (the options' memory limits stay those of unsharded Adam state:
    the search does not look for splits that fit only thanks to the sharding).
    ``work_budget`` bounds the search deterministically (module doc); ``time_limit_s`` is the
    wall-clock safety net. ``objective`` "cost" minimises USD per million tokens instead of
    the iteration time (every node needs a spot price).
    Raises ConfigError when the batch cannot be split or no plan fits in memory.
    """
    return search(cluster, model, profile, global_batch_size, micro_batch_size, seq_length,
                  allow_asymmetric_tp=allow_asymmetric_tp,
                  activation_recompute=activation_recompute, time_limit_s=time_limit_s,
                  progress=progress, tp_degrees=tp_degrees, max_stages=max_stages,
                  distributed_optimizer=distributed_optimizer,
                  memory_headroom=memory_headroom, work_budget=work_budget,
                  objective=objective).plan


def search(cluster: Cluster, model: ModelSpec, profile: Profile | None, global_batch_size: int,
           micro_batch_size: int, seq_length: int | None = None, *,
           allow_asymmetric_tp: bool = False, activation_recompute: bool | None = None,
           time_limit_s: float = 60.0, progress: bool = True, tp_degrees: list[int] | None = None,
           max_stages: int | None = None, seeds: Sequence[Candidate] = (),
           baselines: bool = True, work_budget: int = WORK_BUDGET,
           objective: str = "throughput",
           on_candidate: Callable[[Candidate], None] | None = None,
           distributed_optimizer: bool = False,
           memory_headroom: float = DEFAULT_MEMORY_HEADROOM,
           sub_fleets: bool = True, min_tokens_per_s: float | None = None,
           charge: str = DEFAULT_CHARGE, max_searches: int | None = None) -> Candidate:
    """make_plan, returning the plan with its cost and the TP/recompute choice.

    ``charge`` prices the plans (cost_model.py, "Price": per-node or per-gpu); with objective
    "cost", ``min_tokens_per_s`` is the throughput floor the cheapest plan must reach
    (:func:`cheapest`; None: none, the degenerate cheapest plan) and ``max_searches`` its budget
    of throughput searches (module doc; None: the default); ``on_candidate`` then sees its
    result only, and ``sub_fleets`` applies to its whole-fleet fallback.

    For the re-planner (planner/replan.py): ``seeds`` are extra incumbents (plans of this
    cluster and batch, evaluated), ``baselines`` False skips the baseline plans (they cost
    seconds on large fleets; the seeds take their place), ``sub_fleets`` False skips the
    sub-fleet searches (:class:`SubFleets`; a re-plan trades iteration time for state moved
    anyway, and is on the recovery path), and ``on_candidate`` sees every plan the search
    judges that fits in memory (the warm-up post-pass then still changes the best one's plan
    in place).
    """
    if objective not in OBJECTIVES:
        raise ConfigError("<arguments>", "objective", f"got {objective!r}", ", ".join(OBJECTIVES))
    if not 0 < time_limit_s < math.inf:
        raise ConfigError("<arguments>", "time_limit_s", f"got {time_limit_s}",
                          "a finite number of seconds > 0")
    if min_tokens_per_s is not None and not (objective == "cost"
                                             and 0 < min_tokens_per_s < math.inf):
        raise ConfigError("<arguments>", "min_tokens_per_s", f"got {min_tokens_per_s} with "
                          f"objective {objective!r}", "a finite number > 0, with objective "
                          "'cost' (the throughput objective is as fast as it gets)")
    if max_searches is not None and not (objective == "cost" and max_searches >= 1):
        raise ConfigError("<arguments>", "max_searches", f"got {max_searches} with objective "
                          f"{objective!r}", "an integer >= 1, with objective 'cost'")
    check_charge(charge, "charge")
    deadline = clock() + time_limit_s
    if objective == "cost":
        best = cheapest(cluster, model, profile, global_batch_size, micro_batch_size, seq_length,
                        allow_asymmetric_tp=allow_asymmetric_tp,
                        activation_recompute=activation_recompute, deadline=deadline,
                        progress=progress, tp_degrees=tp_degrees, max_stages=max_stages,
                        seeds=seeds, baselines=baselines, work_budget=work_budget,
                        on_candidate=on_candidate, distributed_optimizer=distributed_optimizer,
                        memory_headroom=memory_headroom, min_tokens_per_s=min_tokens_per_s,
                        charge=charge, max_searches=max_searches, sub_fleets=sub_fleets)
    else:
        best = fastest_before(cluster, model, profile, global_batch_size, micro_batch_size,
                              seq_length, deadline, allow_asymmetric_tp=allow_asymmetric_tp,
                              activation_recompute=activation_recompute, progress=progress,
                              tp_degrees=tp_degrees, max_stages=max_stages, seeds=seeds,
                              baselines=baselines, work_budget=work_budget,
                              on_candidate=on_candidate,
                              distributed_optimizer=distributed_optimizer,
                              memory_headroom=memory_headroom, sub_fleets=sub_fleets,
                              charge=charge)
    record_profile(best.plan, profile)
    best.plan.objective, best.plan.min_tokens_per_s = objective, min_tokens_per_s
    return best


def fastest_before(cluster: Cluster, model: ModelSpec, profile: Profile | None,
                   global_batch_size: int, micro_batch_size: int, seq_length: int | None,
                   deadline: float, *, allow_asymmetric_tp: bool = False,
                   activation_recompute: bool | None = None, progress: bool = True,
                   tp_degrees: list[int] | None = None, max_stages: int | None = None,
                   seeds: Sequence[Candidate] = (), baselines: bool = True,
                   work_budget: int = WORK_BUDGET,
                   on_candidate: Callable[[Candidate], None] | None = None,
                   distributed_optimizer: bool = False,
                   memory_headroom: float = DEFAULT_MEMORY_HEADROOM,
                   sub_fleets: bool = True, charge: str = DEFAULT_CHARGE) -> Candidate:
    """search() with objective "throughput", its safety net a clock() ``deadline``;
    ``sub_fleets`` False searches the whole fleet only (:class:`SubFleets`: for a caller that
    searches every set of GPU types or nodes itself)."""
    seq_length = seq_length or model.seq_length
    profile = resolve_profile(cluster, model, profile, micro_batch_size, seq_length)
    problem = Problem(cluster, model, profile, global_batch_size, micro_batch_size, seq_length,
                      distributed_optimizer=distributed_optimizer,
                      memory_headroom=check_memory_headroom(memory_headroom), charge=charge)
    check_batch(problem)
    degrees = [t for t in model.valid_tp_degrees(max(n.num_gpus for n in cluster.nodes))
               if tp_degrees is None or t in tp_degrees]
    recompute_modes = [False, True] if activation_recompute is None else [activation_recompute]
    fleets = SubFleets(problem, degrees, recompute_modes, deadline, work_budget, max_stages,
                       allow_asymmetric_tp, baselines, sub_fleets)
    # (disable None: no bar where stderr is not a terminal, e.g. a job's log file)
    with tqdm(desc="planning", unit="branch", disable=None if progress else True, delay=0.5,
              leave=False) as fleets.bar:
        best = fleets.fastest(frozenset(n.gpu for n in cluster.nodes), seeds, on_candidate)
    if best is None:
        raise no_plan_fits(problem, degrees, recompute_modes)
    return dataclasses.replace(best, stopped_by=fleets.stopped_by, work=fleets.work)


class SubFleets:
    """The throughput search of a fleet and, as its incumbents, of every fleet it holds minus
    one GPU type (recursively, each set of types searched once): a fleet's plan is then never
    slower than the plan of any of its sub-fleets (it can leave the added GPUs idle, and does
    when that is faster), which the search's own space alone does not guarantee (its option
    and split heuristics, SCIP's node limit and the pruning tolerance depend on the pools).

    Each set of types is searched as a fleet of its own would be (same space, budget, its own
    baselines), so ``fastest(types)`` is the plan the search returns for that sub-fleet. A
    sub-fleet is searched only when its lower bound (:meth:`lower_bound_s`) is below the best
    plan found by then: otherwise its plan cannot be faster, so the guarantee holds without it
    (on three types of 1024 GPUs most sub-fleets without the fastest type are skipped so).
    Every search shares one wall-clock deadline; none starts after it.
    """

    def __init__(self, problem: Problem, degrees: list[int], recompute_modes: list[bool],
                 deadline: float, work_budget: int, max_stages: int | None,
                 allow_asymmetric_tp: bool, baselines: bool, recurse: bool = True):
        self.problem, self.degrees, self.recompute_modes = problem, degrees, recompute_modes
        self.deadline, self.work_budget, self.max_stages = deadline, work_budget, max_stages
        self.allow_asymmetric_tp, self.baselines = allow_asymmetric_tp, baselines
        self.recurse = recurse
        self.solved: dict[frozenset[str], Candidate | None] = {}
        self.work = 0
        self.stopped_by = STOP_COMPLETE
        self.bar = None

    def _stopped(self, why: str) -> None:
        if why != STOP_COMPLETE and self.stopped_by != STOP_TIME:
            self.stopped_by = why

    def fastest(self, types: frozenset[str], seeds: Sequence[Candidate] = (),
                on_candidate: Callable[[Candidate], None] | None = None) -> Candidate | None:
        """The plan of the fleet's nodes of these GPU types (None: none fits in memory)."""
        if types in self.solved:
            return self.solved[types]
        whole = self.problem.cluster
        whole_fleet = types == frozenset(n.gpu for n in whole.nodes)
        cluster = whole.subset([n.name for n in whole.nodes if n.gpu in types])
        problem = dataclasses.replace(self.problem, cluster=cluster)
        search_bb = BranchAndBound(problem, self.deadline, self.work_budget, self.max_stages,
                                   skip_needless_recompute=len(self.recompute_modes) > 1,
                                   on_candidate=on_candidate)
        for seed in seeds:
            search_bb.offer(seed)
        # The fleet's own baselines always run (the floor of the result); a sub-fleet's stop
        # at the safety net.
        out_of_time = (lambda: False) if whole_fleet else (lambda: clock() >= self.deadline)
        for baseline in all_baselines(problem, self.recompute_modes, tp_degrees=self.degrees,
                                      max_stages=self.max_stages, out_of_time=out_of_time
                                      ) if self.baselines else ():
            if baseline.plan is not None:
                plan = baseline.plan
                tp = {plan.ranks[s.ranks[0]].gpu: s.tp for p in plan.pipelines for s in p.stages}
                search_bb.offer(Candidate(plan, baseline.cost, tp, plan.activation_recompute))
        if search_bb.may_continue():
            self._search(problem, search_bb)
        self._stopped(search_bb.stopped_by)
        own = search_bb.best
        if own is not None and clock() < self.deadline:
            # Warmed up before the sub-fleets' plans (warmed up already) compete with it: judged
            # at standard depths it lost the bundled a100-h800-h20 fleet (GPT-3 1.3B, global
            # batch 64) to its A100 + H800 sub-fleet's plan, 0.2744 s warmed up, though it
            # was 0.2851 s against that plan's 0.2857 at standard depths and 0.2656 warmed up.
            plan, cost = choose_warmups(own.plan, own.cost, cluster, problem.profile,
                                        problem.memory_headroom, self.max_stages)
            search_bb.best = dataclasses.replace(own, plan=plan, cost=cost)
        elif own is not None:
            self._stopped(STOP_TIME)    # cut: the plan as judged, without the warm-up pass
        sub_plans: set[int] = set()     # plans of sub-fleets: warmed up already
        subs = sorted((self.lower_bound_s(types - {gpu}), gpu) for gpu in types
                      ) if self.recurse and len(types) > 1 else []
        for bound_s, gpu in subs:
            if search_bb.best is not None and bound_s >= search_bb.best.cost.iteration_time_s:
                break               # no plan of this sub-fleet (or the next) can be faster
            if clock() >= self.deadline:
                self._stopped(STOP_TIME)
                break
            sub = self.fastest(types - {gpu})
            if sub is not None:
                # Its iteration time on this fleet is the same (the cost model sees only the
                # nodes a plan uses); what this fleet adds, its idle GPUs, is priced when it
                # wins, or now when a caller sees every candidate.
                sub = self._costed(problem, sub) if on_candidate else sub
                sub_plans.add(id(sub.plan))
                search_bb.offer(sub)
        self.work += search_bb.work
        best = search_bb.best
        if best is not None and id(best.plan) in sub_plans:
            best = best if on_candidate else self._costed(problem, best)
        elif best is not None:
            best = dataclasses.replace(best, stopped_by=search_bb.stopped_by,
                                       work=search_bb.work)
        self.solved[types] = best
        return best

    @staticmethod
    def _costed(problem: Problem, sub: Candidate) -> Candidate:
        """A sub-fleet's plan costed on this fleet (a copy: the plan records its idle GPUs)."""
        plan = copy.deepcopy(sub.plan)
        return dataclasses.replace(sub, plan=plan, cost=evaluate(problem, plan))

    def lower_bound_s(self, types: frozenset[str]) -> float:
        """No plan of the fleet's nodes of these types is faster: the smallest fluid bound of
        its configs (the warm-up pass only reorders the same work, so it cannot beat it
        either); with asymmetric TP no bound (0)."""
        if self.allow_asymmetric_tp:
            return 0.0
        whole = self.problem.cluster
        problem = dataclasses.replace(self.problem, cluster=whole.subset(
            [n.name for n in whole.nodes if n.gpu in types]))
        configs = [make_config(problem, {g: t for g in types}, recompute)
                   for t in self.degrees for recompute in self.recompute_modes]
        return min((c.fluid_bound_s for c in configs if c is not None), default=math.inf)

    def _search(self, problem: Problem, search_bb: BranchAndBound) -> None:
        """The branch and bound of one fleet over its TP configs (module doc)."""
        cluster = problem.cluster
        gpus = list(dict.fromkeys(n.gpu for n in cluster.nodes))

        def configs_for(tp_of_gpu: dict[str, int]) -> list[Config]:
            configs = [make_config(problem, tp_of_gpu, recompute)
                       for recompute in self.recompute_modes]
            return [c for c in configs if c is not None]

        search_bb.run([c for t in self.degrees for c in configs_for({g: t for g in gpus})],
                      self.bar)
        if not self.allow_asymmetric_tp:
            return
        per_gpu = {g: [t for t in self.degrees
                       if any(n.num_gpus % t == 0 for n in cluster.nodes if n.gpu == g)]
                   for g in gpus}
        best = search_bb.best
        current = dict(best.tp_of_gpu) if best else {g: per_gpu[g][0] for g in gpus}
        for g in gpus:
            current.setdefault(g, per_gpu[g][0])
        improved = True
        while improved and search_bb.may_continue():
            improved = False
            for g in gpus:
                before = search_bb.best
                trials = [dict(current, **{g: t}) for t in per_gpu[g] if t != current[g]]
                search_bb.run([c for trial in trials for c in configs_for(trial)], self.bar)
                if search_bb.best is not before and search_bb.best is not None:
                    current.update(search_bb.best.tp_of_gpu)
                    improved = True


def no_plan_fits(problem: Problem, degrees: list[int], recompute_modes: list[bool]
                 ) -> ConfigError:
    """The error when no plan fits in memory: what was tried, and only the remedies that were
    not (no recompute suggested after recompute was tried, no TP degree after the widest)."""
    cluster, model = problem.cluster, problem.model
    tried = (f"TP degrees tried: {', '.join(map(str, degrees)) or 'none the nodes allow'}; "
             "activation recompute tried: "
             + " and ".join("on" if r else "off" for r in recompute_modes))
    remedies = ["more or larger GPUs"]
    wider = [t for t in model.valid_tp_degrees(max(n.num_gpus for n in cluster.nodes))
             if t > max(degrees, default=0)]
    if wider:
        remedies.append(f"a wider TP degree ({', '.join(map(str, wider))})")
    if True not in recompute_modes:
        remedies.append("activation recompute")
    if problem.micro_batch_size > 1:
        remedies.append(f"a micro-batch below {problem.micro_batch_size}")
    remedies.append(f"a sequence length below {problem.seq_length}")
    if problem.memory_headroom > 0:
        remedies.append(f"a memory headroom below {problem.memory_headroom}")
    return ConfigError(cluster.name, "nodes", f"no plan for {model.name} fits in memory with "
                       f"global batch {problem.global_batch_size} and micro-batch "
                       f"{problem.micro_batch_size} ({tried})", ", ".join(remedies))


def check_prices(cluster: Cluster, file=None, needed_by: str = "--objective cost") -> None:
    """Every node has a spot price (the cost objective prices every plan); ``file`` names the
    cluster file in the error (default: the cluster's name), ``needed_by`` what needs them."""
    for i, node in enumerate(cluster.nodes):
        if node.spot_price is None:
            raise ConfigError(file or cluster.name, f"nodes[{i}].spot_price",
                              f"node {node.name} has no price; {needed_by} needs one on every node",
                              "USD per GPU-hour, a number >= 0")


# ---- objective cost (module doc) -----------------------------------------------------------------

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
             **options) -> Candidate:
    """search() with objective "cost" (module doc): the plan with the fewest USD per million
    tokens among those reaching ``min_tokens_per_s`` (None: no floor), charged by ``charge``,
    running at most ``max_searches`` throughput searches (None: MAX_NODE_SETS per node, every
    set of GPU types and TP degree per GPU); ``sub_fleets`` is the whole-fleet fallback's
    (fastest_before). Raises :class:`FloorNotMet` when no plan reaches the floor."""
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
                                problem.memory_headroom, options.get("max_stages"), "cost")
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
    per-node terms of search.fluid_bound_s."""
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
        if clock() >= deadline:
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
