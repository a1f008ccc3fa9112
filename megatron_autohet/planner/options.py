"""The pipeline options of a config: which stage sequences the search prices, and which of their
layer splits it keeps (steps 1-2 of the search, throughput_search.py).

space.py prices what is asked of it (a sequence's stage terms, its layer splits, the options'
arrays); this module decides what to ask: the configs, the stage sequences of each and the
options kept per GPU-count vector.

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
   :func:`sequence_options`).

Why every order, not a dominance rule: a pipeline's time ``fill + (m - 1) period`` does not
depend on the order of its stages (fill is their sum, period their maximum); the order changes
only (a) the links between stages, (b) which stages carry the embedding and the output layer
(the ends), (c) the tied embedding's link (inside a node when the first and last runs of one
pool fit it together) and (d) memory, since stage s keeps ``S - s`` micro-batches in flight.
(d) can part a type's stages: a fast type short of memory wants late stages, which keep few
micro-batches in flight, a type with memory to spare early ones, and the output layer's logits
may fit on neither. (a) orders one-GPU nodes with their own NICs (each a pool) by their links: a
pipeline over five of them is fastest in one of the 120 orders of five pools, 9.5% faster than
the best contiguous pipeline (tests/planner/test_planner_optimality.py). Where no memory binds,
every node's intra-node link is at least its NIC and the ends' runs of one pool fill at most one
node, an interleaved order is no better than a contiguous one with the same end stages (an
argument, checked by the exhaustive search only up to five stages): each pool's run has at least
as many intra-node links as its stages had apart, its other links cross its own NIC where an
interleaved stage crosses the slower of two NICs, and the run orders include every pair of end
pools. So depths that take every order are exact (tests/planner/test_planner_optimality.py
checks the planner against the exhaustive search on random small fleets and on that five-pool
pipeline); deeper pipelines rest on that argument under those three conditions and are a
heuristic otherwise, since the orders grow as K^S (five pools of 8+ groups: 3125 orders of 5
stages, 390,625 of 8). A pool is one kind of node (GPU type, size, intra-node link, NIC), so the
links an option is priced with are the ones its stages get. Where memory limits a split, the
splits that fit only when the pipeline runs m < S micro-batches (1F1B then keeps m in flight on
its first stages) are options of their own, capped at m micro-batches in the SCIP model and the
micro-batch split.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from megatron_autohet.cost_model import stage_compute_s, stage_memory_bytes
from megatron_autohet.planner.space import (OptionTable, PipelineOption, Pool, Problem,
                                            SequenceOptions, make_pools, sequence_options,
                                            sequence_terms)

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
# Pipeline counts for which each GPU-count vector keeps its best option.
KEEP_FOR_COUNTS = (1, 2, 4, 8, 32, 1024)
# ... and for which it keeps its best option with the sync at its node-local lower bound
# (OptionTable.local_extras_s): the stacks of branch_and_bound.py (up to its MAX_STACK = 4
# pipelines), its pairs, and 8 pipelines on 8-GPU nodes.
LOCAL_COUNTS = (2, 3, 4, 8)


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
    for d in sorted({*KEEP_FOR_COUNTS, *LOCAL_COUNTS}):
        share = math.ceil(total / d)
        # every sync over the sync link, and (where it differs) at its lower bound where the
        # copies of a layer can share a node: stacks and pairs sync there (branch_and_bound.py,
        # step 6), and an option priced at the NIC alone was dropped though a stack of it was
        # the optimum (tests/planner/test_option_pruning.py)
        sync = [table.extras_s(d)] if d in KEEP_FOR_COUNTS else []
        if d in LOCAL_COUNTS and table.node_local is not None:
            local = table.local_extras_s(d)
            sync += [local] if not sync or (local != sync[0]).any() else []
        for extras in sync:
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
    # Each option's sync + optimizer level per pipeline count: the branch and bound's cache
    # (branch_and_bound.levels_at).
    levels: dict[int, list[float]] = dataclasses.field(default_factory=dict)
    # Every option built (kept or not), each stage's pool (-1: padding) and which were kept:
    # the pairs of branch_and_bound.py draw from them.
    built: SequenceOptions | None = None
    stage_pools: np.ndarray | None = None
    kept: np.ndarray | None = None

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
    stage_pools = np.full((len(sequences), built.layers.shape[1]), -1)
    for i, (seq, _) in enumerate(sequences):
        stage_pools[i, :len(seq)] = seq
    built.table.with_node_local(pools, stage_pools[built.sequence], problem)
    # Groups of equal GPU-count vector and cap, numbered by first appearance (entry order).
    keys = np.column_stack([np.concatenate([b[3] for b in blocks])[order], cap_of[order]])
    _, first, inverse = np.unique(keys, axis=0, return_index=True, return_inverse=True)
    group_of = np.argsort(np.argsort(first))[inverse.reshape(-1)]
    caps = np.where(cap_of[order] == 0, np.iinfo(np.int64).max, cap_of[order])
    kept = _keep_best(built.table, group_of[built.sequence], caps[built.sequence], problem)
    config.options = [built.option(j) for j in kept]
    config.table = built.table.subset(kept, problem)
    config.built, config.stage_pools, config.kept = built, stage_pools[built.sequence], kept
    return True

