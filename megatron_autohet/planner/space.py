"""The planner's plan space and its building blocks (shared by the SCIP search and the baselines).

* A :class:`Pool` is the set of TP groups of one kind of node (GPU type, GPU count, intra-node
  link and NIC) at its type's TP degree: a node of ``n`` GPUs gives ``n // tp`` groups of
  consecutive local ranks (TP groups never leave a node and never mix GPU types; GPUs left over
  stay idle, as does a node smaller than the degree). Nodes of one type with different links are
  different pools, so an option's link estimates are the links its stages get. Any TP group may
  stay idle: a plan lists only the GPUs it uses (ranks 0..W-1), so leaving slow GPUs out is a
  point of the space, not a special case.
* A pipeline is a sequence of pools (one TP group per stage) with a layer count per stage. Its
  :class:`PipelineOption` carries what the cost model says about it independent of the
  micro-batch count: ``fill_s`` = sum of stage periods and ``period_s`` = max stage period, so
  ``T_pipe(m) = fill_s + (m - 1) * period_s`` (cost_model.pipeline_time_s), and the per-stage
  parameter volumes from which :meth:`OptionTable.extras_s` gives its gradient sync + optimizer
  time for a given number of pipelines D (the cost model's layer-wise ring all-reduce, which
  costs 2 (D - 1) / D of the gradients; with D = 1 only the tied embedding is synced, between the
  first and the last stage).
* :func:`place_pipelines` maps pipelines to concrete TP groups: runs of consecutive stages of one
  pool go best-fit into nodes, and a pipeline that starts and ends on the same pool has its first
  and last run placed together (so its tied-embedding sync stays inside a node), which is what
  the option's link estimates assume. :func:`build_plan` turns that into a :class:`Plan`.
* On a fleet across zones a pool holds the nodes of one zone (where a kind of node in several
  zones would add more than a few pools, its pool spans them), and a stage's link to the next
  stage of another zone is priced at the zone link where it is slower than the NICs, with its
  latency: placement cannot move a pipeline across zones, and its P2P is priced where it runs.
  The gradient sync between pipelines is priced at the NICs (a lower bound: the cost model,
  which judges every plan, prices the zone links it crosses).
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
from dataclasses import dataclass

import numpy as np

from megatron_autohet.cost_model import (DEFAULT_CHARGE, DEFAULT_MEMORY_HEADROOM, GIB,
                                         GRAD_BYTES_PER_PARAM, PlanCost, annotate_plan,
                                         evaluate_plan, grad_allreduce_s, optimizer_step_s, p2p_s,
                                         stage_compute_s, stage_memory_bytes, stage_param_count,
                                         sync_group_elements, usable_memory_gib)
from megatron_autohet.errors import ConfigError
from megatron_autohet.plan import Pipeline, Plan, RankInfo, Stage
from megatron_autohet.profiling.estimate import estimate_profile
from megatron_autohet.profiling.profile import Profile, ProfileEntry
from megatron_autohet.spec.cluster import Cluster, trainable_fleet
from megatron_autohet.spec.model import ModelSpec
from megatron_autohet.spec.precision import PLANNING_PRECISION, Precision


@dataclass(frozen=True)
class Pool:
    gpu: str
    tp: int
    count: int               # TP groups in the cluster
    groups_per_node: int     # TP groups one of its nodes holds
    nic_gbs: float           # its nodes' NIC
    intra_gbs: float         # its nodes' intra-node link
    node_gpus: int           # GPUs per node (a few may be left over by the degree)
    # The groups' speed relative to their type (spec/cluster.py ``speeds``: the slowest GPU of
    # each group); a node's slowed groups form pools of their own (make_pools)
    speed: float = 1.0
    zone: str | None = None  # its nodes' zone (None: no zones, or its kind's zones: make_pools)


@dataclass(frozen=True, eq=False)
class Problem:
    """Everything fixed for one planning run."""

    cluster: Cluster
    model: ModelSpec
    profile: Profile
    global_batch_size: int
    micro_batch_size: int
    seq_length: int
    # Plans for --use-distributed-optimizer: priced with sharded Adam state (cost_model.py)
    distributed_optimizer: bool = False
    memory_headroom: float = DEFAULT_MEMORY_HEADROOM
    charge: str = DEFAULT_CHARGE        # how plans are priced (cost_model.py, "Price")

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // self.micro_batch_size

    def entry(self, pool: Pool) -> ProfileEntry:
        """The profile entry of the pool's GPU type and degree, its times divided by the pool's
        speed (a pool of slowed groups)."""
        entry = self.profile.get(pool.gpu, pool.tp, self.micro_batch_size, self.seq_length)
        return entry if pool.speed == 1.0 else entry.scaled(1.0 / pool.speed)

    def memory_limit_bytes(self, pool: Pool) -> float:
        return usable_memory_gib(self.cluster.gpu_types[pool.gpu], self.memory_headroom) * GIB

    def sync_bandwidth_gbs(self, pool: Pool) -> float:
        """The link a data-parallel group of this pool's stages crosses: its NIC, or the
        intra-node link on a one-node cluster."""
        if len(self.cluster.nodes) == 1:
            return pool.intra_gbs
        return pool.nic_gbs


def resolve_profile(cluster: Cluster, model: ModelSpec, profile: Profile | None,
                    micro_batch_size: int, seq_length: int) -> Profile:
    """The given profile, with analytic estimates for the entries it lacks, calibrated by its
    measured entries (Profile.calibrated_over)."""
    if profile is None:
        return estimate_profile(model, cluster, micro_batch_size, seq_length)
    # estimated for the attention the profile's layers ran (its activation bytes depend on it)
    estimate = estimate_profile(model, cluster, micro_batch_size, seq_length,
                                attention=profile.attention)
    return profile.calibrated_over(estimate)


def priced_precision(profile: Profile | None) -> str:
    """The precision a plan made from ``profile`` is priced in, hence the one it is made to train
    in (spec/cluster.py ``trainable_fleet`` chooses its GPUs by it): the profile's, else the
    analytic estimates' (spec/precision.py PLANNING_PRECISION, bf16)."""
    return (profile.precision if profile is not None else PLANNING_PRECISION).name


def trainable_for(cluster: Cluster, profile: Profile | None, file: str = "<cluster>",
                  precision: str | None = None) -> tuple[Cluster, dict[str, int]]:
    """The fleet a plan priced on ``profile`` may use, and the GPUs left out by type: the GPUs
    that train in ``precision`` (None: the one it is priced in, :func:`priced_precision`;
    spec/cluster.py ``trainable_fleet``: no V100 or T4 in a bf16 plan). The one decision every
    planning entry point takes (search.search, so ``autohet plan`` and ``compare``; the
    re-planner; the exhaustive yardstick); ConfigError, naming ``file``, when none is left."""
    return trainable_fleet(cluster, precision or priced_precision(profile), file)


def check_batch(problem: Problem) -> None:
    if problem.global_batch_size % problem.micro_batch_size:
        raise ConfigError("<arguments>", "global_batch_size", f"{problem.global_batch_size} is not "
                          f"a multiple of micro_batch_size {problem.micro_batch_size}",
                          "a multiple of the micro-batch size")


# How many pools more than one per kind of node the zones may give (make_pools).
MAX_ZONE_SPLIT_POOLS = 2


def make_pools(cluster: Cluster, tp_of_gpu: dict[str, int]) -> list[Pool]:
    """One pool per kind of node that holds a TP group of its type's degree: nodes of one GPU
    type, size and links (intra-node and NIC) form a pool, so every link an option's stages use
    is the one placement gives them (nodes too small for the degree stay idle). A node with
    slowed GPUs (``cluster.speeds``) gives its groups of each speed to a pool of that speed and
    that many groups per node, so the search prices them at their speed."""
    kinds: dict[tuple, int] = {}
    for node in cluster.nodes:
        tp = tp_of_gpu.get(node.gpu)
        if tp is not None and node.num_gpus >= tp:
            for kind, groups in _node_kinds(cluster, node, tp).items():
                kinds[kind] = kinds.get(kind, 0) + len(groups)
    # A kind of node in several zones forms a pool per zone, where that adds at most
    # MAX_ZONE_SPLIT_POOLS pools: the search's work grows steeply with its pools (1024 GPUs of 3
    # types in 4 zones, 12 pools, did not finish in 9 CPU-minutes; with a pool per type across
    # the zones, 67 s). Above it such a kind's pool spans its zones, its boundaries priced at
    # the NICs (a lower bound), and the cost model prices the zone links the plan crosses.
    zones_of: dict[tuple, set] = {}
    for kind in kinds:
        zones_of.setdefault(kind[:-1], set()).add(kind[-1])
    if len(kinds) - len(zones_of) > MAX_ZONE_SPLIT_POOLS:
        merged: dict[tuple, int] = {}
        for kind, count in kinds.items():
            key = kind if len(zones_of[kind[:-1]]) == 1 else kind[:-1] + (None,)
            merged[key] = merged.get(key, 0) + count
        kinds = merged
    return [Pool(gpu, tp, count, per_node, nic, intra, size, speed, zone)
            for (gpu, tp, size, intra, nic, speed, per_node, zone), count in kinds.items()]


def _group_speeds(cluster: Cluster, node, tp: int) -> list[float]:
    """The speed of each TP group of ``node`` at degree ``tp``: its slowest GPU's."""
    return [min(cluster.speed(node.name, g * tp + i) for i in range(tp))
            for g in range(node.num_gpus // tp)]


def _node_kinds(cluster: Cluster, node, tp: int) -> dict[tuple, list[int]]:
    """The pool kinds of a node's TP groups, each with the indices of its groups: one kind for
    a node at its type's speed, one per speed where some GPUs are slowed."""
    by_speed: dict[float, list[int]] = {}
    for g, speed in enumerate(_group_speeds(cluster, node, tp)):
        by_speed.setdefault(speed, []).append(g)
    return {(node.gpu, tp, node.num_gpus, node.intra_node_bandwidth_gbs,
             node.inter_node_bandwidth_gbs, speed, len(groups), node.zone): groups
            for speed, groups in by_speed.items()}


def distributed_sync_fraction(precision: Precision) -> float:
    """The distributed optimizer's sync bytes over the all-reduce's: (fp32 gradients
    reduce-scattered + weights all-gathered in their dtype) / (2 x fp32 gradients), per member
    of a ring."""
    return (GRAD_BYTES_PER_PARAM + precision.element_bytes) / (2 * GRAD_BYTES_PER_PARAM)


def ring_factor(holders: int) -> float:
    """Fraction 2 (n - 1) / n of the bytes each member sends in a ring all-reduce of n members."""
    return 2.0 * (holders - 1) / holders if holders > 1 else 0.0


@dataclass(frozen=True)
class PipelineOption:
    pools: tuple[int, ...]      # pool index of each stage
    layers: tuple[int, ...]     # layers of each stage
    fill_s: float               # sum of stage periods (t_s + c_s)
    period_s: float             # max stage period
    # Per stage, all-reduce seconds at ring factor 1: gradients synced among the D pipelines'
    # holders over the sync link (layers, position embedding, untied embedding/output, final
    # norm), the tied word embedding over the sync link and over the pipeline's own end-to-end
    # link (intra-node when its ends share a node; used when D = 1).
    sync_shared_s: tuple[float, ...]
    sync_tied_s: tuple[float, ...]
    sync_tied_own_s: tuple[float, ...]
    optimizer_s: float          # the slowest stage's optimizer step
    # Most micro-batches the pipeline may run: a pipeline of S stages running m < S of them
    # keeps only m in flight on its first stages (1F1B), so a split that memory allows only
    # then is an option of its own, capped at m (None: any number).
    max_microbatches: int | None = None

    def time_s(self, num_microbatches: int) -> float:
        return self.fill_s + (num_microbatches - 1) * self.period_s

    def cap(self, microbatches: int) -> int:
        """``microbatches``, or fewer where memory caps this option."""
        return microbatches if self.max_microbatches is None else min(microbatches,
                                                                      self.max_microbatches)



class OptionTable:
    """Options' costs as arrays, so the search prices all of them at once for a pipeline count.

    :meth:`extras_s` is the gradient sync + optimizer step of each option's busiest stages when
    the plan has D pipelines, as cost_model.evaluate_plan charges it: all pipelines hold every
    layer once (ring factor ``2 (D - 1) / D`` on the per-stage volumes), the tied word embedding
    has a first and a last holder in every pipeline of 2+ stages (factor of 2D holders; with
    D = 1 it syncs only between the pipeline's own ends, over their link). Stage columns are
    padded with zeros, which never win the maximum.
    """

    def __init__(self, problem: Problem, fill_s: np.ndarray, period_s: np.ndarray,
                 shared: np.ndarray, tied: np.ndarray, tied_own: np.ndarray,
                 optimizer_s: np.ndarray, stages: np.ndarray):
        self.distributed_optimizer = problem.distributed_optimizer
        self.sync_fraction = distributed_sync_fraction(problem.profile.precision)
        self.fill_s, self.period_s, self.optimizer_s = fill_s, period_s, optimizer_s
        self.shared, self.tied, self.tied_own = shared, tied, tied_own
        self.stages = stages
        self.multi_stage = stages > 1
        # The node-local sync (:meth:`local_extras_s`; None until :meth:`with_node_local`).
        self.node_local: tuple[np.ndarray, ...] | None = None

    def subset(self, index: np.ndarray, problem: Problem) -> OptionTable:
        out = OptionTable(problem, self.fill_s[index], self.period_s[index],
                          self.shared[index], self.tied[index], self.tied_own[index],
                          self.optimizer_s[index], self.stages[index])
        if self.node_local is not None:
            out.node_local = tuple(a[index] for a in self.node_local)
        return out

    def with_node_local(self, pools: list[Pool], stage_pools: np.ndarray, problem: Problem
                        ) -> OptionTable:
        """Record what the options' sync costs where the copies of a stage share a node
        (:meth:`local_extras_s`); ``stage_pools`` (options, max stages) is each stage's pool
        index, -1 where padded."""
        bw = np.array([problem.sync_bandwidth_gbs(p) for p in pools])
        best = bw / np.maximum(bw, [p.intra_gbs for p in pools])
        groups = np.array([p.groups_per_node for p in pools])
        at = np.maximum(stage_pools, 0)
        last = np.take_along_axis(stage_pools, self.stages[:, None] - 1, axis=1)[:, 0]
        ends = np.where(stage_pools[:, 0] == last, groups[at[:, 0]] // np.where(
            self.multi_stage, 2, 1), 0)
        self.node_local = (self.shared * best[at], np.where(stage_pools >= 0, groups[at], 0),
                           self.tied * np.where((stage_pools[:, 0] == last)[:, None],
                                                best[at], 1.0), ends)
        return self

    def extras_s(self, pipelines: int) -> np.ndarray:
        tied = self.tied_own if pipelines == 1 else self.tied
        return self._extras(pipelines, self.shared, tied)

    def local_extras_s(self, pipelines: int) -> np.ndarray:
        """A lower bound on :meth:`extras_s` wherever the copies of a layer can share a node:
        the sync over a stage's intra-node link (where faster than its sync link) when its
        pool's nodes hold a TP group of every one of the D pipelines, the tied embedding's
        likewise when both ends are on one pool whose nodes hold all its 2D holders (D with
        one stage). A layer whose holders span nodes syncs no faster than the sync link of its
        stage's pool (the slowest link of its group: cost_model.py), so no plan of these
        options pays less; :meth:`extras_s` prices every sync over the sync link. Requires
        :meth:`with_node_local`."""
        shared_best, groups, tied_best, ends = self.node_local
        shared = np.where(pipelines <= groups, shared_best, self.shared)
        tied = self.tied_own if pipelines == 1 else np.where(
            (pipelines <= ends)[:, None], tied_best, self.tied)
        return self._extras(pipelines, shared, tied)

    def _extras(self, pipelines: int, shared: np.ndarray, tied: np.ndarray) -> np.ndarray:
        tied_factor = np.where(self.multi_stage, ring_factor(2 * pipelines),
                               ring_factor(pipelines))
        sync = (ring_factor(pipelines) * shared + tied_factor[:, None] * tied).max(axis=1)
        if not self.distributed_optimizer:
            return sync + self.optimizer_s
        # reduce-scatter of fp32 gradients + all-gather of the weights (in bf16 (4 + 2) / 8 of
        # the all-reduce's bytes); Adam steps 1/D of the parameters (1/D or less: the tied
        # embedding has more holders), cost_model.py
        return self.sync_fraction * sync + self.optimizer_s / pipelines


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
    # All-reduce seconds at ring factor 1 (see PipelineOption): per layer and fixed parts.
    sync_per_layer_s: float
    sync_fixed_s: float
    sync_tied_s: float
    sync_tied_own_s: float
    optimizer_fixed_s: float
    optimizer_per_layer_s: float


# The columns of sequence_terms (StageCoefficients' figures).
TERMS = ("time_fixed", "time_per_layer", "max_layers", "sync_fixed_s", "sync_per_layer_s",
         "sync_tied_s", "sync_tied_own_s", "optimizer_fixed_s", "optimizer_per_layer_s")


def sequence_terms(problem: Problem, pools: list[Pool], sequences: np.ndarray, recompute: bool,
                   max_microbatches: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per-stage linear coefficients of n stage sequences of S stages at once (rows of pool
    indices): their TERMS (n, S, len(TERMS)), and whether every stage can hold one layer (n,;
    the terms of a row that cannot are meaningless). Stage s keeps ``S - s`` micro-batches in
    flight, or the pipeline's most micro-batches when fewer (``max_microbatches``, at most the
    batch's). A stage's terms depend on its pool, its position, the micro-batches it keeps, its
    link to the next stage (inside its node while a run of its pool fills the node, else the
    slower NIC, and between zones the zone link where slower, with its latency) and its
    tied-embedding link (inside the node when placement puts both ends on one node, else the
    slower NIC of the two ends, or the zone link): each distinct stage is priced once
    (:func:`_stage_coefficients`), where the search builds tens of thousands of sequences."""
    n, S = sequences.shape
    groups = np.array([p.groups_per_node for p in pools])
    intra = np.array([p.intra_gbs for p in pools], dtype=float)
    nic = np.array([p.nic_gbs for p in pools], dtype=float)
    # Between two nodes: the slower NIC, and between zones the zone link where it is slower,
    # with its latency as the imaginary part (the link's sharing by other transfers is left to
    # the cost model: a lower bound).
    between = np.minimum(nic[:, None], nic[None, :]).astype(complex)
    for a, b in itertools.product(range(len(pools)), repeat=2):
        crossed = problem.cluster.zone_link(pools[a].zone, pools[b].zone)
        if crossed is not None:
            between[a, b] = complex(min(between[a, b].real, crossed.bandwidth_gbs),
                                    crossed.latency_ms / 1e3)
    # Position of each stage in its run of one pool, and its outgoing link (-1: none).
    run_pos = np.zeros((n, S), dtype=np.int64)
    link = np.full((n, S), -1.0 + 0j)
    for s in range(S - 1):
        k, nxt = sequences[:, s], sequences[:, s + 1]
        run_pos[:, s + 1] = np.where(nxt == k, run_pos[:, s] + 1, 0)
        inside = (nxt == k) & ((run_pos[:, s] + 1) % groups[k] != 0)
        link[:, s] = np.where(inside, intra[k], between[k, nxt])
    # Both ends on one node (placement puts a pipeline's first and last runs of one pool
    # together when they fit a node).
    first, last = sequences[:, 0], sequences[:, -1]
    differs = sequences != first[:, None]
    head, tail = differs.argmax(axis=1), differs[:, ::-1].argmax(axis=1)
    together = (S >= 2) & (first == last) & (
        np.where(differs.any(axis=1), head + tail, S) <= groups[first])
    other_end = np.where(np.arange(S) == 0, last[:, None], first[:, None])
    tied = np.where(together[:, None], intra[sequences], between[sequences, other_end])
    # One integer per distinct stage: pool, position (first, last), in flight, both links.
    position = np.array([(s == 0) + 2 * (s == S - 1) for s in range(S)])
    in_flight = np.minimum(S - np.arange(S), max_microbatches or problem.num_microbatches)
    links, link_of = np.unique(link, return_inverse=True)
    tieds, tied_of = np.unique(tied, return_inverse=True)
    code = (((sequences * 4 + position) * (S + 1) + in_flight) * len(links)
            + link_of.reshape(n, S)) * len(tieds) + tied_of.reshape(n, S)
    distinct, index = np.unique(code, return_inverse=True)
    table = np.zeros((len(distinct), len(TERMS)))
    holds = np.zeros(len(distinct), dtype=bool)
    for u, c in enumerate(distinct.tolist()):
        c, tied_i = divmod(c, len(tieds))
        c, link_i = divmod(c, len(links))
        c, flight = divmod(c, S + 1)
        k, pos = divmod(c, 4)
        bw, latency_s = float(links[link_i].real), float(links[link_i].imag)
        terms = _stage_terms(problem, pools[k], bool(pos & 1), bool(pos & 2), recompute, flight,
                             None if bw < 0 else bw, latency_s, float(tieds[tied_i].real))
        if terms is not None:
            holds[u] = True
            table[u] = terms
    index = index.reshape(n, S)
    return table[index], holds[index].all(axis=1)


@functools.lru_cache(maxsize=65536)
def _stage_terms(problem: Problem, pool: Pool, first: bool, last: bool, recompute: bool,
                 in_flight: int, link_gbs: float | None, link_latency_s: float, tied_bw: float
                 ) -> tuple[float, ...] | None:
    """One stage's TERMS (memoised: every build of a config asks for the same few hundred)."""
    coeff = _stage_coefficients(problem, pool, first, last, recompute, in_flight, link_gbs,
                                link_latency_s, tied_bw)
    return None if coeff is None else tuple(getattr(coeff, t) for t in TERMS)


@functools.lru_cache(maxsize=65536)
def _stage_coefficients(problem: Problem, pool: Pool, first: bool, last: bool, recompute: bool,
                        in_flight: int, link_gbs: float | None, link_latency_s: float,
                        tied_bw: float) -> StageCoefficients | None:
    """One stage's coefficients (memoised: sequences share most of their stages)."""
    model, mbs, seq = problem.model, problem.micro_batch_size, problem.seq_length
    entry, precision = problem.entry(pool), problem.profile.precision
    comm = 0.0 if link_gbs is None else p2p_s(model, mbs, seq, link_gbs, precision,
                                              link_latency_s)
    f1, b1 = stage_compute_s(entry, 1, first, last, recompute)
    f2, b2 = stage_compute_s(entry, 2, first, last, recompute)
    per_layer = (f2 + b2) - (f1 + b1)
    m1 = stage_memory_bytes(entry, model, 1, first, last, recompute, in_flight, precision)
    m2 = stage_memory_bytes(entry, model, 2, first, last, recompute, in_flight, precision)
    gpu = problem.cluster.gpu_types[pool.gpu]
    limit = problem.memory_limit_bytes(pool)
    if m1 > limit:
        return None
    max_layers = int((limit - m1) // (m2 - m1)) + 1 if m2 > m1 else model.num_layers
    sync = _sync_terms(problem, pool, first, last, tied_bw)
    opt1 = optimizer_step_s(stage_param_count(entry, model, 1, first, last),
                            gpu.memory_bandwidth_gbs, precision)
    opt2 = optimizer_step_s(stage_param_count(entry, model, 2, first, last),
                            gpu.memory_bandwidth_gbs, precision)
    return StageCoefficients(f1 + b1 - per_layer + comm, per_layer, max_layers, entry,
                             gpu.memory_bandwidth_gbs, first, last, *sync,
                             2 * opt1 - opt2, opt2 - opt1)


def layer_sync_s(problem: Problem, pool: Pool) -> float:
    """One layer's gradient all-reduce seconds at ring factor 1 over the sync link (one TP
    shard of a GPU of this pool)."""
    return _sync_terms(problem, pool, False, False, 1.0)[0]


def _sync_terms(problem: Problem, pool: Pool, first: bool, last: bool,
                tied_bandwidth_gbs: float) -> tuple[float, float, float, float]:
    """(per layer, fixed shared, tied over the sync link, tied over the pipeline's own link):
    a stage's gradient all-reduce seconds at ring factor 1 (cost_model's sync formulas)."""
    model, bw, tp = problem.model, problem.sync_bandwidth_gbs(pool), pool.tp
    unit = grad_allreduce_s(1.0, 2, 1.0)          # seconds per parameter at 1 GB/s, factor 1
    vocab = model.padded_vocab_size([tp])

    def elements(kind: str, n_layers: int = 0) -> int:
        return sync_group_elements(model, kind, n_layers, tp, vocab)

    fixed = 0.0
    if first and model.position_embedding_type == "learned_absolute":
        fixed += elements("position_embeddings")
    if first and not model.tie_embeddings:
        fixed += elements("word_embeddings")
    if last:
        fixed += elements("post_process")
    tied = elements("word_embeddings") if model.tie_embeddings and (first or last) else 0
    return (unit * elements("layers", 1) / bw, unit * fixed / bw, unit * tied / bw,
            unit * tied / tied_bandwidth_gbs)


# Layer splits tried above the smallest feasible period when there are too many stage periods to
# try each (below): looser caps move layers to the faster stages (shorter fill, fewer parameters
# on slow GPUs) at the price of a longer period.
PERIOD_SLACKS = (0.0, 0.03, 0.08, 0.15, 0.3)
# Sequences with at most this many layer splits get every split (small models, short pipelines).
ALL_SPLITS_UP_TO = 84
# Sequences of S stages and L layers with S * L at most this get the split of every period cap a
# stage period can take: exact for the pipeline time (layer_splits).
EVERY_PERIOD_UP_TO = 160


def layer_splits(num_layers: int, fixed: np.ndarray, per_layer: np.ndarray, limits: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Layer splits of n stage sequences of S stages each (each stage >= 1 layer, within its
    memory): row i has stage periods ``fixed[i] + per_layer[i] * layers`` and at most
    ``limits[i]`` layers per stage. Returns (row of each split, splits (k, S)), rows ascending,
    each row's splits in the order below.

    Every split when there are at most ALL_SPLITS_UP_TO of them. Otherwise, for a period cap P
    a stage holds at most ``min(memory cap, (P - fixed) / per_layer)`` layers, and the split of
    P fills every stage with one layer and hands the rest to the fastest stages first: of the
    splits whose period is at most P it has the smallest fill (the sum of stage periods), since
    each layer costs a stage its own ``per_layer``. The pipeline's time ``fill + (m - 1)
    period`` for any m is therefore smallest at the split of some cap P among the stage periods
    ``fixed + per_layer * k`` (the period of the best split is one of them), and every such P
    from the smallest feasible one up is tried when S * L <= EVERY_PERIOD_UP_TO (duplicates
    dropped): exact for the pipeline time. Above that, the smallest P and a few looser ones
    (PERIOD_SLACKS). The smallest P is the greedy min-max (each next layer to the stage whose
    period grows least, exact for increasing per-stage costs): every stage's one-layer period,
    and the (L - S)-th smallest of the periods stages reach with 2, 3, ... layers.
    """
    L = num_layers
    n, S = fixed.shape
    if S > L:
        return np.zeros(0, dtype=np.int64), np.zeros((0, S), dtype=np.int64)
    limits = np.minimum(limits, L)
    ok = limits.sum(axis=1) >= L
    if math.comb(L - 1, S - 1) <= ALL_SPLITS_UP_TO:
        every = np.array(list(_compositions(L, S)), dtype=np.int64).reshape(-1, S)
        rows, which = np.nonzero(ok[:, None] & (every[None] <= limits[:, None]).all(axis=2))
        return rows, every[which]
    single = fixed + per_layer
    base = single.max(axis=1)
    grown = np.zeros((n, 0))
    if L > S:
        counts = np.arange(2, L + 1)
        grown = fixed[:, :, None] + counts * per_layer[:, :, None]
        grown = np.where(counts <= limits[:, :, None], grown, np.inf).reshape(n, -1)
        base = np.maximum(base, np.partition(grown, L - S - 1, axis=1)[:, L - S - 1])
    if S * L <= EVERY_PERIOD_UP_TO:
        periods = np.concatenate([single, grown], axis=1)
        periods = np.sort(np.where(periods >= base[:, None], periods, np.inf), axis=1)
    else:
        periods = base[:, None] * (1 + np.array(PERIOD_SLACKS))[None, :]
    fastest_first = np.argsort(per_layer, axis=1, kind="stable")
    every_row = np.arange(n)[:, None]
    splits = np.zeros((n, periods.shape[1], S), dtype=np.int64)
    valid = np.zeros((n, periods.shape[1]), dtype=bool)
    for i in range(periods.shape[1]):
        cap = periods[:, i]
        finite = np.isfinite(cap)
        caps = np.minimum(limits, np.trunc((np.where(finite, cap, 0.0)[:, None] - fixed)
                                           / per_layer + 1e-9)).astype(np.int64)
        extra = np.take_along_axis(caps - 1, fastest_first, axis=1)
        given_before = np.cumsum(extra, axis=1) - extra
        splits[every_row, i, fastest_first] = 1 + np.clip((L - S) - given_before, 0, extra)
        valid[:, i] = ok & finite & (caps.min(axis=1) >= 1) & (caps.sum(axis=1) >= L)
    rows, which = np.nonzero(valid)
    found = splits[rows, which]
    # The same split at a looser cap is not tried twice (first occurrence kept, order kept).
    _, first = np.unique(np.column_stack([rows, found]), axis=0, return_index=True)
    first = np.sort(first)
    return rows[first], found[first]


@dataclass
class SequenceOptions:
    """The options of many stage sequences as arrays (the search builds tens of thousands per
    config and keeps a tenth, :func:`sequence_options`); :meth:`option` makes one a
    PipelineOption."""

    sequences: list[tuple[tuple[int, ...], int | None]]    # stage pools, micro-batch cap
    sequence: np.ndarray        # which sequence each option splits
    layers: np.ndarray          # (options, max stages): layers per stage, 0-padded
    table: OptionTable

    def option(self, j: int) -> PipelineOption:
        pools, cap = self.sequences[self.sequence[j]]
        S, t = len(pools), self.table
        return PipelineOption(pools, tuple(self.layers[j, :S].tolist()), float(t.fill_s[j]),
                              float(t.period_s[j]), tuple(t.shared[j, :S].tolist()),
                              tuple(t.tied[j, :S].tolist()), tuple(t.tied_own[j, :S].tolist()),
                              float(t.optimizer_s[j]), cap)


def sequence_options(problem: Problem, sequences: list[tuple[tuple[int, ...], int | None]],
                     blocks: list[tuple[np.ndarray, np.ndarray]]) -> SequenceOptions:
    """Every layer split (:func:`layer_splits`) of every stage sequence (its pools and its
    micro-batch cap) with its stage terms, priced at once; the options come in the order of
    the sequences, each sequence's splits in layer_splits's order. ``blocks``: sequences of one
    length, (their indices in ``sequences``, their :func:`sequence_terms`)."""
    width = max(len(pools) for pools, _ in sequences)
    parts = []
    for members, terms in blocks:
        if not len(members):
            continue
        S = terms.shape[1]
        fixed, per_layer, limits = terms[..., 0], terms[..., 1], terms[..., 2].astype(np.int64)
        rows, layers = layer_splits(problem.model.num_layers, fixed, per_layer, limits)
        periods = fixed[rows] + per_layer[rows] * layers
        fill = periods[:, 0].copy()
        for s in range(1, S):          # summed stage by stage, as the cost model sums them
            fill += periods[:, s]
        pad = ((0, 0), (0, width - S))
        parts.append((np.asarray(members, dtype=np.int64)[rows], np.pad(layers, pad),
                      fill, periods.max(axis=1),
                      np.pad(terms[rows, :, 3] + terms[rows, :, 4] * layers, pad),
                      np.pad(terms[rows, :, 5], pad), np.pad(terms[rows, :, 6], pad),
                      np.maximum(0.0, (terms[rows, :, 7] + terms[rows, :, 8] * layers)
                                 .max(axis=1)),
                      np.full(len(rows), S)))
    columns = [np.concatenate(c) for c in zip(*parts)]
    order = np.argsort(columns[0], kind="stable")
    sequence, layers, fill, period, shared, tied, tied_own, optimizer, stages = (
        c[order] for c in columns)
    return SequenceOptions(sequences, sequence, layers, OptionTable(
        problem, fill, period, shared, tied, tied_own, optimizer, stages))


def _compositions(total: int, parts: int):
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0,) + cuts + (total,)
        yield tuple(bounds[i + 1] - bounds[i] for i in range(parts))


def assign_microbatches(options: list[PipelineOption], total: int,
                        offsets: list[float] | None = None) -> list[int]:
    """Micro-batches per pipeline minimising max_p (T_pipe(m_p) + offsets[p]) with every
    1 <= m_p <= its option's cap: greedy, always giving the next micro-batch where it finishes
    earliest; optimal because each pipeline's time increases with m_p (and the sync/optimizer
    terms do not depend on it)."""
    if not len(options) <= total <= sum(o.cap(total) for o in options):
        raise ConfigError("<arguments>", "global_batch_size", f"{total} micro-batches for "
                          f"{len(options)} pipelines", "at least one micro-batch per pipeline, "
                          "at most what each pipeline's memory allows")
    offsets = offsets or [0.0] * len(options)
    # Runs of consecutive pipelines of one option and offset take their micro-batches in turn
    # (equal times, ties to the lower index), so the greedy steps a run at a time: plans of
    # thousands of GPUs have hundreds of pipelines of a few options. (first, size) per run.
    runs: list[list[int]] = []
    for i, (o, d) in enumerate(zip(options, offsets)):
        if runs and options[runs[-1][0]] is o and offsets[runs[-1][0]] == d:
            runs[-1][1] += 1
        else:
            runs.append([i, 1])
    level = [1] * len(runs)                 # micro-batches each member of a run has
    heap = [(options[i].time_s(2) + offsets[i], i, r) for r, (i, _) in enumerate(runs)
            if options[i].cap(2) == 2]
    heapq.heapify(heap)
    left = total - len(options)
    while left > 0:
        _, i, r = heapq.heappop(heap)
        size = runs[r][1]
        if size > left:
            # the last micro-batches go to the run's first members (ties to the lower index)
            runs.append([i, left])
            level.append(level[r])
            runs[r][0], runs[r][1] = i + left, size - left
            level[-1] += 1
            break
        left -= size
        level[r] += 1
        if options[i].cap(level[r] + 1) > level[r]:
            heapq.heappush(heap, (options[i].time_s(level[r] + 1) + offsets[i], i, r))
    counts = [0] * len(options)
    for (first, size), m in zip(runs, level):
        counts[first:first + size] = [m] * size
    return counts


def place_pipelines(cluster: Cluster, pools: list[Pool],
                    sequences: list[tuple[int, ...]]) -> list[list[list]]:
    """Concrete TP groups (lists of cluster Devices) for every stage. A run is a block of
    consecutive stages of one pool; a pipeline that starts and ends on one pool places its first
    and last runs as one block. Longest blocks first, each best-fit into a node of its pool."""
    free: dict[int, list[list[list]]] = {k: [] for k in range(len(pools))}
    pool_of_kind = {(p.gpu, p.tp, p.node_gpus, p.intra_gbs, p.nic_gbs, p.speed,
                     p.groups_per_node, p.zone): k for k, p in enumerate(pools)}
    tp_of_gpu = {p.gpu: p.tp for p in pools}
    devices_of: dict[str, list] = {}
    for d in cluster.devices():
        devices_of.setdefault(d.node, []).append(d)
    for node in cluster.nodes:
        tp = tp_of_gpu.get(node.gpu)
        if tp is None or node.num_gpus < tp:
            continue
        mine = devices_of[node.name]
        for kind, groups in _node_kinds(cluster, node, tp).items():
            # its zone's pool, or the pool of its kind across zones (make_pools)
            k = pool_of_kind.get(kind, pool_of_kind.get(kind[:-1] + (None,)))
            if k is not None:
                free[k].append([mine[g * tp:(g + 1) * tp] for g in groups])
    blocks = []   # (stage indices, pipeline, pool)
    for p, seq in enumerate(sequences):
        runs, s = [], 0
        while s < len(seq):
            e = s
            while e + 1 < len(seq) and seq[e + 1] == seq[s]:
                e += 1
            runs.append(list(range(s, e + 1)))
            s = e + 1
        if len(runs) > 1 and seq[0] == seq[-1]:
            runs[0] = runs[-1] + runs[0]        # last run, then the first: they share a node
            runs.pop()
        blocks += [(run, p, seq[run[0]]) for run in runs]
    # Per pool, its nodes by free TP groups: heaps of node indices per count, so the best fit
    # (the first node, in cluster order, of the fewest free groups that hold the run; else the
    # first of the most) is found without scanning every node (plans of thousands of GPUs).
    by_free: dict[int, dict[int, list[int]]] = {}
    for k, nodes in free.items():
        by_free[k] = {}
        for i, node in enumerate(nodes):
            if node:
                by_free[k].setdefault(len(node), []).append(i)
    placed: list[list] = [[None] * len(seq) for seq in sequences]
    for run, p, k in sorted(blocks, key=lambda b: (-len(b[0]), b[1], b[0][0])):
        todo = list(run)
        while todo:
            sizes = [n for n, heap in by_free[k].items() if heap]
            if not sizes:
                raise ConfigError("<plan>", "pipelines", f"more {pools[k].gpu} TP groups than "
                                  "the cluster has", f"{pools[k].count}")
            fitting = [n for n in sizes if n >= len(todo)]
            size = min(fitting) if fitting else max(sizes)
            i = heapq.heappop(by_free[k][size])
            node = free[k][i]
            for _ in range(min(len(todo), len(node))):
                placed[p][todo.pop(0)] = node.pop(0)
            if node:
                heapq.heappush(by_free[k].setdefault(len(node), []), i)
    return placed


def build_plan(problem: Problem, pools: list[Pool], options: list[PipelineOption],
               microbatches: list[int], recompute: bool) -> Plan:
    """The plan of these pipelines; ranks 0..W-1 are the GPUs it uses, in cluster order."""
    placement = place_pipelines(problem.cluster, pools, [o.pools for o in options])
    used = sorted((d for stages in placement for group in stages for d in group),
                  key=lambda d: d.rank)
    rank_of = {d.rank: i for i, d in enumerate(used)}
    pipelines = []
    for opt, m, stage_groups in zip(options, microbatches, placement):
        stages, start = [], 0
        for n, group in zip(opt.layers, stage_groups):
            stages.append(Stage(ranks=[rank_of[d.rank] for d in group], layers=(start, start + n)))
            start += n
        pipelines.append(Pipeline(stages=stages, num_microbatches=m))
    return Plan(cluster=problem.cluster.name, model=problem.model,
                micro_batch_size=problem.micro_batch_size,
                global_batch_size=problem.global_batch_size, seq_length=problem.seq_length,
                ranks=[RankInfo(i, d.node, d.local_rank, d.gpu) for i, d in enumerate(used)],
                pipelines=pipelines, activation_recompute=recompute,
                use_distributed_optimizer=problem.distributed_optimizer)


def evaluate(problem: Problem, plan: Plan) -> PlanCost:
    """Validate, cost and annotate a plan built in this space."""
    plan.validate()
    cost = evaluate_plan(plan, problem.cluster, problem.profile, with_timeline=False,
                         memory_headroom=problem.memory_headroom, charge=problem.charge)
    annotate_plan(plan, cost)
    return cost
