"""Virtual pipeline stages: a post-pass that gives the pipelines setting the iteration time v
model chunks per stage (megatron-core's interleaved 1F1B) where the cost model prices a gain.

The search prices every pipeline at one chunk per stage. With v chunks a micro-batch passes the
stages v times, each pass a v-th of the stage's compute: the fill and drain of the pipeline are
v times shorter, the transfers v times as many, and the last stage sends each micro-batch round
to the first (cost_model.py, "Interleaved pipelines"); the first stages hold more micro-batches
of activations. So it pays where the bubble dominates (few micro-batches per stage, cheap links)
and costs where transfers dominate. The pass therefore runs after the search has fixed the
stages, layers and micro-batches (the option count stays the search's), on the chosen plan:

* a pipeline may take v (in VIRTUAL_STAGES) where megatron's interleaved schedule runs it (at
  least 2 stages, its micro-batches a multiple of its stages) and every stage has at least v
  layers, cut into v chunks as equal as they go (the larger first; the cost model prices a
  pass at a stage's largest chunk); never on a plan that overlaps its gradient reduce (the
  runtime refuses the two together, plan.check_overlap_grad_reduce);
* only the pipelines within MIN_GAIN of the iteration's longest are tried, and a v only where
  a lower bound of its time (the closed form with the plain pipeline's transfers, without the
  ring's closing one) is below the pipeline's by MIN_GAIN: a fleet where interleaving cannot
  pay costs no evaluation and keeps its plan as it was, byte for byte;
* each pipeline keeps the v of its shortest evaluated time whose stages fit in memory, and the
  plan is kept only if every pipeline tried gains MIN_GAIN and the plan's rank (the
  objective's) improves by MIN_GAIN; the other pipelines keep one chunk (they do not set the
  time: more chunks would only hold more activations).

An interleaved pipeline runs megatron's own warm-up, so a pipeline given v loses the HAPT depths
of the warm-up pass (planner/warmup.py); the plan is kept only when it beats the warmed-up one.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

from megatron_autohet.cost_model import PlanCost, annotate_plan, evaluate_plan, pipeline_time_s
from megatron_autohet.plan import Pipeline, Plan, Stage
from megatron_autohet.planner.warmup import MIN_GAIN, shortest_iteration
from megatron_autohet.profiling.profile import Profile
from megatron_autohet.spec.cluster import Cluster

# The chunks per stage the pass prices besides one (megatron's interleaved schedule allows any;
# each doubling halves the bubble again for twice the transfers, past 4 the transfers win on
# every fleet the repository plans).
VIRTUAL_STAGES = (2, 4)


def interleavable(pipe: Pipeline, v: int) -> bool:
    """Whether the pipeline can run ``v`` chunks per stage under megatron's interleaved
    schedule (plan.py, "Interleaved pipelines"): each chunk at least one layer."""
    n = len(pipe.stages)
    return (n >= 2 and pipe.num_microbatches % n == 0
            and all(stage.num_layers >= v for stage in pipe.stages))


def interleaved(pipe: Pipeline, v: int) -> Pipeline:
    """The pipeline with each stage's layers cut into ``v`` chunks as equal as they go, the
    larger first: virtual stage ``c * n + s`` (chunk c of stage s) covers the next layers in
    model order, so every stage keeps its layer count; ``v`` 1 gives the plain pipeline of
    those counts."""
    chunks: list[list[tuple[int, int]]] = [[] for _ in pipe.stages]
    start = 0
    for c in range(v):
        for s, stage in enumerate(pipe.stages):
            size = _chunk_sizes(stage.num_layers, v)[c]
            chunks[s].append((start, start + size))
            start += size
    stages = [Stage(list(stage.ranks), chunk[0], virtual_layers=tuple(chunk[1:]))
              for stage, chunk in zip(pipe.stages, chunks)]
    return Pipeline(stages, pipe.num_microbatches, v)


def _chunk_sizes(layers: int, v: int) -> list[int]:
    return [layers // v + (c < layers % v) for c in range(v)]


def _pass_share(layers: int, v: int) -> float:
    """The largest chunk's share of a stage's layers (cost_model.py prices a pass at it)."""
    return _chunk_sizes(layers, v)[0] / layers


def _fits(pcost) -> bool:
    return all(s.memory_gib <= s.memory_limit_gib for s in pcost.stages)


def choose_virtual_stages(plan: Plan, cost: PlanCost, cluster: Cluster, profile: Profile,
                          memory_headroom: float,
                          rank: Callable[[PlanCost], tuple[float, ...]] = shortest_iteration,
                          meets: Callable[[PlanCost], bool] = lambda cost: True,
                          choices: tuple[int, ...] = VIRTUAL_STAGES) -> tuple[Plan, PlanCost]:
    """The plan with virtual stages where they improve its ``rank`` by MIN_GAIN and it still
    ``meets`` the objective (module doc), and its cost: a new plan, or ``plan`` and ``cost``
    themselves (never changed)."""
    if plan.overlap_grad_reduce:
        return plan, cost
    setting = cost.pipeline_time_s * (1 - MIN_GAIN)
    tries: dict[int, list[int]] = {}          # v -> the pipelines it may shorten
    for p, (pipe, pcost) in enumerate(zip(plan.pipelines, cost.pipelines)):
        if pcost.time_s < setting:
            continue                          # not setting the iteration time
        m = pipe.num_microbatches
        gains = [v for v in choices if interleavable(pipe, v) and pipeline_time_s(
            [sc.time_s * _pass_share(st.num_layers, v) + sc.p2p_s
             for st, sc in zip(pipe.stages, pcost.stages)], m, v)
            < pcost.time_s * (1 - MIN_GAIN)]
        if not gains:
            return plan, cost                 # a pipeline setting the time cannot gain
        for v in gains:
            tries.setdefault(v, []).append(p)
    # each pipeline's best (time, v) among the evaluated plans; one chunk as the plan prices it
    best = {p: (cost.pipelines[p].time_s, 1) for ps in tries.values() for p in ps}
    for v, pipelines in sorted(tries.items()):
        trial = _with_chunks(plan, {p: v for p in pipelines})
        trial_cost = evaluate_plan(trial, cluster, profile, with_timeline=False,
                                   memory_headroom=memory_headroom, charge=cost.charge)
        for p in pipelines:
            pcost = trial_cost.pipelines[p]
            if _fits(pcost) and pcost.time_s < best[p][0]:
                best[p] = (pcost.time_s, v)
    chosen = {p: v for p, (_, v) in best.items() if v > 1}
    if len(chosen) < len(best):
        return plan, cost                     # a pipeline setting the time gains nothing
    longest = max([t for t, _ in best.values()]
                  + [pc.time_s for p, pc in enumerate(cost.pipelines) if p not in best])
    # (a pipeline left at one chunk sets the time where it is the longest: no gain, below)
    new = _with_chunks(plan, chosen)
    new_cost = evaluate_plan(new, cluster, profile, with_timeline=False,
                             memory_headroom=memory_headroom, charge=cost.charge)
    if (longest >= setting or not new_cost.fits_memory or not meets(new_cost)
            or rank(new_cost)[0] >= rank(cost)[0] * (1 - MIN_GAIN)):
        return plan, cost
    annotate_plan(new, new_cost)
    return new, new_cost


def _with_chunks(plan: Plan, chunks: dict[int, int]) -> Plan:
    """A copy of the plan with pipeline p cut into ``chunks[p]`` chunks per stage."""
    new = copy.deepcopy(plan)
    new.pipelines = [interleaved(pipe, chunks[p]) if p in chunks else pipe
                     for p, pipe in enumerate(new.pipelines)]
    new.predicted = {}
    new.validate()
    return new
