"""The SCIP model: how many pipelines of each shape, and the iteration time they reach.

Given candidate pipeline options j (a stage sequence over TP-group pools with a layer split, see
planner/space.py) the model chooses integer multiplicities ``x_j`` (identical pipelines share one
variable, which removes their permutation symmetry) such that

    sum_j n_jk x_j  = G_k         for every pool k   (every TP group of the fleet is used once)
    D_min <= sum_j x_j <= min(D_max, M)              (pipeline count; each gets a micro-batch)

and the pipelines finish the M micro-batches of a global batch as early as possible. A pipeline
of option j that runs m micro-batches ends (with its gradient sync and optimizer estimate) at
``fill_j + (m - 1) period_j + extra_j``, so by a time limit T it finishes at most
``cap_j(T) = floor((T - fill_j - extra_j) / period_j) + 1`` micro-batches. Minimising T is a
parametric problem: for fixed T, "max sum_j cap_j(T) x_j >= M ?" is an integer program, and its
answer is monotone in T. :func:`solve_composition` bisects T, re-solving one SCIP model whose
objective coefficients and bounds change between solves; SCIP stops at the first composition that
reaches M (objective limit), so each feasibility solve is cheap. After every feasible solve the
upper bound drops to the composition's own achieved time, which makes the bisection converge in a
handful of solves.
"""

from __future__ import annotations

from dataclasses import dataclass

from pyscipopt import SCIP_PARAMSETTING, Model, quicksum

from megatron_autohet.planner.space import PipelineOption, assign_microbatches

# Bisection stops when the bracket is this tight (relative): well inside the 2% optimality target.
RELATIVE_TOLERANCE = 2e-3


@dataclass
class Composition:
    multiplicities: list[int]      # x_j per option
    surrogate_time_s: float        # max over pipelines of T_pipe + extra
    solves: int                    # SCIP solves used


def composition_time_s(options: list[PipelineOption], multiplicities: list[int],
                       total_microbatches: int) -> float:
    pipelines = [o for o, x in zip(options, multiplicities) for _ in range(x)]
    counts = assign_microbatches(pipelines, total_microbatches, include_extra=True)
    return max(o.time_s(m) + o.extra_s for o, m in zip(pipelines, counts))


class CompositionModel:
    """One SCIP model over the options, re-parameterised by the time limit T."""

    def __init__(self, options: list[PipelineOption], pool_counts: list[int],
                 total_microbatches: int, time_limit_s: float,
                 pipelines: tuple[int, int | None] = (1, None)):
        self.options = options
        self.total = total_microbatches
        self.model = Model("autohet-composition")
        self.model.hideOutput()
        self.model.setParam("limits/time", max(1.0, time_limit_s))
        # The model is small and re-solved a dozen times: presolving and cutting planes cost
        # more per solve than they save (measured: 30 ms -> 2-15 ms per solve for 500 options).
        self.model.setPresolve(SCIP_PARAMSETTING.OFF)
        self.model.setSeparating(SCIP_PARAMSETTING.OFF)
        self.model.setHeuristics(SCIP_PARAMSETTING.FAST)
        self.upper = []
        for j, o in enumerate(options):
            ub = total_microbatches
            for k in set(o.pools):
                ub = min(ub, pool_counts[k] // o.pools.count(k))
            self.upper.append(ub)
        self.x = [self.model.addVar(f"x{j}", vtype="I", lb=0, ub=self.upper[j])
                  for j in range(len(options))]
        for k, count in enumerate(pool_counts):
            self.model.addCons(quicksum(o.pools.count(k) * self.x[j]
                                        for j, o in enumerate(options) if k in o.pools) == count,
                               name=f"pool{k}")
        low, high = pipelines
        high = total_microbatches if high is None else min(high, total_microbatches)
        self.model.addCons(quicksum(self.x) <= high, name="pipelines_max")
        self.model.addCons(quicksum(self.x) >= low, name="pipelines_min")

    def solve(self, time_limit: float | None) -> list[int] | None:
        """A composition reaching all micro-batches within ``time_limit`` (None: no time limit)."""
        m = self.model
        m.freeTransform()
        caps = [o.capacity(time_limit) if time_limit is not None else self.total
                for o in self.options]
        for j, v in enumerate(self.x):
            m.chgVarUb(v, self.upper[j] if caps[j] > 0 else 0)
        m.setObjective(quicksum(min(c, self.total) * v for c, v in zip(caps, self.x)), "maximize")
        m.setObjlimit(self.total - 0.5)
        m.setParam("limits/solutions", 1)
        m.optimize()
        if m.getNSols() == 0:
            return None
        sol = m.getBestSol()
        value = sum(min(c, self.total) * round(m.getSolVal(sol, v)) for c, v in zip(caps, self.x))
        if value < self.total:
            return None
        return [int(round(m.getSolVal(sol, v))) for v in self.x]


def fluid_lower_bound_s(options: list[PipelineOption], pool_counts: list[int],
                        total_microbatches: int) -> float:
    """A lower bound on the surrogate time of any composition of these options.

    A pipeline of option j with S_j stages running m micro-batches takes at least m * period_j,
    so within T it runs at most T / period_j; charged to its TP groups that is at most
    ``r_k = max_j 1 / (S_j period_j)`` micro-batches per second per group of pool k, hence
    ``M <= T * sum_k G_k r_k``.
    """
    if not options:
        return float("inf")
    rate = [0.0] * len(pool_counts)
    for o in options:
        per_group = 1.0 / (len(o.pools) * o.period_s)
        for k in set(o.pools):
            rate[k] = max(rate[k], per_group)
    if any(g and r == 0.0 for g, r in zip(pool_counts, rate)):
        return float("inf")       # some GPUs fit in no pipeline at all
    throughput = sum(g * r for g, r in zip(pool_counts, rate))
    return total_microbatches / throughput + min(o.extra_s for o in options)


def solve_composition(options: list[PipelineOption], pool_counts: list[int],
                      total_microbatches: int, time_limit_s: float = 30.0,
                      pipelines: tuple[int, int | None] = (1, None)) -> Composition | None:
    """The composition with the smallest surrogate time whose pipeline count lies in
    ``pipelines`` (min, max or None); None when no composition covers the pools."""
    if not options:
        return None
    cm = CompositionModel(options, pool_counts, total_microbatches, time_limit_s, pipelines)
    best = cm.solve(None)
    solves = 1
    if best is None:
        return None
    hi = composition_time_s(options, best, total_microbatches)
    lo = max(min(o.fill_s + o.extra_s for o in options),
             fluid_lower_bound_s(options, pool_counts, total_microbatches))
    while hi - lo > RELATIVE_TOLERANCE * hi:
        mid = 0.5 * (lo + hi)
        x = cm.solve(mid)
        solves += 1
        if x is None:
            lo = mid
        else:
            best = x
            hi = min(mid, composition_time_s(options, x, total_microbatches))
    return Composition(best, composition_time_s(options, best, total_microbatches), solves)
