"""Synthetic measurement windows: what a plan's ranks would measure on a fleet whose GPUs run
at given speeds (the cost model's stage times, no wall clock), as runtime/stage_drift.py's
WindowReport."""

from megatron_autohet.cost_model import evaluate_plan
from megatron_autohet.planner.space import resolve_profile
from megatron_autohet.runtime.stage_drift import PHASES, window_report


def synthetic_window(plan, cluster, first, last, profile=None, scale=1.0):
    """The window ``plan``'s ranks measure on ``cluster`` (its ``speeds`` the truth): each
    rank's compute median per iteration is its stage's priced time times its micro-batches
    (times ``scale``: GPUs that all run ``scale`` times slower than priced, as a CPU does)."""
    resolved = resolve_profile(cluster, plan.model, profile, plan.micro_batch_size,
                               plan.seq_length)
    cost = evaluate_plan(plan, cluster, resolved, with_timeline=False)
    medians = [[0.0] * len(PHASES) for _ in plan.ranks]
    for pipe, pcost in zip(plan.pipelines, cost.pipelines):
        for stage, scost in zip(pipe.stages, pcost.stages):
            for r in stage.ranks:
                medians[r][0] = scost.time_s * pipe.num_microbatches * scale
    return window_report(plan, first, last, medians)
