"""HAPT warm-up depths: a post-pass that lets stages before a slow link run ahead.

After the search has fixed a plan's pipelines, stages and micro-batch counts, each pipeline may
get per-stage 1F1B warm-up depths deeper than the standard ``S - s - 1`` (runtime/p2p.py runs
them; plan.py validates them). The search itself prices every pipeline with the blocking closed
form (cost_model.py), which has no warm-up in it; only the event-level simulation
(:func:`~megatron_autohet.cost_model.simulate_1f1b`) prices depths. So this is a separate pass,
applied to the best plan of both :func:`~megatron_autohet.planner.search.search` and the
exhaustive search, never to the baselines (Megatron-LM has no such option).

Per pipeline, greedy over "run ahead before boundary b": add ``extra`` micro-batches to the
depth of every stage 0..b (which keeps the depths valid: non-increasing, 0 on the last stage,
>= 1 before it, at most m), for ``extra`` in powers of two up to m, within each stage's GPU
memory (a depth w keeps ``min(w + 1, m)`` micro-batches of activations). Of the steps that
shorten the simulated makespan by more than MIN_GAIN, take the shallowest (fewest activations
held) among those within MIN_GAIN of the fastest; repeat while a step qualifies. The cost model
charges a pipeline with such depths its closed-form time minus the simulated saving over the
standard depths (cost_model.py, "Warm-up depth"); the depths are kept only for pipelines that
set the iteration time (others would hold activations for nothing), and only if the iteration
then gets shorter by MIN_GAIN, i.e. no pipeline left standard still sets it.

Why deeper warm-ups pay even on a fast link, and why the shallowest good step is taken
---------------------------------------------------------------------------------------
With unequal stage times a deeper warm-up also helps when the link is almost free, and that is
real 1F1B behaviour, not a simulation artefact. In steady state the standard depths already run
at the slowest stage's period (with free links every interval condition of cost_model's
"Warm-up depth" holds at ``P = max t_s``), but at start-up the 1F1B order makes a slow stage b
do the backward of micro-batch 0 after its ``w_b = S - b - 1`` warm-up forwards, and that
gradient needs the round trip through the stages after it, which with faster later stages
takes longer than ``w_b`` of b's forwards: b idles although it sets the pace. A deeper warm-up
fills that time with forwards it must do anyway (towards GPipe's order). Example (fleet-96,
GPT-3 1.3B, m = 47; f/b ms: 3.1/6.0, 3.0/6.0, three stages 3.9/6.6, 3.4/6.0, links free):
standard 540.9 ms, every stage +2 reaches 532.6 ms, the bound of the last slow stage working
without a gap (its predecessors' forwards + 47 x 10.5 + their backwards), which no order can
beat; the post-pass takes +1 (534.2 ms), within MIN_GAIN of it (tests/planner/test_planner.py).
The memory is the price: ``min(w + 1, m)`` micro-batches of activations. Taking simply the
fastest step picked depth 47 (all forwards first) on that pipeline with its real links
(0.07-0.67 ms per micro-batch), 0.9% faster than +2 (533.7 vs 538.4 ms) for 47 instead of 7
micro-batches held; differences that small are below what the model resolves (the simulation
itself assumes eager delivery; scripts/bench_hapt.py compares it with a measurement), so a step
must beat the shallower ones by MIN_GAIN to be taken.
"""

from __future__ import annotations

from megatron_autohet.cost_model import (DEFAULT_MEMORY_HEADROOM, GIB, PlanCost, annotate_plan,
                                         evaluate_plan, simulate_1f1b, stage_memory_bytes)
from megatron_autohet.plan import Plan, standard_warmup_depths
from megatron_autohet.profiling.profile import Profile
from megatron_autohet.spec.cluster import Cluster

# A depth change must shorten the simulated pipeline by more than this fraction.
MIN_GAIN = 0.01


def _max_depths(plan: Plan, pipeline: int, cost: PlanCost, profile: Profile) -> list[int]:
    """Deepest warm-up per stage whose activations still fit the GPU's memory."""
    pipe, pcost = plan.pipelines[pipeline], cost.pipelines[pipeline]
    m, S = pipe.num_microbatches, len(pipe.stages)
    out = []
    for s, (stage, scost) in enumerate(zip(pipe.stages, pcost.stages)):
        entry = profile.get(scost.gpu, scost.tp, plan.micro_batch_size, plan.seq_length)
        deepest = 0

        def kept(in_flight: int) -> float:
            return stage_memory_bytes(entry, plan.model, stage.num_layers, s == 0, s == S - 1,
                                      plan.activation_recompute, in_flight, profile.precision)

        for w in range(1, m + 1) if s < S - 1 else ():
            # the evaluated peak (every term the cost model counts) plus the added micro-batches
            memory = scost.memory_gib * GIB + kept(min(w + 1, m)) - kept(
                scost.in_flight_microbatches)
            if memory / GIB > scost.memory_limit_gib:
                break
            deepest = w
        out.append(deepest)
    return out


def best_warmups(stages, num_microbatches: int, max_depths: list[int]) -> tuple[list[int], float]:
    """Greedy depths for one pipeline (module doc) and their simulated makespan."""
    m, S = num_microbatches, len(stages)
    depths = standard_warmup_depths(S, m)
    # makespans only: the timelines are the cost model's, for the depths chosen
    best = simulate_1f1b(stages, m, depths, record=False)
    extras = sorted({1 << k for k in range(m.bit_length())} | {m})
    while True:
        steps = []                                   # (makespan, depths) that gain > MIN_GAIN
        for b in range(S - 1):
            for extra in extras:
                trial = [min(w + extra, m) if s <= b else w for s, w in enumerate(depths)]
                if trial == depths or any(w > cap for w, cap in zip(trial, max_depths)):
                    continue
                makespan = simulate_1f1b(stages, m, trial, record=False)
                if makespan < best * (1 - MIN_GAIN):
                    steps.append((makespan, trial))
        if not steps:
            return depths, best
        fastest = min(makespan for makespan, _ in steps)
        best, depths = min((step for step in steps if step[0] <= fastest * (1 + MIN_GAIN)),
                           key=lambda step: (sum(step[1]), step[0]))


def choose_warmups(plan: Plan, cost: PlanCost, cluster: Cluster, profile: Profile,
                   memory_headroom: float = DEFAULT_MEMORY_HEADROOM) -> tuple[Plan, PlanCost]:
    """The plan with HAPT depths where they shorten the iteration (module doc), and its cost;
    the plan and cost unchanged when they do not."""
    chosen: dict[int, tuple[list[int], float]] = {}       # pipeline -> depths, priced time
    cache: dict[tuple, tuple[list[int], float] | None] = {}   # depths, simulated saving
    for p, (pipe, pcost) in enumerate(zip(plan.pipelines, cost.pipelines)):
        if len(pipe.stages) < 2 or pcost.time_s < cost.pipeline_time_s * (1 - MIN_GAIN):
            continue                       # no boundary, or not setting the iteration time
        caps = _max_depths(plan, p, cost, profile)
        key = (tuple((s.forward_s, s.backward_s, s.p2p_s) for s in pcost.stages),
               pipe.num_microbatches, tuple(caps))
        if key not in cache:
            standard = simulate_1f1b(pcost.stages, pipe.num_microbatches, record=False)
            depths, makespan = best_warmups(pcost.stages, pipe.num_microbatches, caps)
            cache[key] = ((depths, standard - makespan) if makespan < standard * (1 - MIN_GAIN)
                          else None)
        if cache[key] is not None:
            depths, saving = cache[key]
            chosen[p] = (depths, pcost.time_s - saving)
    if not chosen:
        return plan, cost
    slowest_other = max((pc.time_s for p, pc in enumerate(cost.pipelines) if p not in chosen),
                        default=0.0)
    slowest_chosen = max(t for _, t in chosen.values())
    if max(slowest_other, slowest_chosen) >= cost.pipeline_time_s * (1 - MIN_GAIN):
        return plan, cost                  # a pipeline left standard still sets the time
    for p, (depths, _) in chosen.items():
        for stage, w in zip(plan.pipelines[p].stages, depths):
            stage.warmup_microbatches = w
    plan.validate()
    new_cost = evaluate_plan(plan, cluster, profile, with_timeline=False,
                             memory_headroom=memory_headroom, charge=cost.charge)
    annotate_plan(plan, new_cost)
    return plan, new_cost
