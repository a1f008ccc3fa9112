"""The plan space and its building blocks, shared by the SCIP planner, the baselines and the
exhaustive search.

* A :class:`Pool` is the set of TP groups of one GPU type at one TP degree: a node of ``n`` GPUs
  gives ``n / tp`` groups of consecutive local ranks (TP groups never leave a node and never mix
  GPU types).
* A pipeline is a sequence of pools (one TP group per stage) with a layer count per stage; its
  :class:`PipelineOption` carries what the cost model says about it independent of the
  micro-batch count: ``fill_s`` = sum of stage periods and ``period_s`` = max stage period (so
  ``T_pipe(m) = fill_s + (m - 1) * period_s``, cost_model.pipeline_time_s) and ``extra_s``, the
  gradient sync + optimizer time of its busiest stage.
* :func:`place_pipelines` maps pipelines to concrete ranks (best-fit of same-type stage runs
  into nodes, so consecutive stages of one type share a node whenever they can), and
  :func:`build_plan` turns that into a :class:`Plan` evaluated by the cost model.

Stage periods use the links the placement will give: consecutive stages of one type share a node
unless the run is longer than a node holds, different types always cross nodes (a node has one
GPU type).
"""

from __future__ import annotations

import functools
import heapq
import math
from dataclasses import dataclass

from megatron_autohet.cost_model import (GIB, PlanCost, annotate_plan, evaluate_plan,
                                         grad_allreduce_s, optimizer_step_s, p2p_s,
                                         stage_compute_s, stage_memory_bytes, stage_param_count)
from megatron_autohet.errors import ConfigError
from megatron_autohet.plan import Pipeline, Plan, RankInfo, Stage
from megatron_autohet.profiling.profile import Profile, ProfileEntry
from megatron_autohet.spec.cluster import Cluster
from megatron_autohet.spec.model import ModelSpec


@dataclass(frozen=True)
class Pool:
    gpu: str
    tp: int
    count: int               # TP groups in the cluster
    groups_per_node: int     # fewest groups any node of this type holds
    nic_gbs: float           # slowest NIC among the nodes of this type
    intra_gbs: float         # slowest intra-node link among them


@dataclass(frozen=True, eq=False)
class Problem:
    """Everything fixed for one planning run."""

    cluster: Cluster
    model: ModelSpec
    profile: Profile
    global_batch_size: int
    micro_batch_size: int
    seq_length: int

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // self.micro_batch_size

    def entry(self, pool: Pool) -> ProfileEntry:
        if not self.profile.has(pool.gpu, pool.tp, self.micro_batch_size, self.seq_length):
            raise ConfigError("<profile>", "entries", f"no entry for gpu={pool.gpu} tp={pool.tp} "
                              f"micro_batch_size={self.micro_batch_size} seq_length="
                              f"{self.seq_length}", "a profile covering every GPU type of the "
                              "cluster at the TP degrees searched")
        return self.profile.get(pool.gpu, pool.tp, self.micro_batch_size, self.seq_length)

    @functools.cached_property
    def sync_bandwidth_gbs(self) -> float:
        """Link a data-parallel group crosses: the slowest NIC, or NVLink on a one-node cluster."""
        nodes = self.cluster.nodes
        if len(nodes) == 1:
            return nodes[0].intra_node_bandwidth_gbs
        return min(n.inter_node_bandwidth_gbs for n in nodes)


def check_batch(problem: Problem) -> None:
    if problem.global_batch_size % problem.micro_batch_size:
        raise ConfigError("<arguments>", "global_batch_size", f"{problem.global_batch_size} is not "
                          f"a multiple of micro_batch_size {problem.micro_batch_size}",
                          "a multiple of the micro-batch size")


def make_pools(cluster: Cluster, tp_of_gpu: dict[str, int]) -> list[Pool] | None:
    """Pools for a TP degree per GPU type; None when a degree does not divide some node."""
    pools = []
    for gpu, tp in tp_of_gpu.items():
        nodes = [n for n in cluster.nodes if n.gpu == gpu]
        if any(n.num_gpus % tp for n in nodes):
            return None
        pools.append(Pool(gpu, tp, sum(n.num_gpus // tp for n in nodes),
                          min(n.num_gpus // tp for n in nodes),
                          min(n.inter_node_bandwidth_gbs for n in nodes),
                          min(n.intra_node_bandwidth_gbs for n in nodes)))
    return pools


@dataclass(frozen=True)
class PipelineOption:
    pools: tuple[int, ...]      # pool index of each stage
    layers: tuple[int, ...]     # layers of each stage
    fill_s: float               # sum of stage periods (t_s + c_s)
    period_s: float             # max stage period
    extra_s: float              # gradient sync + optimizer of the busiest stage (estimate)

    def time_s(self, num_microbatches: int) -> float:
        return self.fill_s + (num_microbatches - 1) * self.period_s

    def capacity(self, time_limit_s: float) -> int:
        """Most micro-batches this pipeline finishes (with its sync) within ``time_limit_s``."""
        slack = time_limit_s - self.fill_s - self.extra_s
        if slack < 0:
            return 0
        return int(math.floor(slack / self.period_s + 1e-9)) + 1


@dataclass(frozen=True)
class StageCoefficients:
    """Linear costs of a stage in its pipeline position: period and memory per layer."""

    time_fixed: float
    time_per_layer: float
    max_layers: int             # by memory
    entry: ProfileEntry
    memory_bandwidth_gbs: float
    first: bool
    last: bool


def stage_coefficients(problem: Problem, pools: list[Pool], sequence: tuple[int, ...],
                       recompute: bool) -> list[StageCoefficients] | None:
    """Per-stage linear coefficients; None if some stage cannot hold even one layer."""
    S = len(sequence)
    model, mbs, seq = problem.model, problem.micro_batch_size, problem.seq_length
    out = []
    run_pos = 0
    for s, k in enumerate(sequence):
        pool = pools[k]
        entry = problem.entry(pool)
        first, last = s == 0, s == S - 1
        run_pos = run_pos + 1 if s > 0 and sequence[s - 1] == k else 0
        comm = 0.0
        if not last:
            nxt = sequence[s + 1]
            if nxt == k and (run_pos + 1) % pool.groups_per_node != 0:
                bw = pool.intra_gbs
            else:
                bw = min(pool.nic_gbs, pools[nxt].nic_gbs)
            comm = p2p_s(model, mbs, seq, bw)
        f1, b1 = stage_compute_s(entry, 1, first, last, recompute)
        f2, b2 = stage_compute_s(entry, 2, first, last, recompute)
        per_layer = (f2 + b2) - (f1 + b1)
        in_flight = S - s
        m1 = stage_memory_bytes(entry, model, 1, first, last, recompute, in_flight)
        m2 = stage_memory_bytes(entry, model, 2, first, last, recompute, in_flight)
        gpu = problem.cluster.gpu_types[pool.gpu]
        limit = gpu.memory_gib * GIB
        if m1 > limit:
            return None
        max_layers = int((limit - m1) // (m2 - m1)) + 1 if m2 > m1 else problem.model.num_layers
        out.append(StageCoefficients(f1 + b1 - per_layer + comm, per_layer, max_layers, entry,
                                     gpu.memory_bandwidth_gbs, first, last))
    return out


def stage_extra_s(problem: Problem, coeff: StageCoefficients, num_layers: int,
                  sync_factor_holders: int) -> float:
    """Estimated gradient sync + optimizer time of a stage (cost_model formulas, slowest link)."""
    params = stage_param_count(coeff.entry, problem.model, num_layers, coeff.first, coeff.last)
    sync = grad_allreduce_s(params, sync_factor_holders, problem.sync_bandwidth_gbs)
    return sync + optimizer_step_s(params, coeff.memory_bandwidth_gbs)


def option_for_split(problem: Problem, sequence: tuple[int, ...], coeffs: list[StageCoefficients],
                     layers: tuple[int, ...], holders: int) -> PipelineOption:
    periods = [c.time_fixed + c.time_per_layer * n for c, n in zip(coeffs, layers)]
    extra = max(stage_extra_s(problem, c, n, holders) for c, n in zip(coeffs, layers))
    return PipelineOption(sequence, layers, sum(periods), max(periods), extra)


# Layer splits tried above the smallest feasible period: looser caps move layers to the faster
# stages (shorter fill, better for few micro-batches) at the price of a longer period.
PERIOD_SLACKS = (0.0, 0.05, 0.15, 0.4)


def layer_splits(problem: Problem, coeffs: list[StageCoefficients]) -> list[tuple[int, ...]]:
    """Layer splits of one stage sequence: the min-period split and a few looser ones.

    For a period cap P a stage holds at most ``min(memory cap, (P - fixed) / per_layer)`` layers;
    the smallest P whose caps sum to the model's layers is found by bisection, then each split
    fills every stage with one layer and hands the rest to the fastest stages first (smallest
    fill time under that cap).
    """
    L, S = problem.model.num_layers, len(coeffs)
    if S > L or sum(min(c.max_layers, L) for c in coeffs) < L:
        return []

    def caps(period_cap: float) -> list[int]:
        return [min(c.max_layers, int((period_cap - c.time_fixed) / c.time_per_layer + 1e-9))
                for c in coeffs]

    lo = max(c.time_fixed + c.time_per_layer for c in coeffs)
    hi = max(c.time_fixed + c.time_per_layer * min(L, c.max_layers) for c in coeffs)
    if sum(max(0, x) for x in caps(lo)) < L:
        for _ in range(24):
            mid = 0.5 * (lo + hi)
            if sum(max(0, x) for x in caps(mid)) >= L:
                hi = mid
            else:
                lo = mid
        base = hi
    else:
        base = lo
    order = sorted(range(S), key=lambda s: coeffs[s].time_per_layer)
    splits: list[tuple[int, ...]] = []
    for slack in PERIOD_SLACKS:
        c = caps(base * (1 + slack))
        if min(c) < 1 or sum(c) < L:
            continue
        layers = [1] * S
        left = L - S
        for s in order:
            take = min(left, c[s] - 1)
            layers[s] += take
            left -= take
        if tuple(layers) not in splits:
            splits.append(tuple(layers))
    return splits


def assign_microbatches(options: list[PipelineOption], total: int,
                        include_extra: bool = False) -> list[int]:
    """Micro-batches per pipeline minimising max_p T_pipe(m_p) (+ extra_s with include_extra)
    with every m_p >= 1: greedy on the linear pipeline times, always giving the next micro-batch
    where it finishes earliest; optimal because each pipeline's time increases with m_p."""
    if total < len(options):
        raise ConfigError("<arguments>", "global_batch_size", f"{total} micro-batches for "
                          f"{len(options)} pipelines", "at least one micro-batch per pipeline")
    counts = [1] * len(options)
    extra = [o.extra_s if include_extra else 0.0 for o in options]
    heap = [(o.time_s(2) + extra[i], i) for i, o in enumerate(options)]
    heapq.heapify(heap)
    for _ in range(total - len(options)):
        _, i = heapq.heappop(heap)
        counts[i] += 1
        heapq.heappush(heap, (options[i].time_s(counts[i] + 1) + extra[i], i))
    return counts


def place_pipelines(cluster: Cluster, pools: list[Pool],
                    sequences: list[tuple[int, ...]]) -> list[list[list[int]]]:
    """Concrete TP-group ranks for every stage: same-pool runs go best-fit into nodes."""
    base = 0
    free: dict[int, list[tuple[str, list[list[int]]]]] = {k: [] for k in range(len(pools))}
    pool_of_gpu = {p.gpu: k for k, p in enumerate(pools)}
    for node in cluster.nodes:
        k = pool_of_gpu[node.gpu]
        tp = pools[k].tp
        groups = [list(range(base + g * tp, base + (g + 1) * tp)) for g in range(node.num_gpus // tp)]
        free[k].append((node.name, groups))
        base += node.num_gpus
    runs = []   # (length, pipeline, first stage, pool)
    for p, seq in enumerate(sequences):
        s = 0
        while s < len(seq):
            e = s
            while e + 1 < len(seq) and seq[e + 1] == seq[s]:
                e += 1
            runs.append((e - s + 1, p, s, seq[s]))
            s = e + 1
    placed: list[list[list[int] | None]] = [[None] * len(seq) for seq in sequences]
    for length, p, start, k in sorted(runs, key=lambda r: (-r[0], r[1], r[2])):
        s, need = start, length
        while need:
            nodes = [n for n in free[k] if n[1]]
            if not nodes:
                raise ConfigError("<plan>", "pipelines", f"more {pools[k].gpu} TP groups than "
                                  "the cluster has", f"{pools[k].count}")
            fitting = [n for n in nodes if len(n[1]) >= need]
            node = (min(fitting, key=lambda n: len(n[1])) if fitting
                    else max(nodes, key=lambda n: len(n[1])))
            take = min(need, len(node[1]))
            for _ in range(take):
                placed[p][s] = node[1].pop(0)
                s += 1
            need -= take
    return placed  # type: ignore[return-value]


def build_plan(problem: Problem, pools: list[Pool], options: list[PipelineOption],
               microbatches: list[int], recompute: bool) -> Plan:
    ranks = [RankInfo(d.rank, d.node, d.local_rank, d.gpu) for d in problem.cluster.devices()]
    placement = place_pipelines(problem.cluster, pools, [o.pools for o in options])
    pipelines = []
    for opt, m, stage_ranks in zip(options, microbatches, placement):
        stages, start = [], 0
        for n, rs in zip(opt.layers, stage_ranks):
            stages.append(Stage(ranks=list(rs), layers=(start, start + n)))
            start += n
        pipelines.append(Pipeline(stages=stages, num_microbatches=m))
    return Plan(cluster=problem.cluster.name, model=problem.model,
                micro_batch_size=problem.micro_batch_size,
                global_batch_size=problem.global_batch_size, seq_length=problem.seq_length,
                ranks=ranks, pipelines=pipelines, activation_recompute=recompute)


def evaluate(problem: Problem, plan: Plan) -> PlanCost:
    """Validate, cost and annotate a plan built in this space."""
    plan.validate()
    cost = evaluate_plan(plan, problem.cluster, problem.profile, with_timeline=False)
    annotate_plan(plan, cost)
    return cost
