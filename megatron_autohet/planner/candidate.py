"""What every search returns, and how its end is told: :class:`Candidate`, the stop reasons,
the safety net's clock.

The branch and bound (branch_and_bound.py), the throughput search (throughput_search.py), the
cost search (cost_search.py), the re-planner and the exhaustive oracle all hand plans around
as candidates: a plan with its cost-model verdict, the TP and recompute choice it was built
from and how the search that found it ended. The search's budget is counted in work (SCIP
nodes), so a plan depends on the machine only where the wall-clock safety net cut the search
(throughput_search.py, "Deterministic budget"), which ``stopped_by`` then says.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from megatron_autohet.cost_model import PlanCost
from megatron_autohet.plan import Plan

# Why a search stopped (Candidate.stopped_by).
STOP_COMPLETE, STOP_WORK, STOP_TIME = "complete", "work budget", "time limit"
STOP_SETS = "search budget"       # the cost objective's ``max_searches`` (cost_search.py)
# The wall clock of the safety net (a module attribute, so tests can play a loaded machine;
# every search module reads it through this module).
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

