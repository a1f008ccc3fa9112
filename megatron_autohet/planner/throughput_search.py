"""The throughput search: the fastest plan of a fleet (:func:`fastest_before`), a best-first
branch and bound around the SCIP composition model, never slower than its sub-fleets' plans.

The iteration time of a plan is ``max_p T_pipe(p) + sync(D) + optimizer`` (cost_model.py): the
longest pipeline plus the gradient sync and optimizer step of the busiest stages, where the sync
depends on the number of pipelines D. The search fixes everything that couples pipelines
non-linearly in an outer enumeration, and leaves an exact integer program to SCIP:

1. **Configs** and 2. **pipeline options**: options.py.
3. **Branches**, 4. **best first** and 6. **node-local sync**: branch_and_bound.py.
5. **Incumbents from the baselines**: the Megatron-LM, Whale-style and fastest-type-only plans
   (planner/baselines.py) are points of this space (uniform grids, a subset of the GPUs); they
   seed the incumbent, as a MIP start does, so the result is never slower than any of them and
   their bound prunes branches from the start.
7. **HAPT warm-up post-pass** (planner/warmup.py): the pipelines that set the iteration
   time in each of the best few plans judged (BranchAndBound.best_few) get deeper 1F1B
   warm-ups where the event-level simulation says they overlap a slow boundary with compute,
   within memory, and the fastest result wins; where that is cheap (small fleets and models)
   the plans next to the best one (other layer splits, two stages' GPUs swapped, an idle GPU as
   one stage more) get the pass too, since deeper warm-ups can favour a plan the closed form
   ranks equal. The exhaustive search's best gets the pass, the baselines never (Megatron-LM
   has no such option).
8. **Never slower than a sub-fleet** (:class:`SubFleets`): the plan of every fleet the fleet
   holds minus one GPU type (recursively, each set of types searched once, and only where its
   lower bound is below the best plan found by then) is a candidate, as are the baselines and,
   for the re-planner, the previous plan adapted to the fleet. The search's own space holds those
   plans (GPUs may stay idle), but its heuristics (option and split selection, SCIP's node limit,
   the pruning tolerance, pools that change with the fleet) do not guarantee it finds them: a 32-GPU
   fleet of H100, A100, V100 and T4 found a plan 2.8% slower than the same fleet without its V100s.
   With them, adding GPUs never slows the plan, which tests/planner/test_planner_limits.py checks
   on random fleets. The fleet's own best plan gets the warm-up pass (step 7) before the
   sub-fleets' plans, which have had theirs, compete with it: compared at standard depths against
   a warmed-up sub-fleet plan it lost the bundled quick start (a100-h800-h20, GPT-3 1.3B, global
   batch 64), 0.2656 s warmed up against the A100 + H800 plan's 0.2744 s.

Bounded work: options depend on the GPU types and ``max_stages``, the SCIP model has one
integer per option and one row per GPU type, the bins grow logarithmically with the GPU count;
the number of GPUs otherwise only changes right-hand sides.

Deterministic budget: the search's budget is counted in work, not wall time: SCIP
branch-and-bound nodes summed over all solves (each solve at least one, and at most
scip_model.SOLVE_NODE_LIMIT), checked between branches. The same input therefore gives the same
plan on an idle or a loaded machine. The wall-clock ``time_limit_s`` (a finite number > 0) is
only a safety net; when it cuts the search (or a single SCIP solve), :attr:`Candidate.stopped_by`
says so, since the plan then depends on the machine's speed. It is checked before every SCIP
solve (whose own limit is what the search has left), between branches, sub-fleet searches,
a sub-fleet's baseline grids, each block of stage sequences of an option build (one length, or
one micro-batch cap),
every block of the pair pricing and every stacked plan costed, and a cut search skips the
warm-up pass: at most 0.4 CPU-s between two checks on a 32-GPU fleet of four types, 0.8 CPU-s
on 4096 GPUs of four types (LLaMA-2 7B). The fleet's own baselines always run, first (they are
the floor of the result: 1.2 CPU-s at 4096 GPUs with the profile), so a cut search, which
returns the best plan judged so far, is never slower than the best baseline.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable, Sequence

from tqdm import tqdm

from megatron_autohet.cost_model import (DEFAULT_CHARGE, DEFAULT_MEMORY_HEADROOM,
                                         check_memory_headroom)
from megatron_autohet.errors import ConfigError
from megatron_autohet.planner import candidate
from megatron_autohet.planner.baselines import all_baselines
from megatron_autohet.planner.branch_and_bound import BranchAndBound
from megatron_autohet.planner.candidate import STOP_COMPLETE, STOP_TIME, Candidate
from megatron_autohet.planner.options import Config, make_config
from megatron_autohet.planner.space import Problem, check_batch, evaluate, resolve_profile
from megatron_autohet.planner.warmup import warm_up_best
from megatron_autohet.profiling.profile import Profile
from megatron_autohet.spec.cluster import Cluster
from megatron_autohet.spec.model import ModelSpec

# Default work budget (SCIP branch-and-bound nodes over the whole search, module doc): well above
# what the bundled fleets and the 8-4096-GPU benchmark fleets use to finish, so it binds only on
# unusual inputs.
WORK_BUDGET = 5000


def fastest_before(cluster: Cluster, model: ModelSpec, profile: Profile | None,
                   global_batch_size: int, micro_batch_size: int, seq_length: int | None,
                   deadline: float, *, allow_asymmetric_tp: bool = False,
                   activation_recompute: bool | None = None, progress: bool = True,
                   tp_degrees: list[int] | None = None, max_stages: int | None = None,
                   seeds: Sequence[Candidate] = (), baselines: bool = True,
                   work_budget: int = WORK_BUDGET,
                   on_candidate: Callable[[Candidate], None] | None = None,
                   distributed_optimizer: bool = False,
                   memory_headroom: float = DEFAULT_MEMORY_HEADROOM,
                   sub_fleets: bool = True, charge: str = DEFAULT_CHARGE) -> Candidate:
    """search() with objective "throughput", its safety net a ``deadline`` on
    candidate.clock();
    ``sub_fleets`` False searches the whole fleet only (:class:`SubFleets`: for a caller that
    searches every set of GPU types or nodes itself)."""
    seq_length = seq_length or model.seq_length
    profile = resolve_profile(cluster, model, profile, micro_batch_size, seq_length)
    problem = Problem(cluster, model, profile, global_batch_size, micro_batch_size, seq_length,
                      distributed_optimizer=distributed_optimizer,
                      memory_headroom=check_memory_headroom(memory_headroom), charge=charge)
    check_batch(problem)
    degrees = [t for t in model.valid_tp_degrees(max(n.num_gpus for n in cluster.nodes))
               if tp_degrees is None or t in tp_degrees]
    recompute_modes = [False, True] if activation_recompute is None else [activation_recompute]
    fleets = SubFleets(problem, degrees, recompute_modes, deadline, work_budget, max_stages,
                       allow_asymmetric_tp, baselines, sub_fleets)
    # (disable None: no bar where stderr is not a terminal, e.g. a job's log file)
    with tqdm(desc="planning", unit="branch", disable=None if progress else True, delay=0.5,
              leave=False) as fleets.bar:
        best = fleets.fastest(frozenset(n.gpu for n in cluster.nodes), seeds, on_candidate)
    if best is None:
        raise no_plan_fits(problem, degrees, recompute_modes)
    return dataclasses.replace(best, stopped_by=fleets.stopped_by, work=fleets.work)


class SubFleets:
    """The throughput search of a fleet and, as its incumbents, of every fleet it holds minus
    one GPU type (recursively, each set of types searched once): a fleet's plan is then never
    slower than the plan of any of its sub-fleets (it can leave the added GPUs idle, and does
    when that is faster), which the search's own space alone does not guarantee (its option
    and split heuristics, SCIP's node limit and the pruning tolerance depend on the pools).

    Each set of types is searched as a fleet of its own would be (same space, budget, its own
    baselines), so ``fastest(types)`` is the plan the search returns for that sub-fleet. A
    sub-fleet is searched only when its lower bound (:meth:`lower_bound_s`) is below the best
    plan found by then: otherwise its plan cannot be faster, so the guarantee holds without it
    (on three types of 1024 GPUs most sub-fleets without the fastest type are skipped so).
    Every search shares one wall-clock deadline; none starts after it.
    """

    def __init__(self, problem: Problem, degrees: list[int], recompute_modes: list[bool],
                 deadline: float, work_budget: int, max_stages: int | None,
                 allow_asymmetric_tp: bool, baselines: bool, recurse: bool = True):
        self.problem, self.degrees, self.recompute_modes = problem, degrees, recompute_modes
        self.deadline, self.work_budget, self.max_stages = deadline, work_budget, max_stages
        self.allow_asymmetric_tp, self.baselines = allow_asymmetric_tp, baselines
        self.recurse = recurse
        self.solved: dict[frozenset[str], Candidate | None] = {}
        self.work = 0
        self.stopped_by = STOP_COMPLETE
        self.bar = None

    def _stopped(self, why: str) -> None:
        if why != STOP_COMPLETE and self.stopped_by != STOP_TIME:
            self.stopped_by = why

    def fastest(self, types: frozenset[str], seeds: Sequence[Candidate] = (),
                on_candidate: Callable[[Candidate], None] | None = None) -> Candidate | None:
        """The plan of the fleet's nodes of these GPU types (None: none fits in memory)."""
        if types in self.solved:
            return self.solved[types]
        whole = self.problem.cluster
        whole_fleet = types == frozenset(n.gpu for n in whole.nodes)
        cluster = whole.subset([n.name for n in whole.nodes if n.gpu in types])
        problem = dataclasses.replace(self.problem, cluster=cluster)
        search_bb = BranchAndBound(problem, self.deadline, self.work_budget, self.max_stages,
                                   skip_needless_recompute=len(self.recompute_modes) > 1,
                                   on_candidate=on_candidate)
        for seed in seeds:
            search_bb.offer(seed)
        # The fleet's own baselines always run (the floor of the result); a sub-fleet's stop
        # at the safety net.
        out_of_time = ((lambda: False) if whole_fleet
                       else (lambda: candidate.clock() >= self.deadline))
        for baseline in all_baselines(problem, self.recompute_modes, tp_degrees=self.degrees,
                                      max_stages=self.max_stages, out_of_time=out_of_time
                                      ) if self.baselines else ():
            if baseline.plan is not None:
                plan = baseline.plan
                tp = {plan.ranks[s.ranks[0]].gpu: s.tp for p in plan.pipelines for s in p.stages}
                search_bb.offer(Candidate(plan, baseline.cost, tp, plan.activation_recompute))
        if search_bb.may_continue():
            self._search(problem, search_bb)
        self._stopped(search_bb.stopped_by)
        own = search_bb.best
        if own is not None and candidate.clock() < self.deadline:
            # Warmed up before the sub-fleets' plans (warmed up already) compete with it: judged
            # at standard depths it lost the bundled a100-h800-h20 fleet (GPT-3 1.3B, global
            # batch 64) to its A100 + H800 sub-fleet's plan, 0.2744 s warmed up, though it
            # was 0.2851 s against that plan's 0.2857 at standard depths and 0.2656 warmed up.
            few = search_bb.best_few
            index, plan, cost = warm_up_best([(c.plan, c.cost) for c in few], cluster,
                                             problem.profile, problem.memory_headroom,
                                             self.max_stages)
            search_bb.best = dataclasses.replace(few[index], plan=plan, cost=cost)
        elif own is not None:
            self._stopped(STOP_TIME)    # cut: the plan as judged, without the warm-up pass
        sub_plans: set[int] = set()     # plans of sub-fleets: warmed up already
        subs = sorted((self.lower_bound_s(types - {gpu}), gpu) for gpu in types
                      ) if self.recurse and len(types) > 1 else []
        for bound_s, gpu in subs:
            if search_bb.best is not None and bound_s >= search_bb.best.cost.iteration_time_s:
                break               # no plan of this sub-fleet (or the next) can be faster
            if candidate.clock() >= self.deadline:
                self._stopped(STOP_TIME)
                break
            sub = self.fastest(types - {gpu})
            if sub is not None:
                # Its iteration time on this fleet is the same (the cost model sees only the
                # nodes a plan uses); what this fleet adds, its idle GPUs, is priced when it
                # wins, or now when a caller sees every candidate.
                sub = self._costed(problem, sub) if on_candidate else sub
                sub_plans.add(id(sub.plan))
                search_bb.offer(sub)
        self.work += search_bb.work
        best = search_bb.best
        if best is not None and id(best.plan) in sub_plans:
            best = best if on_candidate else self._costed(problem, best)
        elif best is not None:
            best = dataclasses.replace(best, stopped_by=search_bb.stopped_by,
                                       work=search_bb.work)
        self.solved[types] = best
        return best

    @staticmethod
    def _costed(problem: Problem, sub: Candidate) -> Candidate:
        """A sub-fleet's plan costed on this fleet (a copy: the plan records its idle GPUs)."""
        plan = copy.deepcopy(sub.plan)
        return dataclasses.replace(sub, plan=plan, cost=evaluate(problem, plan))

    def lower_bound_s(self, types: frozenset[str]) -> float:
        """No plan of the fleet's nodes of these types is faster: the smallest fluid bound of
        its configs (the warm-up pass only reorders the same work, so it cannot beat it
        either); with asymmetric TP no bound (0)."""
        if self.allow_asymmetric_tp:
            return 0.0
        whole = self.problem.cluster
        problem = dataclasses.replace(self.problem, cluster=whole.subset(
            [n.name for n in whole.nodes if n.gpu in types]))
        configs = [make_config(problem, {g: t for g in types}, recompute)
                   for t in self.degrees for recompute in self.recompute_modes]
        return min((c.fluid_bound_s for c in configs if c is not None), default=math.inf)

    def _search(self, problem: Problem, search_bb: BranchAndBound) -> None:
        """The branch and bound of one fleet over its TP configs (module doc)."""
        cluster = problem.cluster
        gpus = list(dict.fromkeys(n.gpu for n in cluster.nodes))

        def configs_for(tp_of_gpu: dict[str, int]) -> list[Config]:
            configs = [make_config(problem, tp_of_gpu, recompute)
                       for recompute in self.recompute_modes]
            return [c for c in configs if c is not None]

        search_bb.run([c for t in self.degrees for c in configs_for({g: t for g in gpus})],
                      self.bar)
        if not self.allow_asymmetric_tp:
            return
        per_gpu = {g: [t for t in self.degrees
                       if any(n.num_gpus % t == 0 for n in cluster.nodes if n.gpu == g)]
                   for g in gpus}
        best = search_bb.best
        current = dict(best.tp_of_gpu) if best else {g: per_gpu[g][0] for g in gpus}
        for g in gpus:
            current.setdefault(g, per_gpu[g][0])
        improved = True
        while improved and search_bb.may_continue():
            improved = False
            for g in gpus:
                before = search_bb.best
                trials = [dict(current, **{g: t}) for t in per_gpu[g] if t != current[g]]
                search_bb.run([c for trial in trials for c in configs_for(trial)], self.bar)
                if search_bb.best is not before and search_bb.best is not None:
                    current.update(search_bb.best.tp_of_gpu)
                    improved = True


def no_plan_fits(problem: Problem, degrees: list[int], recompute_modes: list[bool]
                 ) -> ConfigError:
    """The error when no plan fits in memory: what was tried, and only the remedies that were
    not (no recompute suggested after recompute was tried, no TP degree after the widest)."""
    cluster, model = problem.cluster, problem.model
    tried = (f"TP degrees tried: {', '.join(map(str, degrees)) or 'none the nodes allow'}; "
             "activation recompute tried: "
             + " and ".join("on" if r else "off" for r in recompute_modes))
    remedies = ["more or larger GPUs"]
    wider = [t for t in model.valid_tp_degrees(max(n.num_gpus for n in cluster.nodes))
             if t > max(degrees, default=0)]
    if wider:
        remedies.append(f"a wider TP degree ({', '.join(map(str, wider))})")
    if True not in recompute_modes:
        remedies.append("activation recompute")
    if problem.micro_batch_size > 1:
        remedies.append(f"a micro-batch below {problem.micro_batch_size}")
    remedies.append(f"a sequence length below {problem.seq_length}")
    if problem.memory_headroom > 0:
        remedies.append(f"a memory headroom below {problem.memory_headroom}")
    return ConfigError(cluster.name, "nodes", f"no plan for {model.name} fits in memory with "
                       f"global batch {problem.global_batch_size} and micro-batch "
                       f"{problem.micro_batch_size} ({tried})", ", ".join(remedies))

