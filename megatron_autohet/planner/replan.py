"""Re-planning after the fleet changed (a preemption, a node joining): fast, and aware of where
the training state is.

``replan(previous, cluster, model, profile=None, *, tolerance=0.02, ...)``
returns a :class:`Replan`: the plan to restart with, its cost, the bytes of training state its
recovery moves across nodes (planner/state_moves.py), the fastest iteration time found and how
many plans were compared. The model, global batch, micro-batch and sequence length are the
previous plan's (training continues with the same batch); the cluster is the fleet present now,
and a node keeps its name across the change (same name, same machine, same local checkpoint).
The new plan uses only the GPUs that can train in the job's precision (spec/cluster.py
``trainable_fleet``, as ``autohet plan`` does: no V100 or T4 in a bf16 job); the others are
among its idle GPUs.

1. **Unchanged fleet**: every GPU the previous plan used is present with its type, and the GPUs
   it left idle are exactly those it recorded as idle (``predicted.idle_gpus``; a plan without
   that record had none): the previous plan is returned as it is (the same object), nothing
   moves, nothing is searched.
2. **Derived plan**: the previous plan on the fleet now present: each lost node replaced by a
   node that joined with the same GPU type and enough GPUs, where there is one (a spot fleet
   usually gets a replacement of the same kind), and the pipelines that touched an unreplaced
   lost node dropped, their micro-batches re-split over the rest (each next micro-batch to the
   pipeline that finishes it earliest, as the planner splits them). And the **patched plan**:
   those pipelines kept instead, each stage on a lost node moved to a free TP group of the
   same degree (GPUs the plan left idle, then those of the last pipelines given up for it), so
   a pipeline that lost one of five stages keeps four where their state is rather than leaving
   their GPUs idle (LLaMA-2 7B on 1024 GPUs, an H20 node lost: the derived plan drops four
   pipelines and idles 32 H800s, 6.8% slower than the search's best, so outside the tolerance).
3. **Search**: planner/search.py seeded with the derived and patched plans as incumbents and
   WITHOUT the baselines (on 1024 GPUs the baselines alone cost seconds; the seeds, descended
   from a plan at least as fast as the baselines on the old fleet, take their place in pruning)
   or the sub-fleet searches (throughput_search.SubFleets: each costs about a whole search, and
   the choice below trades iteration time for state moved anyway). Its budget is counted in
   work, REPLAN_WORK_BUDGET SCIP nodes, so the same fleet change gives the same plan on an idle
   or a loaded machine; the wall-clock ``time_limit_s`` is only a safety net
   (``Replan.stopped_by`` says when it cut). The budget is small because a re-plan is on the
   recovery path: measured on 1024 GPUs (a node of A100 or H20 lost, 2 cores), 10 nodes re-plan
   GPT-3 1.3B in 0.4-0.5 s and LLaMA-2 7B in 0.5-0.6 s (most of it building the pipeline
   options), and the plan chosen is the one the complete search (48-183 nodes, 0.8-1.7 s)
   chooses: the faster plans it finds (by up to 1.8%, inside the default tolerance) move more
   state. When there is neither a derived nor a patched plan (every pipeline lost, no free
   GPUs), the search runs with the baselines as incumbents.
4. **Choice**: of every plan judged (the seeds, every plan the search built), those
   within ``tolerance`` of the fastest iteration time; among them the one whose recovery moves
   the fewest bytes across nodes, then the fastest. The HAPT warm-up post-pass then runs on it
   (the search's best has had it already; a plan that moves less but misses the tolerance by
   at most MAX_WARM_UP_GAIN gets it before it is passed over, so warmed and unwarmed plans are
   not compared). Here the pass sets depths only, without the plans next to the candidate
   (planner/warmup.py, "Neighbours"): those move layers and GPUs, and a candidate is chosen
   for the bytes its recovery moves (odd-count seed 11 after losing a node: the re-planned
   plan moved 6.07 GB where 5.47 GB was reported and compared).

**The objective.** A plan records the objective it was made for (plan.py; with ``--objective
cost`` its throughput floor too), and its re-plans keep it, as they keep its memory headroom and
charge: the search is the objective's re-plan search (objective.py ``replan_search``; the cost
objective's is cost_search.cheapest within objective.REPLAN_COST_SEARCHES node sets or sets of
GPU types and TP degrees, each searched with the re-plan's work budget), the seeds that meet the
objective are judged beside its result, and step 4 compares the objective's score (the cost
objective's USD per million tokens) instead of iteration time. Where the fleet now present
cannot keep the objective - no plan reaches the floor, or a node has no price - the re-plan is
the throughput one above and ``Replan.objective_note`` says why: a spot job is better slow than
stopped, and the new plan still records the objective, so the re-plan after nodes come back is
the cheapest again.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from megatron_autohet.cost_model import (PlanCost, annotate_plan, evaluate_plan, plan_charge,
                                         plan_memory_headroom, plan_profile, record_profile)
from megatron_autohet.errors import ConfigError
from megatron_autohet.plan import Pipeline, Plan, RankInfo
from megatron_autohet.planner.candidate import Candidate
from megatron_autohet.planner.objective import THROUGHPUT, ObjectiveNotKept, objective_of
from megatron_autohet.planner.search import search, with_left_out
from megatron_autohet.planner.space import Problem, evaluate, priced_precision, resolve_profile
from megatron_autohet.planner.state_moves import StateMap
from megatron_autohet.planner.interleave import interleaved
from megatron_autohet.planner.warmup import choose_warmups
from megatron_autohet.profiling.profile import Profile
from megatron_autohet.spec.cluster import Cluster, trainable_fleet
from megatron_autohet.spec.model import ModelSpec


# The re-plan's search budget in SCIP branch-and-bound nodes, and its wall-clock safety net
# (module doc, step 3).
REPLAN_WORK_BUDGET = 10
REPLAN_TIME_LIMIT_S = 10.0
# Candidates up to this much slower than the tolerance allows are given the warm-up pass before
# the choice passes them over (least_moving): the pass shortened the searches' best plans on the
# bundled and benchmark fleets by 0-6.9%, and each try costs a cost-model evaluation.
MAX_WARM_UP_GAIN = 0.08


@dataclass
class Replan:
    plan: Plan
    cost: PlanCost
    recovery_bytes: int              # state crossing nodes to load ``plan`` (0: unchanged)
    best_iteration_time_s: float     # the fastest plan judged (``plan`` is within tolerance
                                     # of it, or of the cheapest below)
    candidates: int                  # plans judged (0: fleet unchanged, nothing searched)
    unchanged: bool                  # the previous plan, returned as it was
    stopped_by: str | None = None    # how the search ended (candidate.STOP_*); None: no search
    work: int = 0                    # SCIP nodes the search used
    # A priced objective (module doc, "The objective"): the cheapest plan judged, USD per
    # million tokens (``plan`` is within tolerance of it; None with the throughput objective),
    # or why the fleet now present could not keep the objective (None: kept).
    cheapest_usd_per_million_tokens: float | None = None
    objective_note: str | None = None

    @property
    def objective_warning(self) -> str | None:
        """What `autohet replan` and the elastic worker say where the objective was not kept."""
        if self.objective_note is None:
            return None
        return (f"the plan's objective is {self.plan.objective}, not kept on this fleet: "
                f"{self.objective_note}")


def fleet_unchanged(previous: Plan, cluster: Cluster) -> bool:
    """Whether ``cluster`` is the fleet ``previous`` was made for (module doc, step 1)."""
    devices = {(d.node, d.local_rank): d.gpu for d in cluster.devices()}
    used = {(r.node, r.local_rank) for r in previous.ranks}
    if any(devices.get((r.node, r.local_rank)) != r.gpu for r in previous.ranks):
        return False
    idle = Counter(gpu for key, gpu in devices.items() if key not in used)
    return idle == Counter(previous.predicted.get("idle_gpus") or {})


def node_mapping(previous: Plan, cluster: Cluster) -> dict[str, str]:
    """Previous node -> node now: itself when present with the GPUs the plan used, else a node
    that joined (a name the previous plan did not use) with the same GPU type and enough GPUs;
    lost nodes without a replacement are left out."""
    needed: dict[str, tuple[str, int]] = {}
    for r in previous.ranks:
        gpu, count = needed.get(r.node, (r.gpu, 0))
        needed[r.node] = (gpu, max(count, r.local_rank + 1))
    now = {n.name: n for n in cluster.nodes}
    joined = [n for n in cluster.nodes if n.name not in needed]
    mapping = {}
    for name, (gpu, count) in needed.items():
        node = now.get(name)
        if node is not None and node.gpu == gpu and node.num_gpus >= count:
            mapping[name] = name
            continue
        spare = next((n for n in joined if n.gpu == gpu and n.num_gpus >= count), None)
        if spare is not None:
            joined.remove(spare)
            mapping[name] = spare.name
    return mapping


def _split_microbatches(cost: PlanCost, total: int) -> list[int]:
    """Micro-batches per pipeline minimising the longest pipeline (1F1B: fill + (m - 1) period),
    each at least one: the next one always goes where it finishes earliest."""
    periods = [[s.time_s + s.p2p_s for s in p.stages] for p in cost.pipelines]
    fill, period = [sum(p) for p in periods], [max(p) for p in periods]
    counts = [1] * len(periods)
    heap = [(fill[i] + period[i], i) for i in range(len(periods))]
    heapq.heapify(heap)
    for _ in range(total - len(counts)):
        _, i = heapq.heappop(heap)
        counts[i] += 1
        heapq.heappush(heap, (fill[i] + counts[i] * period[i], i))
    return counts


def _with_microbatches(plan: Plan, counts: list[int]) -> Plan:
    """The plan with these micro-batch counts; a pipeline whose count changes gets the standard
    warm-up depths back (its previous depths were chosen for its previous count)."""
    pipelines = [pipe if pipe.num_microbatches == m else Pipeline(
        [dataclasses.replace(s, warmup_microbatches=None) for s in pipe.stages], m)
        for pipe, m in zip(plan.pipelines, counts)]
    return dataclasses.replace(plan, pipelines=pipelines, predicted={})


def derived_plan(previous: Plan, problem: Problem) -> Candidate | None:
    """The previous plan on the fleet now present (module doc, step 2), evaluated; None when
    no pipeline survives or it does not fit in memory."""
    mapping = node_mapping(previous, problem.cluster)
    device = _devices_now(previous, problem.cluster, mapping)
    kept = [[(stage, [device[r] for r in stage.ranks]) for stage in pipe.stages]
            for pipe in previous.pipelines if all(r in device for r in pipe.ranks)]
    return _plan_on_devices(previous, problem, kept)


def patched_plan(previous: Plan, problem: Problem) -> Candidate | None:
    """The previous plan with every pipeline that lost a node patched rather than dropped (module
    doc, step 2): each stage on a lost node moves to a free TP group of the same degree on one
    surviving node - GPUs the plan leaves idle, preferring the lost stage's GPU type, then the
    types with more memory - and the pipeline keeps its other stages, and the state they hold,
    where they are. When no free group is left, the last pipeline still waiting to be patched is
    given up and its GPUs become free. None when no pipeline was patched (the derived plan is
    then the same plan) or the result does not fit in memory."""
    cluster = problem.cluster
    mapping = node_mapping(previous, cluster)
    device = _devices_now(previous, cluster, mapping)
    pipelines = [[(stage, [device.get(r) for r in stage.ranks]) for stage in pipe.stages]
                 for pipe in previous.pipelines]
    whole = [all(None not in devs for _, devs in pipe) for pipe in pipelines]
    if all(whole):
        return None
    held = {d for pipe in pipelines for _, devs in pipe for d in devs if d is not None}
    free = [d for d in cluster.devices() if d not in held]      # idle before, or joined
    waiting = [p for p, ok in enumerate(whole) if not ok]
    memory = {g: t.memory_gib for g, t in cluster.gpu_types.items()}
    patched = []
    while waiting:
        p = waiting.pop(0)
        stages = []
        for stage, devs in pipelines[p]:
            if None not in devs:
                stages.append((stage, devs))
                continue
            lost_gpu = previous.ranks[stage.ranks[0]].gpu
            group = _free_group(free, stage.tp, lost_gpu, memory)
            while group is None and waiting:            # give up the last waiting pipeline
                free += [d for _, devs_ in pipelines[waiting.pop()] for d in devs_
                         if d is not None]
                group = _free_group(free, stage.tp, lost_gpu, memory)
            if group is None:
                break
            for d in group:
                free.remove(d)
            stages.append((stage, group))
        if len(stages) == len(pipelines[p]):
            patched.append(p)
            pipelines[p] = stages
        else:                                           # its GPUs serve the others
            free += [d for _, devs in stages for d in devs if d not in free]
            free += [d for _, devs in pipelines[p] for d in devs
                     if d is not None and d not in free]
    if not patched:
        return None
    return _plan_on_devices(previous, problem, [
        pipe for p, pipe in enumerate(pipelines) if whole[p] or p in patched])


def _devices_now(previous: Plan, cluster: Cluster, mapping: dict[str, str]) -> dict:
    """Previous rank -> the device (cluster.devices()) it maps to now; ranks on lost nodes
    without a replacement are left out."""
    now = {(d.node, d.local_rank): d for d in cluster.devices()}
    return {r.rank: now[(mapping[r.node], r.local_rank)]
            for r in previous.ranks if r.node in mapping}


def _free_group(free: list, tp: int, gpu: str, memory: dict[str, float]) -> list | None:
    """``tp`` free devices on one node: of GPU type ``gpu`` if any node has them, else of the
    type with the most memory (then by node name); None when no node has ``tp`` free."""
    by_node: dict[str, list] = {}
    for d in free:
        by_node.setdefault(d.node, []).append(d)
    fits = [(d[0].gpu != gpu, -memory[d[0].gpu], node) for node, d in by_node.items()
            if len(d) >= tp]
    if not fits:
        return None
    node = min(fits)[2]
    return sorted(by_node[node], key=lambda d: d.local_rank)[:tp]


def _plan_on_devices(previous: Plan, problem: Problem, pipelines: list) -> Candidate | None:
    """A plan of the previous plan's stages on new devices (``pipelines``: per pipeline, its
    ``(stage, devices)`` in order), ranks numbered by device, the batch's micro-batches split
    over the pipelines, evaluated; None when there is no pipeline or it does not fit."""
    if not pipelines:
        return None
    cluster = problem.cluster
    used = sorted((d for pipe in pipelines for _, devs in pipe for d in devs),
                  key=lambda d: d.rank)
    new_rank = {d.rank: i for i, d in enumerate(used)}
    total = problem.num_microbatches
    same = len(pipelines) == len(previous.pipelines)
    # An interleaved pipeline's stages as one chunk each, of the same layer counts (its
    # micro-batches change; the search's plan gets its chunks chosen again, planner/search.py)
    plain = {id(stage): flat for pipe in previous.pipelines if pipe.interleaved
             for stage, flat in zip(pipe.stages, interleaved(pipe, 1).stages)}
    # Any valid split will do to cost the stages (their times do not depend on it); the real
    # split follows from those times.
    share = ([pipe.num_microbatches for pipe in previous.pipelines] if same
             else [1] * (len(pipelines) - 1) + [total - len(pipelines) + 1])
    plan = Plan(cluster=cluster.name, model=previous.model,
                micro_batch_size=previous.micro_batch_size,
                global_batch_size=previous.global_batch_size, seq_length=previous.seq_length,
                ranks=[RankInfo(i, d.node, d.local_rank, d.gpu) for i, d in enumerate(used)],
                pipelines=[Pipeline([dataclasses.replace(
                    plain.get(id(stage), stage), ranks=[new_rank[d.rank] for d in devs],
                    warmup_microbatches=stage.warmup_microbatches if same else None)
                    for stage, devs in pipe], m) for pipe, m in zip(pipelines, share)],
                activation_recompute=previous.activation_recompute,
                use_distributed_optimizer=previous.use_distributed_optimizer)
    cost = evaluate(problem, plan)
    counts = _split_microbatches(cost, total)
    if counts != [p.num_microbatches for p in plan.pipelines]:
        plan = _with_microbatches(plan, counts)
        cost = evaluate(problem, plan)
    if not cost.fits_memory:
        return None
    tp_of_gpu = {plan.ranks[s.ranks[0]].gpu: s.tp for p in plan.pipelines for s in p.stages}
    return Candidate(plan, cost, tp_of_gpu, plan.activation_recompute)


def iteration_time_s(cand: Candidate) -> float:
    return cand.cost.iteration_time_s


def least_moving(candidates: list[Candidate], state: StateMap, tolerance: float,
                 warm_up: Callable[[Candidate], Candidate] | None = None,
                 score: Callable[[Candidate], float] = iteration_time_s
                 ) -> tuple[Candidate, int]:
    """Of the candidates within ``tolerance`` of the best ``score`` (the fastest iteration time;
    the cost objective's is USD per million tokens), the one whose recovery moves the fewest
    bytes from where ``state`` says the state is (then the best, then the first), with those
    bytes.

    With ``warm_up`` (the HAPT warm-up pass, which only shortens a plan, so lowers either score)
    a candidate that moves fewer bytes than that choice but scores up to MAX_WARM_UP_GAIN too
    high is given the pass, least moving first, and wins if it then is within the tolerance:
    the search's best arrives warmed up, and comparing it with plans that are not would favour
    moving state."""
    limit = min(score(c) for c in candidates) * (1 + tolerance)
    ranked = sorted((sum(state.bytes_by_node(c.plan).values()), score(c), i)
                    for i, c in enumerate(candidates))
    for moved, value, index in ranked:
        if value <= limit:
            return candidates[index], moved
        if warm_up is not None and value <= limit * (1 + MAX_WARM_UP_GAIN):
            warmed = warm_up(candidates[index])
            if score(warmed) <= limit:
                return warmed, moved
    raise AssertionError("the best candidate is within any tolerance")


def _check_inputs(previous: Plan, model: ModelSpec, tolerance: float) -> None:
    if model != previous.model:
        fields = [f.name for f in dataclasses.fields(model)
                  if getattr(model, f.name) != getattr(previous.model, f.name)]
        raise ConfigError("<arguments>", f"model.{fields[0]}",
                          f"{getattr(model, fields[0])!r}, the previous plan's model has "
                          f"{getattr(previous.model, fields[0])!r}",
                          "the previous plan's model (training continues the same model)")
    if not tolerance >= 0:
        raise ConfigError("<arguments>", "tolerance", f"got {tolerance}", "a fraction >= 0")


def replan(previous: Plan, cluster: Cluster, model: ModelSpec, profile: Profile | None = None,
           *, tolerance: float = 0.02, time_limit_s: float = REPLAN_TIME_LIMIT_S,
           work_budget: int = REPLAN_WORK_BUDGET, progress: bool = False,
           allow_asymmetric_tp: bool = False, activation_recompute: bool | None = None,
           tp_degrees: list[int] | None = None, max_stages: int | None = None,
           precision: str | None = None, cluster_file: str = "<cluster>",
           search_unchanged: bool = False, virtual_stages: bool = True) -> Replan:
    """The plan to restart with on ``cluster`` after ``previous`` (module doc).

    ``model`` must be ``previous.model``; ``profile`` None prices on the profile ``previous``
    was priced on (its file records it; none recorded: analytic estimates), the new plan
    recording the one used;
    ``tolerance`` is the fraction of the objective's score (iteration time; with the plan's
    cost objective USD per million tokens) traded for less state moved;
    ``work_budget`` the search's budget in SCIP nodes and ``time_limit_s`` its wall-clock
    safety net; ``precision`` the one the job trains in (None: the one the plans are priced
    in, space.priced_precision): the new plan uses only GPUs that can train in it
    (spec/cluster.py ``trainable_fleet``, ``cluster_file`` names the cluster in its error) and
    counts the others idle; ``search_unchanged`` searches an unchanged fleet too (step 1
    skipped: planner/adapt.py re-plans the same fleet on what the job measured, and the
    previous plan is then the derived seed, its micro-batches re-split); ``virtual_stages``
    (search()'s) False, or a ``previous`` plan that overlaps its gradient reduce (the runtime
    refuses interleaving with it), keeps one model chunk per stage; the other options are
    :func:`~megatron_autohet.planner.search.search`'s. Raises ConfigError on a model
    mismatch, a negative tolerance, no GPU that trains in ``precision``, or when no plan fits
    in memory.
    """
    _check_inputs(previous, model, tolerance)
    mbs, seq = previous.micro_batch_size, previous.seq_length
    profile = profile if profile is not None else plan_profile(previous)
    precision = precision or priced_precision(profile)
    trainable, left_out = trainable_fleet(cluster, precision, cluster_file)
    # The new plan keeps the previous one's optimizer (the job's flags do not change), the
    # memory headroom it was made with, how its price is charged and its objective (module
    # doc): from the plan file, as the elastic agents re-plan without the flags `autohet plan`
    # had.
    headroom = plan_memory_headroom(previous)
    charge = plan_charge(previous)
    # (the GPUs left out are among the idle ones a plan made on this fleet recorded; a previous
    # plan on one of them, made for another precision, is re-planned)
    if not search_unchanged and fleet_unchanged(previous, cluster) and \
            not {r.gpu for r in previous.ranks} & set(left_out):
        cost = evaluate_plan(previous, cluster, resolve_profile(cluster, model, profile, mbs, seq),
                             with_timeline=False, memory_headroom=headroom, charge=charge)
        return Replan(previous, cost, 0, cost.iteration_time_s, 0, True)
    cluster = trainable                 # from here on, the fleet the new plan may use
    resolved = resolve_profile(cluster, model, profile, mbs, seq)
    problem = Problem(cluster, model, resolved, previous.global_batch_size, mbs, seq,
                      previous.use_distributed_optimizer, headroom, charge)
    derived = derived_plan(previous, problem)
    seeds = [c for c in (derived, patched_plan(previous, problem)) if c is not None]
    judged: list[Candidate] = []
    options = dict(allow_asymmetric_tp=allow_asymmetric_tp,
                   activation_recompute=activation_recompute, time_limit_s=time_limit_s,
                   work_budget=work_budget, progress=progress, tp_degrees=tp_degrees,
                   max_stages=max_stages, seeds=seeds, baselines=not seeds,
                   distributed_optimizer=previous.use_distributed_optimizer,
                   memory_headroom=headroom, on_candidate=judged.append, charge=charge,
                   virtual_stages=virtual_stages and not previous.overlap_grad_reduce)

    def search_for(**objective_arguments) -> Candidate:
        return search(cluster, model, profile, previous.global_batch_size, mbs, seq,
                      sub_fleets=False, precision=precision, **options,
                      **objective_arguments)

    kept = objective_of(previous)
    objective, note = kept, None
    try:
        best = kept.replan_search(cluster, cluster_file, search_for)
    except ObjectiveNotKept as exc:
        objective, note = THROUGHPUT, str(exc)
        best = objective.replan_search(cluster, cluster_file, search_for)
    # The seeds that meet the objective are judged beside the search's result: the cost search
    # judges node sets, not each plan (the throughput search has judged them, its incumbents).
    judged += [c for c in seeds if objective.meets(c.cost)
               and all(c.plan is not j.plan for j in judged)]
    # The search's best after its warm-up pass is a new plan when the pass helped: judged
    # beside the candidates as the search saw them (each warmed up when the choice reaches it).
    if all(c.plan is not best.plan for c in judged):
        judged.append(best)
    warmed: dict[int, Candidate] = {id(best.plan): best}

    def warm_up(cand: Candidate) -> Candidate:
        if id(cand.plan) not in warmed:
            # depths only: the pass's neighbours move layers and GPUs, so the bytes this
            # candidate was chosen for would no longer be what its recovery moves
            plan, cost = choose_warmups(cand.plan, cand.cost, cluster, resolved, headroom,
                                        rank=objective.rank, neighbours=False)
            warmed[id(cand.plan)] = dataclasses.replace(cand, plan=plan, cost=cost)
        return warmed[id(cand.plan)]

    def score(cand: Candidate) -> float:
        return objective.score(cand.cost)

    chosen, moved = least_moving(judged, StateMap(previous, model), tolerance, warm_up, score)
    chosen = warm_up(chosen)
    # (the warm-up pass may have made the chosen plan the fastest or the cheapest one)
    fastest = min(c.cost.iteration_time_s for c in [*judged, chosen])
    cheapest = min(score(c) for c in [*judged, chosen]) if objective.priced else None
    cost = with_left_out(chosen.cost, left_out)
    if left_out:
        annotate_plan(chosen.plan, cost)
    record_profile(chosen.plan, profile)
    # the objective stays the plan's, kept or not: the next re-plan may keep it again
    kept.record(chosen.plan)
    return Replan(chosen.plan, cost, moved, fastest, len(judged), False, best.stopped_by,
                  best.work, cheapest, note)
