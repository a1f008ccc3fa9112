"""The branch and bound over the SCIP composition model: the fastest composition of one fleet's
pipeline options (steps 3, 4 and 6 of the search, throughput_search.py).

The iteration time of a plan is ``max_p T_pipe(p) + sync(D) + optimizer`` (cost_model.py): the
longest pipeline plus the gradient sync and optimizer step of the busiest stages, where the sync
depends on the number of pipelines D. The configs and their options (options.py) fix what
couples pipelines non-linearly; this module enumerates the rest and leaves an exact integer
program to SCIP (scip_model.py):

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
6. **Node-local sync**: the branches price every layer's gradient sync over its pool's NIC,
   but with few pipelines the holders of a layer can share a node. Two closed-form families
   cover that and are judged by the cost model when a config is built: stacks of D <=
   MAX_STACK identical pipelines, each stage's sync at its own nodes' intra-node link (the tied
   embedding too when both ends are on one pool), judged per D in the order of that bound
   until it reaches the best plan (:meth:`BranchAndBound._stacks`), and every pair of options
   that fits the pools (drawn from every option built, not only those kept: the ones a lower
   bound leaves a chance), with the layers both hold on one pool synced at the intra-node rate
   (:meth:`BranchAndBound._pairs`).
   tests/planner/test_planner_optimality.py checks the result against the exhaustive search on
   random small fleets: within 1% on every one.

The work it does is counted in SCIP branch-and-bound nodes (each solve at least one, at most
scip_model.SOLVE_NODE_LIMIT), checked against the work budget between branches; the wall-clock
safety net is checked there too, before every SCIP solve, each block of stage sequences of an
option build, every block of the pair pricing and every stacked plan costed
(throughput_search.py, "Deterministic budget").
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from megatron_autohet.planner import candidate
from megatron_autohet.planner.candidate import STOP_COMPLETE, STOP_TIME, STOP_WORK, Candidate
from megatron_autohet.planner.options import Config, build_options
from megatron_autohet.planner.scip_model import BOUND_TOLERANCE, Composition, CompositionModel
from megatron_autohet.planner.space import (OptionTable, PipelineOption, Problem,
                                            assign_microbatches, build_plan, evaluate,
                                            layer_sync_s, ring_factor)
from megatron_autohet.planner.warmup import WARMED_UP_PLANS

# Pipeline-count bins: exact below 5; above, the bin's smallest count prices the sync (its ring
# factor 2 (D-1)/D is then at most ~4% below the bin's largest).
PIPELINE_BINS = ((1, 1), (2, 2), (3, 3), (4, 4), (5, 6), (7, 9), (10, 16), (17, 32), (33, 64),
                 (65, 128), (129, 256), (257, 512), (513, 1 << 30))
# Sync + optimizer levels: a geometric grid this far apart (options are grouped by the level at
# or above their own value; the bounds use the exact values, and the plans are judged exactly).
LEVEL_RATIO = 1.02
# Stop when no branch's lower bound is this much below the best plan.
PRUNE_TOLERANCE = 1e-3
# Two-pipeline plans with node-local layer sync judged by the cost model per config.
PAIRS_TRIED = 3
# Elements of the pair matrix (and of the per-pair layer arrays) priced at once.
PAIR_BLOCK_ELEMENTS = 1 << 20
# Stacks of up to this many identical pipelines are tried with their stages sharing nodes,
# the best few options per stack height judged by the cost model.
MAX_STACK = 4
STACKS_TRIED = 3
MAX_STACKS_JUDGED = 24
# The most options the pairs are drawn from (BranchAndBound._pair_options).
MAX_PAIR_OPTIONS = 512


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
        extras = np.array(levels_at(config, lo))
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


def levels_at(config: Config, pipelines: int) -> list[float]:
    """Each option's sync + optimizer level (grid value) with this many pipelines, cached on
    the config."""
    if pipelines not in config.levels:
        config.levels[pipelines] = [_level(e) for e in config.table.extras_s(pipelines)]
    return config.levels[pipelines]


def _level(value: float) -> float:
    """The grid point at or above ``value`` (LEVEL_RATIO apart)."""
    if value <= 0:
        return 0.0
    return LEVEL_RATIO ** math.ceil(math.log(value) / math.log(LEVEL_RATIO) - 1e-9)


def _layout(cand: Candidate) -> tuple:
    """What tells two candidates' plans apart: the GPUs, each stage's ranks and layers, each
    pipeline's micro-batches, the recompute choice (a plan found again by another solve is one
    plan)."""
    plan = cand.plan
    return (plan.activation_recompute, tuple((r.node, r.local_rank) for r in plan.ranks), tuple(
        (p.num_microbatches, tuple((tuple(s.ranks), s.layers) for s in p.stages))
        for p in plan.pipelines))


class BranchAndBound:
    """Best-first search over the branches of several configs (module doc)."""

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
        # The best few distinct plans offered, fastest first (ties: the first offered): the
        # warm-up pass's input (warmup.py, "The best few"); ``best`` is the first until the
        # pass replaces it.
        self.best_few: list[Candidate] = []
        self.built: dict[tuple, Config] = {}
        self.solves = 0

    def may_continue(self, models: dict | None = None) -> bool:
        """False once the work budget or the wall-clock safety net is spent (and why, in
        ``stopped_by``; the work budget is checked first, so it decides whenever both are)."""
        live = sum(m.nodes for m in models.values()) if models else 0
        if self.work + live >= self.work_budget:
            self.stopped_by = STOP_WORK
        elif candidate.clock() >= self.deadline or (models and any(
                m.timed_out for m in models.values())):
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
        few = self.best_few
        if len(few) == WARMED_UP_PLANS and \
                cand.cost.iteration_time_s >= few[-1].cost.iteration_time_s:
            return
        key = _layout(cand)
        if any(_layout(c) == key for c in few):
            return
        at = next((i for i, c in enumerate(few)
                   if cand.cost.iteration_time_s < c.cost.iteration_time_s), len(few))
        few.insert(at, cand)
        del few[WARMED_UP_PLANS:]

    def _build(self, config: Config) -> bool:
        """Build a config's options when the search reaches it; False when it has none, when
        it is the recompute twin of a config that memory never limited (recompute only adds
        time there), or when the safety net cut the building."""
        twin = self.built.get((config.key[0], False))
        if config.recompute and self.skip_needless_recompute and twin is not None \
                and not twin.memory_bound:
            return False
        if not build_options(self.problem, config, self.max_stages,
                             lambda: candidate.clock() >= self.deadline):
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
            allowed = [e <= br.level_s for e in levels_at(config, lo)]
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
        NIC). Closed form: per D, the options in the order of a lower bound on their stack's
        iteration time (makespan plus the sync at its node-local bound, OptionTable.
        local_extras_s: each stage's layers, and the tied embedding where both ends are on one
        pool, at its nodes' intra-node rate; plus the optimizer step), judged by the cost model
        like every other candidate until the bound reaches the best plan: at least
        STACKS_TRIED, at most MAX_STACKS_JUDGED per D."""
        M, pools, table = self.problem.num_microbatches, config.pools, config.table
        use = np.array([[o.pools.count(k) for k in range(len(pools))] for o in config.options])
        counts = np.array([p.count for p in pools])
        per_node = np.array([p.groups_per_node for p in pools])
        for d in range(2, min(MAX_STACK, M) + 1):
            stackable = ((d * use <= counts) & ((use == 0) | (d <= per_node))).all(axis=1)
            stackable &= np.array([o.cap(M) * d >= M for o in config.options], dtype=bool)
            # a lower bound on each stack's iteration time: its makespan and its sync at the
            # node-local bound (each stage's d copies on one node; the tied embedding's 2d
            # holders too when both ends are on one pool), so stacks are judged in its order
            # until the bound reaches the best plan (at least STACKS_TRIED, at most
            # MAX_STACKS_JUDGED): a stack whose tied embedding syncs inside a node, priced at
            # the NIC, had been ranked out of the few judged
            bound = (table.fill_s + (math.ceil(M / d) - 1) * table.period_s
                     + table.local_extras_s(d))
            order = np.flatnonzero(stackable)
            order = order[np.argsort(bound[order], kind="stable")]
            for n, j in enumerate(order[:MAX_STACKS_JUDGED].tolist()):
                best_s = self.best.cost.iteration_time_s if self.best else math.inf
                if n >= STACKS_TRIED and bound[j] >= best_s * (1 - PRUNE_TOLERANCE):
                    break
                if candidate.clock() >= self.deadline:
                    return          # each plan costs a tenth of a second on 4096 GPUs
                self.offer(self._candidate(config, Composition(
                    [d if i == j else 0 for i in range(len(config.options))], 0.0)))

    def _pairs(self, config: Config) -> None:
        """Two-pipeline plans whose layer-wise sync may stay inside a node: a layer both
        pipelines hold on one pool of 2+ TP groups per node syncs over NVLink once placement
        puts the two stages together (the SCIP branches price every layer over the NIC). Every
        pair of options that fits the pools is priced in closed form: the best two-way
        micro-batch split (the crossing point of the two pipelines' times, rounded both ways),
        plus the busier pipeline's sync with the co-held layers at the intra-node rate, plus the
        slower optimizer step; the PAIRS_TRIED best are judged by the cost model."""
        problem, pools = self.problem, config.pools
        M, L = problem.num_microbatches, problem.model.num_layers
        saving = np.array([layer_sync_s(problem, p) * (
            1 - problem.sync_bandwidth_gbs(p) / max(problem.sync_bandwidth_gbs(p), p.intra_gbs))
            if p.groups_per_node >= 2 else 0.0 for p in pools])
        best_s = self.best.cost.iteration_time_s if self.best else math.inf
        options, table = self._pair_options(config, saving, best_s)
        n = len(options)
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
            if candidate.clock() >= self.deadline:
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
            self.offer(self._candidate_of(config, [options[i], options[j]]))

    def _pair_options(self, config: Config, saving: np.ndarray, best_s: float
                      ) -> tuple[list[PipelineOption], OptionTable]:
        """The options the pairs are drawn from: every option the config built, not only
        those kept for the SCIP model (options.py keeps one per GPU-count vector and pipeline
        count, but a pair that co-holds its layers on one node may want two of one vector:
        two 3-stage pipelines on 6 GPUs of two types, the pair 5.7% faster after the warm-up
        pass than the best of the options kept), less those whose lower bound (beside the
        best partner of all, with every layer co-held) cannot beat ``best_s``: at most
        MAX_PAIR_OPTIONS, the smallest bounds first, and the kept options always."""
        built, at = config.built, config.stage_pools
        if built is None:
            return config.options, config.table
        full = built.table
        width = full.shared.shape[1]
        tied_factor = np.where(full.multi_stage, ring_factor(4), ring_factor(2))
        floor = (ring_factor(2) * (full.shared - built.layers[:, :width]
                                   * saving[np.maximum(at, 0)])
                 + tied_factor[:, None] * full.tied).max(axis=1)
        fill_min, period_min = full.fill_s.min(), full.period_s.min()
        crossing = (fill_min - full.fill_s + full.period_s + (self.problem.num_microbatches - 1)
                    * period_min) / (full.period_s + period_min)
        M = self.problem.num_microbatches
        span = np.full(len(crossing), math.inf)
        for m in (np.floor(crossing), np.ceil(crossing)):
            m = np.clip(m, 1, M - 1)
            span = np.minimum(span, np.maximum(full.fill_s + (m - 1) * full.period_s,
                                               fill_min + (M - m - 1) * period_min))
        bound = span + full.optimizer_s + floor
        live = np.flatnonzero(bound < best_s * (1 + 1e-9))
        live = live[np.argsort(bound[live], kind="stable")][:MAX_PAIR_OPTIONS]
        chosen = np.union1d(live, config.kept)
        return [built.option(j) for j in chosen.tolist()], full.subset(chosen, self.problem)

    def _model(self, config: Config, bin_index: int) -> CompositionModel:
        lo, hi = PIPELINE_BINS[bin_index]
        groups = sum(p.count for p in config.pools)
        M = self.problem.num_microbatches
        return CompositionModel(config.options, [p.count for p in config.pools], M,
                                (lo, min(hi, M, groups)),
                                lambda: self.deadline - candidate.clock())

    def _candidate(self, config: Config, comp: Composition) -> Candidate | None:
        """The plan of a composition, judged by the cost model (None: its pipelines' micro-batch
        caps cannot take the batch)."""
        pipelines = [o for o, x in zip(config.options, comp.multiplicities) for _ in range(x)]
        return self._candidate_of(config, pipelines)

    def _candidate_of(self, config: Config, pipelines: list[PipelineOption]
                      ) -> Candidate | None:
        """The plan of these pipelines (options of ``config``), judged by the cost model."""
        problem = self.problem
        if sum(o.cap(problem.num_microbatches) for o in pipelines) < problem.num_microbatches:
            return None
        counts = assign_microbatches(pipelines, problem.num_microbatches)
        plan = build_plan(problem, config.pools, pipelines, counts, config.recompute)
        cost = evaluate(problem, plan)
        return Candidate(plan, cost, {p.gpu: p.tp for p in config.pools}, config.recompute)

