"""The planner: from a cluster, a model and a profile to a plan (and baselines to compare with).

``make_plan``   the SCIP-based search (planner/search.py; the model itself in scip_model.py)
``compare``     our plan against the Megatron-LM, Whale-style and homogeneous baselines
``exhaustive``  brute-force search of the same plan space for small clusters (tests, benchmark)
"""

from megatron_autohet.planner.compare import BaselineResult, Comparison, compare
from megatron_autohet.planner.search import Candidate, make_plan, search

__all__ = ["make_plan", "search", "Candidate", "compare", "Comparison", "BaselineResult"]
