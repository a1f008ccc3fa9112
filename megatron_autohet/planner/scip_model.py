"""The SCIP model: how many pipelines of each shape, and the time they finish a global batch in.

Given candidate pipeline options j (a stage sequence over TP-group pools with a layer split, see
planner/space.py), an iteration of a plan made of ``x_j`` pipelines of each option takes

    T = max over pipelines of (fill_j + (m_p - 1) period_j)  +  sync(D)  +  optimizer

where D = sum_j x_j and the last two terms are maxima over the stages of the chosen options
(cost_model.py). The search (planner/branch_and_bound.py) fixes the coupling terms outside this
model: a range of D and a level E on sync + optimizer (options above the level are excluded).
What is left is a parametric integer program in the pipeline makespan tau: a pipeline of option j
finishes at most ``cap_j(tau) = floor((tau - fill_j) / period_j) + 1`` micro-batches by tau, so

    exists x integer >= 0 with   sum_j n_jk x_j <= G_k      for every pool k (idle groups allowed)
                                 D_lo <= sum_j x_j <= D_hi  (pipeline count; one micro-batch each)
                                 sum_j cap_j(tau) x_j >= M  (the global batch is finished by tau)

is monotone in tau, and :meth:`CompositionModel.min_makespan` finds the smallest tau by
bisection, solving at each tau a SCIP model of the columns that can matter there (objective
``cap_j(tau)``, maximised; dominated options left out, :class:`CompositionModel`). SCIP stops
at the first solution reaching M (objective limit), and after every feasible solve the upper
end of the bracket drops to the composition's own exact makespan (greedy micro-batch split), so
a handful of solves suffice. A search that only needs to beat an incumbent asks first at that
cut-off: one infeasible solve ends it. Identical pipelines share one variable, which removes
their permutation symmetry; the number of GPUs only changes the right-hand sides G_k.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from pyscipopt import SCIP_PARAMSETTING, Model, quicksum

from megatron_autohet.planner.space import PipelineOption, assign_microbatches

INF = float("inf")
# Bisection stops when the bracket is this tight relative to the iteration time it is part of.
RELATIVE_TOLERANCE = 1e-3
# ... and this tight when only a lower bound is wanted.
BOUND_TOLERANCE = 2e-2
# One feasibility solve explores at most this many branch-and-bound nodes; a solve that finds no
# composition within them counts as infeasible (the bisection then only stops higher than it
# could). A node limit, not a time limit, so that a loaded machine gets the same answers.
SOLVE_NODE_LIMIT = 2000
# Safety net only (a solve that hangs): wall-clock seconds one solve may take, and never more
# than the search has left. A solve cut by it, or not started because no time was left, is
# reported (``timed_out``), since its answer then depends on the machine's speed.
SOLVE_TIME_SAFETY_S = 30.0


@dataclass
class Composition:
    multiplicities: list[int]      # x_j per option
    makespan_s: float              # longest pipeline under the best micro-batch split


def makespan_s(options: list[PipelineOption], multiplicities: list[int], total: int,
               offsets: list[float] | None = None) -> float:
    """Longest pipeline (plus its option's offset) under the best micro-batch split."""
    offsets = offsets or [0.0] * len(options)
    pipelines = [(o, d) for o, d, x in zip(options, offsets, multiplicities) for _ in range(x)]
    counts = assign_microbatches([o for o, _ in pipelines], total, [d for _, d in pipelines])
    return max(o.time_s(m) + d for (o, d), m in zip(pipelines, counts))


class CompositionModel:
    """The composition problem over the options and a pipeline-count range, re-parameterised by
    tau and by which options are allowed.

    Each solve builds a small SCIP model of only the columns that can matter at that tau: of the
    allowed options with the same GPU-count vector the one finishing the most micro-batches, and
    of those only the ones no vector using at most as many GPUs of every pool (and finishing at
    least as many) dominates. Both reductions are exact: swapping a pipeline of a dropped option
    for its dominating one keeps every row satisfied. A model of thousands of options then solves
    tens of columns, about 20x faster than re-solving the full model.
    """

    def __init__(self, options: list[PipelineOption], pool_counts: list[int],
                 total_microbatches: int, pipelines: tuple[int, int],
                 time_left: Callable[[], float] = lambda: INF):
        self.options = options
        self.time_left = time_left      # wall-clock seconds the search has left
        self.total = total_microbatches
        self.pool_counts = pool_counts
        self.pipelines = (pipelines[0], min(pipelines[1], total_microbatches))
        self.solves = 0
        self.nodes = 0              # branch-and-bound nodes over all solves: the search's work
        self.timed_out = False      # some solve was cut by the wall-clock safety net
        self._scip: Model | None = None
        # GPU groups each option takes from every pool, and which options share that vector.
        self.usage = np.array([[o.pools.count(k) for k in range(len(pool_counts))]
                               for o in options], dtype=np.int64).reshape(len(options), -1)
        _, self.vector_of = np.unique(self.usage, axis=0, return_inverse=True)
        self.vector_of = self.vector_of.reshape(-1)
        self.fill_s = np.array([o.fill_s for o in options])
        self.period_s = np.array([o.period_s for o in options])
        self.max_microbatches = np.array([
            total_microbatches if o.max_microbatches is None else min(total_microbatches,
                                                                      o.max_microbatches)
            for o in options], dtype=np.int64)

    def capacities(self, tau: float | None, offsets: list[float] | None) -> np.ndarray:
        """Micro-batches each option's pipeline finishes by ``tau - offsets[j]`` (None: no
        limit): the most m with ``fill + (m - 1) period`` within it, at most its cap (0: not
        even one)."""
        if tau is None:
            return self.max_microbatches.copy()
        limit = tau - (np.asarray(offsets) if offsets is not None else 0.0)
        slack = limit - self.fill_s
        runs = np.floor(np.maximum(slack, 0.0) / self.period_s + 1e-9).astype(np.int64) + 1
        return np.where(slack < -1e-12, 0, np.minimum(runs, self.max_microbatches))

    def columns(self, allowed: list[bool], caps: np.ndarray) -> np.ndarray:
        """The options a solve needs (class doc): per GPU-count vector the allowed option with
        the largest capacity, without the dominated vectors."""
        live = np.flatnonzero(np.asarray(allowed, dtype=bool) & (caps > 0))
        if not len(live):
            return live
        # Sort by vector, then capacity descending (stable: ties keep the lowest index).
        order = live[np.lexsort((-caps[live], self.vector_of[live]))]
        vectors = self.vector_of[order]
        first = order[np.concatenate(([True], vectors[1:] != vectors[:-1]))]
        use, cap = self.usage[first], caps[first]
        # Column w dominates v: no more of any pool (distinct vectors, so fewer of some) and at
        # least v's capacity.
        dominates = (use[:, None, :] <= use[None, :, :]).all(axis=2) & (
            cap[:, None] >= cap[None, :])
        np.fill_diagonal(dominates, False)
        return first[~dominates.any(axis=0)]

    def feasible(self, allowed: list[bool], tau: float | None,
                 offsets: list[float] | None = None) -> list[int] | None:
        """A composition of allowed options finishing all micro-batches by ``tau`` (None: no
        limit on tau; option j's pipelines must finish by ``tau - offsets[j]``), or None."""
        left = self.time_left()
        if left <= 0:
            self.timed_out = True
            return None
        caps = self.capacities(tau, offsets)
        self.solves += 1
        cols = self.columns(allowed, caps)
        low, high = self.pipelines
        # Cheap refusal before SCIP: even every pipeline on the most productive column (with no
        # pool limit) cannot reach the batch.
        if not len(cols) or int(caps[cols].max()) * high < self.total:
            self.nodes += 1
            return None
        # One SCIP instance per composition model, its problem replaced at each solve: creating
        # an instance (loading SCIP's plugins) cost as much as solving these small models.
        if self._scip is None:
            self._scip = Model("autohet-composition")
        else:
            self._scip.freeProb()
            self._scip.createProbBasic("autohet-composition")
        m = self._scip
        m.hideOutput()
        # Deterministic limits: the same model gives the same answer on any machine and load
        # (SCIP runs single-threaded with a fixed random seed by default).
        m.setParam("limits/nodes", SOLVE_NODE_LIMIT)
        m.setParam("limits/time", min(SOLVE_TIME_SAFETY_S, left))
        # Small model, solved once: presolving and cutting planes cost more than they save.
        m.setPresolve(SCIP_PARAMSETTING.OFF)
        m.setSeparating(SCIP_PARAMSETTING.OFF)
        m.setHeuristics(SCIP_PARAMSETTING.FAST)
        x = []
        for j in cols:
            use = self.usage[j]
            ub = min([high] + [self.pool_counts[k] // n for k, n in enumerate(use) if n])
            x.append(m.addVar(f"x{j}", vtype="I", lb=0, ub=ub))
        for k, count in enumerate(self.pool_counts):
            users = [(int(self.usage[j, k]), v) for j, v in zip(cols, x) if self.usage[j, k]]
            if users:
                m.addCons(quicksum(n * v for n, v in users) <= count, name=f"pool{k}")
        m.addCons(quicksum(x) <= high, name="pipes_max")
        m.addCons(quicksum(x) >= low, name="pipes_min")
        m.setObjective(quicksum(int(caps[j]) * v for j, v in zip(cols, x)), "maximize")
        m.setObjlimit(self.total - 0.5)
        m.setParam("limits/solutions", 1)
        m.optimize()
        self.nodes += max(1, m.getNNodes())
        self.timed_out |= m.getStatus() == "timelimit"
        if m.getNSols() == 0:
            return None
        sol = m.getBestSol()
        counts = [0] * len(self.options)
        for j, v in zip(cols, x):
            counts[j] = int(round(m.getSolVal(sol, v)))
        if sum(int(caps[j]) * n for j, n in enumerate(counts)) < self.total:
            return None
        return counts

    def min_makespan(self, allowed: list[bool], lower_s: float, known: Composition | None,
                     give_up_above_s: float, tolerance: float = RELATIVE_TOLERANCE,
                     offsets: list[float] | None = None) -> tuple[Composition | None, float]:
        """The composition of allowed options with the smallest makespan (within the relative
        tolerance), starting from a known feasible one if any, and a proven lower bound on that
        makespan. The composition is None when none exists or the makespan provably cannot be
        below ``give_up_above_s``. With ``offsets`` option j's pipelines count as finishing
        ``offsets[j]`` later."""
        best, lo = known, lower_s
        if best is None or best.makespan_s >= give_up_above_s:
            # First ask whether anything beats the cut-off at all: most branches of a search
            # end here, after one solve.
            cut = give_up_above_s * (1 - RELATIVE_TOLERANCE) if give_up_above_s < INF else None
            if cut is not None and cut < lo:
                return None, lo
            x = self.feasible(allowed, cut, offsets)
            if x is None:
                return None, INF if cut is None else max(lo, cut)
            best = Composition(x, makespan_s(self.options, x, self.total, offsets))
        hi = best.makespan_s
        while hi - lo > tolerance * hi and lo < give_up_above_s and not self.timed_out:
            mid = 0.5 * (lo + hi)
            x = self.feasible(allowed, mid, offsets)
            if x is None:
                lo = mid
            else:
                best = Composition(x, makespan_s(self.options, x, self.total, offsets))
                hi = min(mid, best.makespan_s)
        return (best if best.makespan_s < give_up_above_s else None), lo
