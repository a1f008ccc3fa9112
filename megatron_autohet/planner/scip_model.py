"""The SCIP model: how many pipelines of each shape, and the time they finish a global batch in.

Given candidate pipeline options j (a stage sequence over TP-group pools with a layer split, see
planner/space.py), an iteration of a plan made of ``x_j`` pipelines of each option takes

    T = max over pipelines of (fill_j + (m_p - 1) period_j)  +  sync(D)  +  optimizer

where D = sum_j x_j and the last two terms are maxima over the stages of the chosen options
(cost_model.py). The search (planner/search.py) fixes the coupling terms outside this model: a
range of D and a level E on sync + optimizer (options above the level are excluded). What is
left is a parametric integer program in the pipeline makespan tau: a pipeline of option j
finishes at most ``cap_j(tau) = floor((tau - fill_j) / period_j) + 1`` micro-batches by tau, so

    exists x integer >= 0 with   sum_j n_jk x_j <= G_k      for every pool k (idle groups allowed)
                                 D_lo <= sum_j x_j <= D_hi  (pipeline count; one micro-batch each)
                                 sum_j cap_j(tau) x_j >= M  (the global batch is finished by tau)

is monotone in tau, and :meth:`CompositionModel.min_makespan` finds the smallest tau by
bisection, re-solving one SCIP model whose objective coefficients (``cap_j(tau)``, maximised) and
variable bounds change between solves. SCIP stops at the first solution reaching M (objective
limit), and after every feasible solve the upper end of the bracket drops to the composition's
own exact makespan (greedy micro-batch split), so a handful of solves suffice. A search that
only needs to beat an incumbent asks first at that cut-off: one infeasible solve ends it. Identical
pipelines share one variable, which removes their permutation symmetry; the number of GPUs only
changes the right-hand sides G_k.
"""

from __future__ import annotations

from dataclasses import dataclass

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
# Safety net only (a solve that hangs): wall-clock seconds one solve may take. A solve cut by it
# is reported (``timed_out``), since its answer then depends on the machine's speed.
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
    """One SCIP model over the options and a pipeline-count range, re-parameterised by tau and
    by which options are allowed."""

    def __init__(self, options: list[PipelineOption], pool_counts: list[int],
                 total_microbatches: int, pipelines: tuple[int, int]):
        self.options = options
        self.total = total_microbatches
        self.solves = 0
        self.nodes = 0              # branch-and-bound nodes over all solves: the search's work
        self.timed_out = False      # some solve was cut by the wall-clock safety net
        low, high = pipelines
        self.model = Model("autohet-composition")
        self.model.hideOutput()
        # Deterministic limits: the same model gives the same answer on any machine and load
        # (SCIP runs single-threaded with a fixed random seed by default).
        self.model.setParam("limits/nodes", SOLVE_NODE_LIMIT)
        self.model.setParam("limits/time", SOLVE_TIME_SAFETY_S)
        # Small model, re-solved many times: presolving and cutting planes cost more per solve
        # than they save.
        self.model.setPresolve(SCIP_PARAMSETTING.OFF)
        self.model.setSeparating(SCIP_PARAMSETTING.OFF)
        self.model.setHeuristics(SCIP_PARAMSETTING.FAST)
        self.upper = []
        for o in options:
            ub = min(high, total_microbatches)
            for k in set(o.pools):
                ub = min(ub, pool_counts[k] // o.pools.count(k))
            self.upper.append(ub)
        self.x = [self.model.addVar(f"x{j}", vtype="I", lb=0, ub=self.upper[j])
                  for j in range(len(options))]
        for k, count in enumerate(pool_counts):
            users = [(o.pools.count(k), self.x[j]) for j, o in enumerate(options) if k in o.pools]
            if users:
                self.model.addCons(quicksum(n * v for n, v in users) <= count, name=f"pool{k}")
        self.model.addCons(quicksum(self.x) <= min(high, total_microbatches), name="pipes_max")
        self.model.addCons(quicksum(self.x) >= low, name="pipes_min")

    def feasible(self, allowed: list[bool], tau: float | None,
                 offsets: list[float] | None = None) -> list[int] | None:
        """A composition of allowed options finishing all micro-batches by ``tau`` (None: no
        limit on tau; option j's pipelines must finish by ``tau - offsets[j]``), or None."""
        m = self.model
        m.freeTransform()
        offsets = offsets or [0.0] * len(self.options)
        caps = [min(self.total, o.capacity(tau - d)) if tau is not None else o.cap(self.total)
                for o, d in zip(self.options, offsets)]
        for j, v in enumerate(self.x):
            m.chgVarUb(v, self.upper[j] if allowed[j] and caps[j] > 0 else 0)
        m.setObjective(quicksum(c * v for c, v in zip(caps, self.x) if c > 0), "maximize")
        m.setObjlimit(self.total - 0.5)
        m.setParam("limits/solutions", 1)
        self.solves += 1
        m.optimize()
        self.nodes += max(1, m.getNNodes())
        self.timed_out |= m.getStatus() == "timelimit"
        if m.getNSols() == 0:
            return None
        sol = m.getBestSol()
        x = [int(round(m.getSolVal(sol, v))) for v in self.x]
        if sum(c * n for c, n in zip(caps, x)) < self.total:
            return None
        return x

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
        while hi - lo > tolerance * hi and lo < give_up_above_s:
            mid = 0.5 * (lo + hi)
            x = self.feasible(allowed, mid, offsets)
            if x is None:
                lo = mid
            else:
                best = Composition(x, makespan_s(self.options, x, self.total, offsets))
                hi = min(mid, best.makespan_s)
        return (best if best.makespan_s < give_up_above_s else None), lo
