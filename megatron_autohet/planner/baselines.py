"""Plans a user would run without us, as ordinary Plans, so that the same cost model judges them.

* **Megatron-LM**: one TP x PP x DP grid for the whole fleet, Megatron's rank order (TP fastest,
  then DP, then PP), uniform layers per stage (when PP does not divide the layers, the first
  stages get one fewer, as Megatron's num_layers_in_first_pipeline_stage allows), the same
  number of micro-batches per replica (DP must divide them, as Megatron requires). The best grid
  (and recompute choice) that fits every GPU's memory is found by enumeration.
* **Whale-style**: the same uniform grids, but each replica's micro-batches proportional to its
  speed (1 / its slowest stage period), as Whale's hardware-aware data parallelism does.
* **Homogeneous (fastest type only)**: Megatron-LM's best grid on only the nodes of the GPU type
  with the highest peak throughput, the rest of the fleet left idle.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from megatron_autohet.cost_model import PlanCost, stage_compute_s
from megatron_autohet.plan import Pipeline, Plan, RankInfo, Stage
from megatron_autohet.planner.space import Problem, evaluate


@dataclass
class Baseline:
    name: str
    plan: Plan | None
    cost: PlanCost | None
    note: str = ""


def _grids(problem: Problem, tp_degrees: list[int] | None,
           max_stages: int | None) -> list[tuple[int, int, int]]:
    cluster, model = problem.cluster, problem.model
    world = cluster.world_size
    out = []
    for t in model.valid_tp_degrees(max(n.num_gpus for n in cluster.nodes)):
        # (an empty restriction allows no degree: a sub-fleet may hold none of those asked)
        if any(n.num_gpus % t for n in cluster.nodes) or (tp_degrees is not None
                                                         and t not in tp_degrees):
            continue
        for p in range(1, min(model.num_layers, max_stages or model.num_layers) + 1):
            if world % (t * p):
                continue
            out.append((t, p, world // (t * p)))
    return out


def grid_plan(problem: Problem, tp: int, pp: int, dp: int, microbatches: list[int],
              recompute: bool) -> Plan:
    """Megatron's layout: rank = pp_rank * (tp * dp) + dp_rank * tp + tp_rank."""
    L = problem.model.num_layers
    sizes = [L // pp + (1 if s >= pp - L % pp else 0) for s in range(pp)]
    bounds = [sum(sizes[:s]) for s in range(pp + 1)]
    pipelines = []
    for i in range(dp):
        stages = [Stage(ranks=[s * tp * dp + i * tp + j for j in range(tp)],
                        layers=(bounds[s], bounds[s + 1])) for s in range(pp)]
        pipelines.append(Pipeline(stages=stages, num_microbatches=microbatches[i]))
    ranks = [RankInfo(d.rank, d.node, d.local_rank, d.gpu) for d in problem.cluster.devices()]
    return Plan(cluster=problem.cluster.name, model=problem.model,
                micro_batch_size=problem.micro_batch_size,
                global_batch_size=problem.global_batch_size, seq_length=problem.seq_length,
                ranks=ranks, pipelines=pipelines, activation_recompute=recompute,
                use_distributed_optimizer=problem.distributed_optimizer)


def _proportional(weights: list[float], total: int) -> list[int]:
    """Largest-remainder split of ``total`` in proportion to ``weights``, every share >= 1."""
    n = len(weights)
    rest = total - n
    raw = [w / sum(weights) * rest for w in weights]
    shares = [1 + int(r) for r in raw]
    order = sorted(range(n), key=lambda i: raw[i] - int(raw[i]), reverse=True)
    for i in order[:total - sum(shares)]:
        shares[i] += 1
    return shares


def _grid_bound_s(problem: Problem, tp: int, pp: int, dp: int, recompute: bool,
                  proportional: bool) -> float:
    """Lower bound on a grid's iteration time without building its plan: the longest pipeline's
    compute alone (no P2P, sync or optimizer), under the grid's own micro-batch split, or under
    the best split for the Whale-style grids (their split is proportional, never better). Costs
    O(DP x PP), so the baselines evaluate only the grids that can still win."""
    L, M = problem.model.num_layers, problem.num_microbatches
    sizes = [L // pp + (1 if s >= pp - L % pp else 0) for s in range(pp)]
    devices = problem.cluster.devices()
    shapes: dict[tuple[str, ...], int] = {}
    for i in range(dp):
        key = tuple(devices[s * tp * dp + i * tp].gpu for s in range(pp))
        shapes[key] = shapes.get(key, 0) + 1
    times = []     # (fill, period) per distinct pipeline shape, with its count
    for gpus, count in shapes.items():
        periods = [sum(stage_compute_s(problem.profile.get(g, tp, problem.micro_batch_size,
                                                           problem.seq_length),
                                       n, s == 0, s == pp - 1, recompute))
                   for s, (g, n) in enumerate(zip(gpus, sizes))]
        times.append((sum(periods), max(periods), count))
    if not proportional:
        return max(fill + (M // dp - 1) * period for fill, period, _ in times)
    # The best split: the smallest makespan tau whose per-shape capacities cover M.
    def capacity(tau: float) -> int:
        return sum(count * (int((tau - fill) / period) + 1) if tau >= fill else 0
                   for fill, period, count in times)
    lo, hi = 0.0, max(fill + (M - 1) * period for fill, period, _ in times)
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if capacity(mid) >= M else (mid, hi)
    return lo


def _best(problem: Problem, name: str, proportional: bool, recompute_modes: list[bool],
          tp_degrees: list[int] | None = None, max_stages: int | None = None,
          out_of_time: Callable[[], bool] = lambda: False) -> Baseline:
    """The fastest grid that fits, of those costed before ``out_of_time`` says stop."""
    M = problem.num_microbatches
    best: Baseline | None = None
    grids = sorted((_grid_bound_s(problem, tp, pp, dp, recompute, proportional), tp, pp, dp,
                    recompute)
                   for tp, pp, dp in _grids(problem, tp_degrees, max_stages)
                   if dp <= M and (proportional or M % dp == 0)
                   for recompute in recompute_modes)
    for bound, tp, pp, dp, recompute in grids:
        if best is not None and bound >= best.cost.iteration_time_s or out_of_time():
            break       # sorted by bound: no later grid can win either
        plan = grid_plan(problem, tp, pp, dp, [M // dp] * dp if M % dp == 0
                         else _proportional([1.0] * dp, M), recompute)
        cost = evaluate(problem, plan)
        if proportional:
            speeds = [1.0 / max(s.time_s + s.p2p_s for s in p.stages) for p in cost.pipelines]
            plan = grid_plan(problem, tp, pp, dp, _proportional(speeds, M), recompute)
            cost = evaluate(problem, plan)
        if cost.fits_memory and (best is None
                                 or cost.iteration_time_s < best.cost.iteration_time_s):
            best = Baseline(name, plan, cost, f"TP={tp} PP={pp} DP={dp}"
                            + (" recompute" if recompute else ""))
    return best or Baseline(name, None, None, "no uniform grid fits in memory or divides the batch")


def megatron_lm(problem: Problem, recompute_modes: list[bool], **space) -> Baseline:
    return _best(problem, "megatron-lm", False, recompute_modes, **space)


def whale(problem: Problem, recompute_modes: list[bool], **space) -> Baseline:
    return _best(problem, "whale", True, recompute_modes, **space)


def fastest_type_only(problem: Problem, recompute_modes: list[bool], **space) -> Baseline:
    cluster = problem.cluster
    fastest = max(cluster.gpu_types.values(), key=lambda g: g.dense_tflops).name
    sub = cluster.subset([n.name for n in cluster.nodes if n.gpu == fastest])
    sub_problem = Problem(sub, problem.model, problem.profile, problem.global_batch_size,
                          problem.micro_batch_size, problem.seq_length,
                          distributed_optimizer=problem.distributed_optimizer,
                          memory_headroom=problem.memory_headroom)
    best = _best(sub_problem, f"megatron-lm ({fastest} only)", False, recompute_modes,
                 **space)
    if best.plan is not None:
        # judged on the whole fleet, so its cost (and the plan's record) counts the idle GPUs
        best.cost = evaluate(problem, best.plan)
    return best


def all_baselines(problem: Problem, recompute_modes: list[bool], *,
                  tp_degrees: list[int] | None = None, max_stages: int | None = None,
                  out_of_time: Callable[[], bool] = lambda: False) -> list[Baseline]:
    """The baselines, restricted to these TP degrees and pipeline depths (None: any); each
    stops costing grids once ``out_of_time`` says so (a sub-fleet search's safety net)."""
    space = {"tp_degrees": tp_degrees, "max_stages": max_stages, "out_of_time": out_of_time}
    return [megatron_lm(problem, recompute_modes, **space),
            whale(problem, recompute_modes, **space),
            fastest_type_only(problem, recompute_modes, **space)]
