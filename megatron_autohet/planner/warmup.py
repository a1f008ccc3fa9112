"""HAPT warm-up depths: a post-pass that lets stages before a slow link run ahead.

After the search has fixed a plan's pipelines, stages and micro-batch counts, each pipeline may
get per-stage 1F1B warm-up depths deeper than the standard ``S - s - 1`` (runtime/p2p.py runs
them; plan.py validates them). The search itself prices every pipeline with the blocking closed
form (cost_model.py), which has no warm-up in it; only the event-level simulation
(:func:`~megatron_autohet.cost_model.simulate_1f1b`) prices depths. So this is a separate pass,
applied to the best few plans of :func:`~megatron_autohet.planner.search.search` ("The best
few" below) and to the best plan of the exhaustive search, never to the baselines (Megatron-LM
has no such option).

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

Neighbours: other splits, orders and one stage more. The search optimises the closed form, and
deeper warm-ups can favour plans it ranks equal or slightly behind, so where it is cheap (at most
NEIGHBOURS_UP_TO: small models, short pipelines, few micro-batches) the pass also warms up the
plans next to the search's and keeps the fastest:
* every layer split of the pipelines that set the iteration time (one split per group of them
  with the same stage types: one pipeline alone re-split leaves its twins setting the time).
  On an odd-count random fleet (seed 20 of testing/random_fleets.odd_case: one slow GPU, then
  three fast ones over a 3.5 GB/s NIC) the search's split 1/5/3/3 (0.85% slower than the best
  at standard depths) gains nothing from deeper warm-ups, while 1/5/4/2 is 7.7% faster with them;
* where one pipeline sets the time: that pipeline with the GPUs of two of its stages swapped,
  with every layer split (seed 288: two one-GPU nodes of one type behind 4.7 and 10.4 GB/s NICs
  in the other order, 1.3% faster warmed up), and where the fleet has idle GPUs, with one idle
  TP group (one per node: a node's groups are alike) as an extra stage at each position, with
  every layer split (seed 73: a 3-stage pipeline and a 4-stage one with a GPU behind a 2.2 GB/s
  NIC are equal at standard depths, 0.0415 s; warmed up the 4-stage one is 2.3% faster).
The micro-batch counts stay the search's.

The best few: the pass warms up the WARMED_UP_PLANS best distinct plans a search judged (at
standard depths, best first; :func:`warm_up_best`), the best one with its neighbours (theirs
would multiply the pass's cost on small fleets), and keeps the fastest result. Warming up the
best plan alone made the result depend on which plan the closed form ranks first, so a faster
link could give a slower plan: one 8-GPU node each of A100-80GB, H800, H20 and L40S, a
30-layer GPT-3 1.3B, global batch 64: 0.3049 s at 25 GB/s, 0.3121 s at 50 GB/s, where the
search's best (0.3167 s at standard depths) gains 1.5% warmed up and its second (0.3201 s, the
25 GB/s plan's layout) 6.4%, to 0.2996 s (tests/planner/test_bandwidth_monotone.py). The result
is never slower than the pass on the best plan alone. The exhaustive search (the tests'
yardstick) warms up its closed-form optimum alone: warming up its best 8 made it beat the
search by 1.2% on a 6-layer model whose search judges fewer plans
(tests/planner/test_planner.py, measured activation bytes).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

from megatron_autohet.cost_model import (DEFAULT_MEMORY_HEADROOM, GIB, PlanCost, annotate_plan,
                                         evaluate_plan, simulate_1f1b, stage_memory_bytes)
from megatron_autohet.plan import Pipeline, Plan, RankInfo, Stage, standard_warmup_depths
from megatron_autohet.profiling.profile import Profile
from megatron_autohet.spec.cluster import Cluster, Device

# A depth change must shorten the simulated pipeline by more than this fraction.
MIN_GAIN = 0.01
# The neighbours (module doc) are tried while their work, plans evaluated x the plan's
# micro-batches (what evaluating and simulating a plan's pipelines costs), is at most this: every
# split of a 4-stage pipeline of 10 layers with its stage pairs swapped and an idle GPU inserted,
# 5 micro-batches (odd-count seed 288, testing/random_fleets.py), about 1.4 CPU-s; not on large
# fleets or batches, where each trial costs the most (fleet-96, 512 micro-batches).
NEIGHBOURS_UP_TO = 10_000
# The searches' best this many distinct plans at standard depths get the pass (module doc,
# "The best few").
WARMED_UP_PLANS = 8


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


def makespan_floor(stages, num_microbatches: int) -> float:
    """No 1F1B order of these stages, at any warm-up depths, finishes sooner: stage s cannot
    start before micro-batch 0 has run through the stages before it, is then busy for its m
    forwards and backwards, and its last backward's gradient must still go back through them
    (each op at its stage's time, each message at half its boundary's ``p2p_s``, as
    simulate_1f1b prices them). Less a margin of 1e-9, so that float rounding in its sums
    (which the simulation adds in another order) never puts it above a simulated makespan."""
    ahead = behind = 0.0
    floor = 0.0
    for st in stages:
        floor = max(floor, ahead + num_microbatches * (st.forward_s + st.backward_s) + behind)
        ahead += st.forward_s + st.p2p_s / 2
        behind += st.backward_s + st.p2p_s / 2
    return floor * (1 - 1e-9)


def best_warmups(stages, num_microbatches: int, max_depths: list[int]) -> tuple[list[int], float]:
    """Greedy depths for one pipeline (module doc) and their simulated makespan."""
    depths, makespan = _best_warmups(_times_of(stages), num_microbatches, tuple(max_depths))
    return list(depths), makespan


class _Times(NamedTuple):
    """What simulate_1f1b reads of a stage when it records no timeline."""
    forward_s: float
    backward_s: float
    p2p_s: float


def _times_of(stages) -> tuple[_Times, ...]:
    return tuple(_Times(st.forward_s, st.backward_s, st.p2p_s) for st in stages)


# The pass's simulations and greedy results are pure functions of the stage times, the
# micro-batches and the depths (or caps), and a search warms up many plans that share
# pipelines (its best few, their neighbours, the sub-fleets' plans): each is computed once per
# process.
@functools.lru_cache(maxsize=1 << 16)
def _makespan(times: tuple[_Times, ...], m: int, depths: tuple[int, ...]) -> float:
    return simulate_1f1b(list(times), m, list(depths), record=False)


@functools.lru_cache(maxsize=1 << 12)
def _best_warmups(times: tuple[_Times, ...], m: int, max_depths: tuple[int, ...]
                  ) -> tuple[tuple[int, ...], float]:
    S = len(times)
    depths = standard_warmup_depths(S, m)
    # makespans only: the timelines are the cost model's, for the depths chosen
    best = _makespan(times, m, tuple(depths))
    extras = sorted({1 << k for k in range(m.bit_length())} | {m})
    # No step can gain MIN_GAIN once the makespan is that close to the floor: the last round,
    # which simulates every step to find none, is skipped then.
    floor = makespan_floor(times, m)
    while True:
        if floor >= best * (1 - MIN_GAIN):
            return tuple(depths), best
        steps = []                                   # (makespan, depths) that gain > MIN_GAIN
        for b in range(S - 1):
            for extra in extras:
                trial = [min(w + extra, m) if s <= b else w for s, w in enumerate(depths)]
                if trial == depths or any(w > cap for w, cap in zip(trial, max_depths)):
                    continue
                makespan = _makespan(times, m, tuple(trial))
                if makespan < best * (1 - MIN_GAIN):
                    steps.append((makespan, trial))
        if not steps:
            return tuple(depths), best
        fastest = min(makespan for makespan, _ in steps)
        best, depths = min((step for step in steps if step[0] <= fastest * (1 + MIN_GAIN)),
                           key=lambda step: (sum(step[1]), step[0]))


def shortest_iteration(cost: PlanCost) -> tuple[float, ...]:
    """The throughput search's rank of a plan (its own pass, for no objective but speed)."""
    return (cost.iteration_time_s,)


def choose_warmups(plan: Plan, cost: PlanCost, cluster: Cluster, profile: Profile,
                   memory_headroom: float = DEFAULT_MEMORY_HEADROOM,
                   max_stages: int | None = None,
                   rank: Callable[[PlanCost], tuple[float, ...]] = shortest_iteration,
                   neighbours: bool = True) -> tuple[Plan, PlanCost]:
    """The plan with HAPT depths where they shorten the iteration, or the best of its
    neighbours warmed up where that is cheap (module doc; none deeper than ``max_stages``), and
    its cost: a new plan; ``plan`` and ``cost`` themselves when none is better (``plan`` is
    never changed). Better: a smaller ``rank`` (the objective's, planner/objective.py
    Objective.rank; default: the shorter iteration; with the cost objective fewer USD per
    million tokens: a neighbour with one stage more may pay for a GPU the search left idle).
    ``neighbours`` False: the depths alone (the neighbours move layers and GPUs)."""
    _, plan, cost = warm_up_best([(plan, cost)], cluster, profile, memory_headroom, max_stages,
                                 rank, neighbours)
    return plan, cost


def warm_up_best(ranked: Sequence[tuple[Plan, PlanCost]], cluster: Cluster, profile: Profile,
                 memory_headroom: float = DEFAULT_MEMORY_HEADROOM,
                 max_stages: int | None = None,
                 rank: Callable[[PlanCost], tuple[float, ...]] = shortest_iteration,
                 neighbours: bool = True) -> tuple[int, Plan, PlanCost]:
    """:func:`choose_warmups` over a search's best few plans (module doc, "The best few"),
    ``ranked`` best first by ``rank`` at standard depths, the neighbours for the first one
    only: the index of the plan whose warmed-up plan (or neighbour) ranks best, that plan and
    its cost (the first plan itself when nothing beats it; a tie keeps the earlier plan)."""
    best = (0, *ranked[0])
    for index, (plan, cost) in enumerate(ranked):
        warmed = _warmed(plan, cost, cluster, profile, memory_headroom)
        for trial in _neighbours(plan, cost, cluster, max_stages) if neighbours and index == 0 \
                else ():
            trial_cost = evaluate_plan(trial, cluster, profile, with_timeline=False,
                                       memory_headroom=memory_headroom, charge=cost.charge)
            if not trial_cost.fits_memory:
                continue
            trial, trial_cost = _warmed(trial, trial_cost, cluster, profile, memory_headroom)
            if rank(trial_cost) < rank(warmed[1]):
                warmed = trial, trial_cost
        if rank(warmed[1]) < rank(best[2]):
            best = (index, *warmed)
    index, plan, cost = best
    if plan is not ranked[index][0]:
        annotate_plan(plan, cost)
    return best


def _neighbours(plan: Plan, cost: PlanCost, cluster: Cluster,
                max_stages: int | None) -> Iterator[Plan]:
    """The re-split plans, then those with two stages' GPUs swapped, then those with one stage
    more (module doc), each kind only while the work so far stays within NEIGHBOURS_UP_TO."""
    L, M = plan.model.num_layers, plan.num_microbatches_total
    groups: dict[tuple, list[int]] = {}         # time-setting pipelines by stage types
    for p, (pipe, pcost) in enumerate(zip(plan.pipelines, cost.pipelines)):
        if pcost.time_s >= cost.pipeline_time_s * (1 - MIN_GAIN):
            groups.setdefault(tuple((plan.ranks[s.ranks[0]].gpu, s.tp) for s in pipe.stages),
                              []).append(p)
    resplits = [g for g in groups.values() if len(plan.pipelines[g[0]].stages) >= 2]
    work = M * sum(math.comb(L - 1, len(plan.pipelines[g[0]].stages) - 1) for g in resplits)
    if work > NEIGHBOURS_UP_TO:
        return
    for group in resplits:
        for bounds in _bounds(L, len(plan.pipelines[group[0]].stages)):
            yield _resplit(plan, group, bounds)
    if len(groups) != 1 or len(next(iter(groups.values()))) != 1:
        return
    (p,), = groups.values()
    stages = plan.pipelines[p].stages
    S, tps = len(stages), {s.tp for s in stages}
    node = [plan.ranks[s.ranks[0]].node for s in stages]
    pairs = [(i, j) for i, j in itertools.combinations(range(S), 2)
             if stages[i].tp == stages[j].tp and node[i] != node[j]]
    work += M * len(pairs) * math.comb(L - 1, S - 1)
    if work > NEIGHBOURS_UP_TO:
        return
    for pair in pairs:
        for bounds in _bounds(L, S):
            yield _resplit(plan, [p], bounds, pair)
    deeper = S < L and (max_stages is None or S < max_stages)
    idle = _idle_groups(plan, cluster, tps.pop()) if len(tps) == 1 and deeper else []
    work += M * len(idle) * (S + 1) * math.comb(L - 1, S)
    if not idle or work > NEIGHBOURS_UP_TO:
        return
    for group in idle:
        ranks, old, added = _renumbered(plan, cluster, group)
        for position in range(S + 1):
            for bounds in _bounds(L, S + 1):
                yield _with_stage(plan, ranks, old, p, position, added, bounds)


def _bounds(num_layers: int, stages: int) -> Iterator[tuple[int, ...]]:
    """Every split of the layers over the stages (>= 1 each), as stage boundaries."""
    for cuts in itertools.combinations(range(1, num_layers), stages - 1):
        yield (0, *cuts, num_layers)


def _resplit(plan: Plan, pipelines: list[int], bounds: tuple[int, ...],
             swap: tuple[int, int] | None = None) -> Plan:
    """A copy of the plan whose ``pipelines`` hold the layers between ``bounds`` at standard
    depths, with the GPUs of stages ``swap`` exchanged."""
    trial = copy.deepcopy(plan)
    for p in pipelines:
        stages = trial.pipelines[p].stages
        if swap is not None:
            i, j = swap
            stages[i].ranks, stages[j].ranks = stages[j].ranks, stages[i].ranks
        for s, stage in enumerate(stages):
            stage.layers, stage.warmup_microbatches = (bounds[s], bounds[s + 1]), None
    return trial


def _idle_groups(plan: Plan, cluster: Cluster, tp: int) -> list[list[Device]]:
    """One TP group of ``tp`` idle GPUs per node that has one (consecutive local ranks, as the
    search's groups)."""
    used = {(r.node, r.local_rank) for r in plan.ranks}
    by_node: dict[str, list[Device]] = {}
    for d in cluster.devices():
        by_node.setdefault(d.node, []).append(d)
    out = []
    for devices in by_node.values():
        for g in range(len(devices) // tp):
            group = devices[g * tp:(g + 1) * tp]
            if not any((d.node, d.local_rank) in used for d in group):
                out.append(group)
                break
    return out


def _renumbered(plan: Plan, cluster: Cluster, group: list[Device]
                ) -> tuple[list[RankInfo], list[int], list[int]]:
    """The ranks of the plan's GPUs and ``group`` together in cluster order, as the search's
    plans number them: the new rank list, each old rank's new number, the group's numbers."""
    device = {(d.node, d.local_rank): d for d in cluster.devices()}
    used = sorted([device[r.node, r.local_rank] for r in plan.ranks] + group, key=lambda d: d.rank)
    new_rank = {(d.node, d.local_rank): i for i, d in enumerate(used)}
    return ([RankInfo(i, d.node, d.local_rank, d.gpu) for i, d in enumerate(used)],
            [new_rank[r.node, r.local_rank] for r in plan.ranks],
            [new_rank[d.node, d.local_rank] for d in group])


def _with_stage(plan: Plan, ranks: list[RankInfo], old: list[int], pipeline: int,
                position: int, added: list[int], bounds: tuple[int, ...]) -> Plan:
    """The plan over ``ranks`` (:func:`_renumbered`) with the GPUs ``added`` as stage
    ``position`` of ``pipeline``, whose stages then hold the layers between ``bounds``."""
    pipelines = []
    for p, pipe in enumerate(plan.pipelines):
        stages = [Stage([old[r] for r in s.ranks], s.layers) for s in pipe.stages]
        if p == pipeline:
            stages.insert(position, Stage(list(added), (0, 0)))
            for s, stage in enumerate(stages):
                stage.layers = (bounds[s], bounds[s + 1])
        pipelines.append(Pipeline(stages, pipe.num_microbatches))
    return dataclasses.replace(plan, ranks=ranks, pipelines=pipelines, predicted={})


def _warmed(plan: Plan, cost: PlanCost, cluster: Cluster, profile: Profile,
            memory_headroom: float) -> tuple[Plan, PlanCost]:
    """A copy of the plan with HAPT depths where they shorten the iteration, and its cost; the
    plan and cost themselves when they do not."""
    chosen: dict[int, tuple[list[int], float]] = {}       # pipeline -> depths, priced time
    cache: dict[tuple, tuple[list[int], float] | None] = {}   # depths, simulated saving
    # a pipeline's depth caps depend only on its stages' shapes (what _max_depths reads)
    caps_of_shape: dict[tuple, list[int]] = {}
    for p, (pipe, pcost) in enumerate(zip(plan.pipelines, cost.pipelines)):
        if len(pipe.stages) < 2 or pcost.time_s < cost.pipeline_time_s * (1 - MIN_GAIN):
            continue                       # no boundary, or not setting the iteration time
        shape = (pipe.num_microbatches, tuple(
            (sc.gpu, sc.tp, st.num_layers, sc.memory_gib, sc.in_flight_microbatches,
             sc.memory_limit_gib) for st, sc in zip(pipe.stages, pcost.stages)))
        caps = caps_of_shape.get(shape)
        if caps is None:
            caps = caps_of_shape[shape] = _max_depths(plan, p, cost, profile)
        key = (tuple((s.forward_s, s.backward_s, s.p2p_s) for s in pcost.stages),
               pipe.num_microbatches, tuple(caps))
        if key not in cache:
            standard = _makespan(_times_of(pcost.stages), pipe.num_microbatches,
                                 tuple(standard_warmup_depths(len(pipe.stages),
                                                              pipe.num_microbatches)))
            depths, makespan = best_warmups(pcost.stages, pipe.num_microbatches, caps)
            cache[key] = ((depths, standard - makespan) if makespan < standard * (1 - MIN_GAIN)
                          else None)
        if cache[key] is None:
            return plan, cost              # a pipeline setting the time keeps it: no gain
        depths, saving = cache[key]
        chosen[p] = (depths, pcost.time_s - saving)
    if not chosen:
        return plan, cost
    slowest_other = max((pc.time_s for p, pc in enumerate(cost.pipelines) if p not in chosen),
                        default=0.0)
    slowest_chosen = max(t for _, t in chosen.values())
    if max(slowest_other, slowest_chosen) >= cost.pipeline_time_s * (1 - MIN_GAIN):
        return plan, cost                  # a pipeline left standard still sets the time
    plan = copy.deepcopy(plan)
    for p, (depths, _) in chosen.items():
        for stage, w in zip(plan.pipelines[p].stages, depths):
            stage.warmup_microbatches = w
    plan.validate()
    new_cost = evaluate_plan(plan, cluster, profile, with_timeline=False,
                             memory_headroom=memory_headroom, charge=cost.charge)
    annotate_plan(plan, new_cost)
    return plan, new_cost
