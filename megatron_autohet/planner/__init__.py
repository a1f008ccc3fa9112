"""The planner: from a cluster, a model and a profile to a plan (and baselines to compare with).

``search``             the entry points, ``make_plan`` and ``search``, for any objective
``objective``          what a plan is chosen for: throughput or cost, one class each
``throughput_search``  the fastest plan of a fleet, never slower than its sub-fleets' plans
``cost_search``        the cheapest plan reaching a throughput floor, over node sets or GPU types
``options``            a config's pipeline options: the stage sequences priced and those kept
``branch_and_bound``   best-first branch and bound over the configs, the SCIP model in each
``scip_model``         the SCIP composition model: how many pipelines of each option
``space``              the plan space's building blocks: pools, option pricing, placement
``candidate``          what every search returns (plan, cost, how its search ended)
``warmup``             the HAPT warm-up post-pass on the best plan
``interleave``         the virtual-stage post-pass: v model chunks per stage where they pay
``baselines``          Megatron-LM, Whale-style and homogeneous plans, the search's first incumbents
``compare``            our plan against those baselines, judged by the same cost model
``replan``             the plan after a fleet change, moving little training state
``state_moves``        where the training state lies, and what a new plan's recovery moves
``adapt``              whether a running job should switch to the plan of what it measured:
                       gain, switch cost amortised over the iterations left, hysteresis
``adapt_process``      each window's re-plan search in a child process, off the training's
                       critical path
(the brute-force search of the same space for small clusters, the yardstick for tests and the
benchmark, is testing/exhaustive.py)
"""

from megatron_autohet.planner.candidate import Candidate
from megatron_autohet.planner.compare import BaselineResult, Comparison, compare
from megatron_autohet.planner.search import make_plan, search

__all__ = ["make_plan", "search", "Candidate", "compare", "Comparison", "BaselineResult"]
