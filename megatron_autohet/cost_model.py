"""The cost model: per-iteration time and per-GPU peak memory of a plan, from a profile.

Pure functions; the planner, the baselines, the exhaustive search and ``autohet show/compare`` all
evaluate plans here, so every number they print comes from the same formulas.

Notation for a stage s of a pipeline with S stages and m micro-batches: ``f_s`` / ``b_s`` the
forward / backward time of one micro-batch through the stage's layers (+ the embedding on the
first stage, + the output layer and loss on the last), with activation recompute ``b_s`` includes
one more forward of the layers; ``t_s = f_s + b_s``.

Bytes are counted in the precision of the profile (``Profile.precision``, the job's: bf16 for
the estimates and for profiles measured on GPUs, fp32 for those measured on a CPU); the figures
below are bf16's.

* **P2P**: each micro-batch sends its activation [s, b, h] (2 bytes/element) forward over the
  boundary after stage s and receives the gradient of the same size back:
  ``c_s = 2 * b*s*h*2 / bw(s, s+1)``, with ``bw`` the link between the two stages' nodes
  (``Cluster.link_bandwidth_gbs``: NVLink/PCIe inside a node, the slower NIC across nodes);
  ``c_{S-1} = 0``. Every TP rank of a stage sends its full copy to its peer, in parallel.
* **Pipeline (1F1B)**: ``T_pipe = sum_s (t_s + c_s) + (m - 1) * max_s (t_s + c_s)``: the first
  micro-batch flows through every stage and back (the fill and drain), and each further one adds
  the slowest stage's period, its communication not overlapped. This charges transfers as
  blocking (stock megatron waits for its sends); the per-stage warm-up depths of a plan are not
  in it (see "Warm-up depth" below).
* **Interleaved pipelines** (a pipeline's ``virtual_stages`` v > 1, megatron-core's interleaved
  1F1B): each stage runs its layers as v chunks, so a micro-batch passes the stages v times, each
  pass ``t_s / v`` of compute and a transfer ``c_s`` (the last stage's goes round to the first
  stage: the ring closes over that link): ``T_pipe = sum_s (t_s / v + c_s) + (m v - 1) * max_s
  (t_s / v + c_s)``, the fill and drain v times shorter, the transfers v times as many. Where a
  stage's chunks differ in size every pass is priced at its largest chunk's share of ``t_s``
  instead of ``t_s / v`` (the slowest pass sets the pace). A stage
  holds the activations of ``ceil((2 (S - s - 1) + (v - 1) S + 1) / v)`` micro-batches' worth of
  layers (megatron's interleaved warm-up, each of 1/v of the stage). No event-level timeline is
  simulated for them.
* **Gradient sync** is layer-wise (layout/topology.sync_group_specs): a symmetric group of D
  holders is a ring all-reduce of one TP shard's fp32 gradients among D GPUs,
  ``2 (D-1)/D * bytes / bw_min`` with ``bw_min`` the slowest link among the group's GPUs; an
  asymmetric group (holders of different TP degree, opt-in) is charged the all-reduce of the full,
  unsharded gradients (the re-sharding moves at least that much). A GPU runs its groups one after
  the other, groups of disjoint GPUs run concurrently: ``T_sync = max over GPUs of the sum of its
  groups' times``.
* **Overlapped gradient sync** (a plan's ``overlap_grad_reduce``, Megatron-LM's
  ``--overlap-grad-reduce``; runtime/grad_sync.py): a GPU launches its groups during the last
  micro-batch's backward, in the runtime's launch order (the post-process part, the layers from
  the last, the embeddings), each once its gradients are final and the one before it is done,
  so only what the backward after a group cannot hide is charged. Over a stage of layers
  ``[a, c)`` with backward ``b_s``, a layer run ``[lo, hi)`` is ready ``b_s (c - lo) / (c - a)``
  into the backward (its lowest layer done; the layers share the backward evenly), the
  post-process part at once, the embeddings at its end; a group's collective runs its time
  above from ``max(ready, end of the one before)``, and the GPU is charged ``max(0, end of its
  last - b_s)``. The distributed optimizer's weight all-gather comes after the step and is
  never hidden. Not modelled: a group's members reaching it at different times (each GPU is
  priced on its own backward), a run split into several buckets (priced as one: the estimate
  hides less than the runtime may).
* **Distributed optimizer** (a plan's ``use_distributed_optimizer``, Megatron-LM's
  ``--use-distributed-optimizer``; runtime/distributed_optimizer.py): each sync group of D ranks
  shards its parameters' master weights and Adam moments D ways. Its sync is a reduce-scatter of
  the fp32 gradients plus an all-gather of the weights in their dtype, ``(D-1)/D * (4 + 2) *
  params / bw_min`` in bf16 instead of the all-reduce's ``2 (D-1)/D * 4 * params / bw_min``; a
  GPU's Adam step and optimizer state cover its shards only (``Precision.
  state_bytes_per_param(shards)``, with ``shards`` the stage's parameters over the elements it
  keeps state for: D per symmetric group; an asymmetric group shards the full tensors over all
  its ranks, as the runtime does).
* **Optimizer**: Adam on fp32 master weights is memory-bound. Per parameter it reads the fp32
  gradient (4 B), reads and writes the master weight (8 B) and both moments (16 B) and writes the
  bf16 weight (2 B): 30 B / (memory bandwidth * MEMORY_EFFICIENCY); ``T_opt`` = max over GPUs.
* **Iteration**: ``T_iter = max_p T_pipe(p) + T_sync + T_opt``; tokens/s = global batch * seq /
  T_iter, where a pipeline whose plan sets non-standard warm-up depths saves what
  :func:`simulate_1f1b` saves at those depths over the standard ones (below).
* **Price**: with a ``spot_price`` (USD per GPU-hour) on every node the plan uses, the plan's
  rate in USD per hour is, by the plan's ``charge`` (CHARGES): ``per-node`` (the default) every
  GPU of every node that holds a rank of the plan, since spot capacity is rented by the node (a
  partly used node is paid whole, its idle GPUs included); ``per-gpu`` only the GPUs holding a
  rank, for fleets that rent single GPUs. Nodes without a rank are not charged either way (a
  fleet can release them). USD per million tokens = rate / 3600 * T_iter / tokens per iteration
  * 1e6.
* **Zones** (a cluster whose nodes name zones, spec/cluster.py): two nodes in different zones
  are joined by ``Cluster.link``: the slower NIC or the zone link's bandwidth, whichever is
  smaller, plus the zone link's latency and egress price (between zones of one region, or of
  two regions). P2P: each of a micro-batch's two messages waits the latency, ``c_s = 2 *
  b*s*h*2 / bw + 2 * latency``. Gradient sync: a group's ring visits each zone's members one
  after the other, regions together (the cheapest ring; NCCL orders its rings by topology),
  so a ring over z >= 2 zones has z edges between zones, each carrying what one member sends;
  a zone link is shared by every sync group whose ring crosses that zone pair, each getting
  ``bandwidth / k`` of it (k such groups), so the group's ``bw_min`` is the smaller of its
  slowest node link and that share; each of the ring's ``2 (D-1)`` steps adds the slowest
  crossed link's latency. Egress, USD per iteration (``PlanCost.egress_usd_per_iteration``):
  every byte crossing a zone link at its price: per micro-batch and boundary between zones a
  copy of the activation for each receiving TP rank and of its gradient for each sending one
  (runtime/p2p.py), per sync group each ring edge between zones carrying ``2 (D-1)/D`` of the
  fp32 gradients (the distributed optimizer: ``(D-1)/D`` of gradients and weights). USD per
  million tokens = (rate / 3600 + egress per iteration / T_iter) / tokens/s * 1e6, which the
  cost objective ranks by; ``usd_per_hour`` stays the GPUs' rate. Simplifications: the sync
  groups crossing a zone pair are counted as if all ran at once (groups a GPU runs one after the
  other included: pessimistic); P2P transfers are priced as if each boundary had the zone link
  to itself (pipelines' sends interleave in 1F1B; the TP copies of one boundary share it in
  truth), and P2P and gradient sync never overlap (they are phases of the iteration). A cluster
  without zones crosses none of this: its figures are what they were.
* **Slow GPUs** (a cluster's ``speeds``, spec/cluster.py: a straggler measured by the job or
  stated in the cluster file): a stage's ``f_s`` and ``b_s`` are divided by the speed of its
  slowest GPU (a TP group computes in lock step), so a GPU at 0.6x its type computes its stage
  in 1 / 0.6 of the profile's time; its memory, P2P and optimizer step are its type's.
* **Sources**: which figures of the profile the plan's GPU types and TP degrees were priced
  from: measured, calibrated or estimated (profiling/profile.py).
* **Memory** of a GPU of stage s: ``params * 18 B`` (bf16 weight 2, fp32 gradient 4, fp32 master
  weight 4, Adam moments 8) + ``n_s`` micro-batches of activations, where 1F1B keeps
  ``n_s = min(warm-up + 1, m)`` in flight and warm-up = S - s - 1 unless the plan sets it; with
  recompute a micro-batch keeps only each layer's input, plus one layer's full activations while
  that layer is recomputed; on the last stage the output layer's kept activations include the
  fp32 cross-entropy buffer, and its 16-bit logits are alive beside it while the loss runs
  (:func:`stage_memory_bytes`); + MEMORY_RESERVED_GIB for the CUDA context and NCCL buffers; +
  on a member of an asymmetric sync group, the runtime's full-size fp32 staging buffer. With
  tied embeddings a stage that is both first and last holds the shared matrix once. A stage
  fits when this peak is within ``(1 - memory headroom)`` of its GPU's memory
  (DEFAULT_MEMORY_HEADROOM: the allocator's fragmentation).

Warm-up depth (HAPT-style 1F1B): modelled in the event-level simulation only
--------------------------------------------------------------------------------
:func:`simulate_1f1b` plays the runtime's semantics (runtime/p2p.py: sends are posted and never
waited for, receives block) with the plan's depths ``w_s``, assuming a posted send moves its
bytes at once, one message after the other per link and direction (``c_s / 2`` each; eager
delivery). Its steady state obeys, per stage interval [a, z], ``(w_a - w_z + 1) P >= sum_{a..z}
t_i + sum_{a..z-1} c_i`` (micro-batch k crosses the interval both ways while a runs w_a and z
w_z micro-batches ahead), plus ``P >= t_s`` and ``P >= c_s / 2``; so a deeper warm-up before a
slow boundary lets the transfer overlap compute. That steady-state form is NOT a closed form of
the makespan: with finite m the transients matter (checked on 3000 random pipelines: at the
standard depths ``sum (t_s + c_s) + (m - 1) P`` bounds the simulation from above, up to 48% loose
for small m; with deep warm-ups on link-bound pipelines the simulation runs up to 31% longer,
because a deep warm-up downstream of a saturated link delays the first backward). The iteration
time of a standard-depth pipeline therefore still uses the blocking form above, which bounds the
simulation at those depths (test_cost_model). A pipeline with non-standard depths is charged the
blocking form minus the simulated saving, ``T_pipe - (sim(standard) - sim(w))``: the gain is
the simulation's, and the figure stays comparable with standard-depth plans and the baselines
(charging the bare simulated makespan would credit a plan with the closed form's slack, up to
48%, for merely being priced differently). The planner's post-pass (planner/warmup.py) picks
depths by simulation and keeps them only where this saving shortens the iteration.

What is modelled, and what was measured: the speed effect rests on eager delivery. gloo sends
only once the receive is posted, so the communicator posts each receive one micro-batch ahead
(runtime/p2p.py); one message per direction can then be in flight while the receiver computes,
not several as simulated. gloo also carried the two directions of a rank pair one after the
other on one process group (one TCP connection per pair: 8 x 256 KiB each way took 1.82 s on a
shaped link vs 0.87 s one way), so the runtime gives every boundary one group per direction
(runtime/parallel_state.py). With that, scripts/bench_hapt.py (two stages, 8 micro-batches,
20 Mbit/s tbf-shaped link, 105 ms per activation) measured a stage-0 warm-up of 2/4/8 at
0.886/0.899/0.898 of the standard iteration time (paired medians), saving 186-212 ms per
iteration where this simulation, fed the measured stage times, predicts 291 ms (1332 -> 1041
ms for the schedule alone): the direction and the depth it takes (2 gains all) are right, the
size about 1.4x too large. The memory effect (min(w_s + 1, m) micro-batches of activations) is
real either way.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from megatron_autohet.errors import ConfigError
from megatron_autohet.layout.topology import gradient_ready_key, sync_group_specs
from megatron_autohet.plan import Plan, standard_warmup_depths
from megatron_autohet.profiling.estimate import (MEMORY_EFFICIENCY, layer_param_count,
                                                 norm_param_count, ring_allreduce_s)
from megatron_autohet.profiling.profile import PARTS, Profile, ProfileEntry
from megatron_autohet.spec.cluster import Cluster, Link
from megatron_autohet.spec.gpus import GPUType
from megatron_autohet.spec.model import ModelSpec
from megatron_autohet.spec.precision import MAIN_GRAD_BYTES, Precision

GIB = 1024 ** 3
# Plans are priced in the precision their profile describes (``Profile.precision``: what the
# job trains in; the estimates are for Megatron's bf16 mixed precision), from spec/precision.py,
# which the runtime allocates from too: in bf16 18 bytes of state per parameter (without the
# distributed optimizer), 16-bit activations and P2P messages, a 30-byte Adam step; gradients
# are fp32 in every precision.
GRAD_BYTES_PER_PARAM = MAIN_GRAD_BYTES
# CUDA context and NCCL buffers: memory a GPU cannot give to the model.
MEMORY_RESERVED_GIB = 1.5
# Fraction of each GPU's memory a plan leaves free (``--memory-headroom``). PyTorch's caching
# allocator holds more than the live tensors: blocks split for one activation size are reused
# for others, and transformer training typically runs 5-10% above its live bytes in reserved
# memory; the activation figures are estimates (or one measurement) and the runtime has
# transients beside the ones counted here. 10% covers the fragmentation with some margin for
# the estimates, so a plan that "fits" does not fill a GPU to its last byte.
DEFAULT_MEMORY_HEADROOM = 0.1
# How a plan's GPUs are paid for (module doc, "Price"): spot capacity is rented by the node.
CHARGES = ("per-node", "per-gpu")
DEFAULT_CHARGE = "per-node"


def usable_memory_gib(gpu: GPUType, memory_headroom: float = DEFAULT_MEMORY_HEADROOM) -> float:
    """What a plan may fill of one GPU of this type."""
    return gpu.memory_gib * (1.0 - memory_headroom)


def plan_memory_headroom(plan: Plan) -> float:
    """The headroom a plan was made with (its file records it under ``predicted``, checked by
    plan.py), the default for a plan file without one."""
    return plan.predicted.get("memory_headroom", DEFAULT_MEMORY_HEADROOM)


def check_charge(value: str, flag: str = "--charge", file: str = "<arguments>") -> str:
    if value not in CHARGES:
        raise ConfigError(file, flag, f"got {value!r}", ", ".join(CHARGES))
    return value


def plan_charge(plan: Plan) -> str:
    """How the plan's price was charged (recorded under ``predicted``), the default for a plan
    file without one."""
    return check_charge(plan.predicted.get("charge", DEFAULT_CHARGE), "predicted.charge",
                        "<plan>")


def plan_profile(plan: Plan) -> Profile | None:
    """The profile the plan was priced on (its file records it), None for analytic estimates."""
    if plan.profile is None:
        return None
    return Profile.from_dict(plan.profile, "<plan>: profile")


def record_profile(plan: Plan, profile: Profile | None) -> None:
    """The plan was priced on ``profile`` (None: analytic estimates): its re-plans price on the
    same (planner/replan.py), whatever flags the process re-planning has."""
    plan.profile = None if profile is None else profile.to_dict()


def check_memory_headroom(value: float, flag: str = "--memory-headroom") -> float:
    if not 0.0 <= value < 1.0:
        raise ConfigError("<arguments>", flag, f"got {value!r}",
                          "a fraction of GPU memory in [0, 1), e.g. 0.1")
    return value


# ---- per-stage formulas (the planner calls these directly) ---------------------------------------

def stage_compute_s(entry: ProfileEntry, num_layers: int, first: bool, last: bool,
                    recompute: bool) -> tuple[float, float]:
    """(forward, backward) time of one micro-batch through a stage; recompute re-runs the layers'
    forward inside the backward pass (``ProfileEntry.stage_compute_s``, the one formula)."""
    return entry.stage_compute_s(num_layers, first, last, recompute)


def activation_transfer_bytes(model: ModelSpec, micro_batch_size: int, seq_length: int,
                              precision: Precision) -> float:
    return micro_batch_size * seq_length * model.hidden_size * precision.element_bytes


def p2p_s(model: ModelSpec, micro_batch_size: int, seq_length: int, bandwidth_gbs: float,
          precision: Precision, latency_s: float = 0.0) -> float:
    """Per micro-batch: the activation forward plus its gradient backward over one boundary,
    two messages, each waiting the link's latency (module doc, "Zones")."""
    return (2 * activation_transfer_bytes(model, micro_batch_size, seq_length, precision)
            / (bandwidth_gbs * 1e9) + 2 * latency_s)


def stage_param_count(entry: ProfileEntry, model: ModelSpec, num_layers: int, first: bool,
                      last: bool) -> int:
    params = num_layers * entry.layer.param_count
    if first:
        params += entry.embedding.param_count
    if last:
        params += entry.output.param_count
    if first and last and model.tie_embeddings:
        params -= model.padded_vocab_size([entry.tp]) * model.hidden_size // entry.tp
    return params


def logits_bytes(model: ModelSpec, tp: int, micro_batch_size: int, seq_length: int,
                 precision: Precision) -> float:
    """The output layer's logits of one micro-batch on one GPU (its vocabulary shard), in the
    activations' dtype."""
    return (micro_batch_size * seq_length * model.padded_vocab_size([tp]) // tp
            * precision.element_bytes)


def stage_memory_bytes(entry: ProfileEntry, model: ModelSpec, num_layers: int, first: bool,
                       last: bool, recompute: bool, in_flight: int, precision: Precision,
                       optimizer_shards: float = 1.0) -> float:
    """Peak bytes on one GPU of the stage with ``in_flight`` micro-batches' activations alive;
    ``optimizer_shards``: over how many ranks the distributed optimizer spreads the stage's
    master weights and Adam moments (1: not distributed).

    Besides the kept activations (the profile's per-micro-batch figures, the output layer's
    fp32 cross-entropy buffer among them) one transient is alive at the peak: with recompute,
    one layer's full activations while it is recomputed; on the last stage, the 16-bit logits
    beside their fp32 copy while the cross entropy runs (and their 16-bit gradient beside the
    fp32 one in its backward). They never coincide, so the larger one counts."""
    params = stage_param_count(entry, model, num_layers, first, last)
    if recompute:
        per_mb = num_layers * entry.layer.activation_bytes_recompute
        working = entry.layer.activation_bytes if num_layers else 0.0
    else:
        per_mb = num_layers * entry.layer.activation_bytes
        working = 0.0
    if first:
        per_mb += (entry.embedding.activation_bytes_recompute if recompute
                   else entry.embedding.activation_bytes)
    if last:
        per_mb += (entry.output.activation_bytes_recompute if recompute
                   else entry.output.activation_bytes)
        working = max(working, logits_bytes(model, entry.tp, entry.micro_batch_size,
                                            entry.seq_length, precision))
    state_bytes = precision.state_bytes_per_param(optimizer_shards)
    return params * state_bytes + in_flight * per_mb + working + MEMORY_RESERVED_GIB * GIB


def optimizer_step_s(param_count: float, memory_bandwidth_gbs: float,
                     precision: Precision) -> float:
    return (param_count * precision.optimizer_traffic_bytes_per_param
            / (memory_bandwidth_gbs * 1e9 * MEMORY_EFFICIENCY))


def pipeline_time_s(stage_periods: list[float], num_microbatches: int,
                    virtual_stages: int = 1) -> float:
    """1F1B time from per-stage periods ``t_s / v + c_s`` (one chunk's compute and transfer):
    sum + (m v - 1) * max (blocking transfers; module doc, "Interleaved pipelines")."""
    return sum(stage_periods) + (num_microbatches * virtual_stages - 1) * max(stage_periods)


def _largest_chunk_share(stage) -> float:
    """The fraction of a stage's layers its largest model chunk holds (1 in a plain pipeline,
    1 / v where its v chunks are equal)."""
    if not stage.virtual_layers:
        return 1.0
    return max(end - start for start, end in stage.chunks) / stage.num_layers


def grad_allreduce_s(param_count: float, holders: int, bandwidth_gbs: float) -> float:
    return ring_allreduce_s(param_count * GRAD_BYTES_PER_PARAM, holders, bandwidth_gbs)


def weight_all_gather_s(param_count: float, holders: int, bandwidth_gbs: float,
                        precision: Precision) -> float:
    """The distributed optimizer's all-gather of the updated weights in their dtype (the part
    of :func:`grad_reduce_scatter_all_gather_s` after the step)."""
    return ring_allreduce_s(param_count * precision.element_bytes, holders, bandwidth_gbs) / 2


def overlapped_sync_s(backward_s: float, launches: list[tuple[float, float, float]]) -> float:
    """A GPU's sync not hidden by its last backward (module doc, "Overlapped gradient sync"):
    ``launches`` in launch order, each (ready after this many seconds of the backward, seconds
    of its collective the backward can hide, seconds after the step)."""
    end = 0.0
    for ready, during, _ in launches:
        end = max(end, ready) + during
    return max(0.0, end - backward_s) + sum(after for _, _, after in launches)


def sync_ready_s(kind: str, layers: tuple[int, int], stage_layers: tuple[int, int],
                 backward_s: float) -> float:
    """When a sync group's gradients are final in a stage's last backward (module doc)."""
    if kind == "post_process":
        return 0.0
    if kind != "layers":
        return backward_s               # the embeddings: the backward's end
    a, c = stage_layers
    return backward_s * (c - max(layers[0], a)) / (c - a)


def grad_reduce_scatter_all_gather_s(param_count: float, holders: int, bandwidth_gbs: float,
                                     precision: Precision) -> float:
    """The distributed optimizer's sync: reduce-scatter of the fp32 gradients, all-gather of the
    weights in their dtype (each half of a ring all-reduce of those bytes)."""
    return (ring_allreduce_s(param_count * GRAD_BYTES_PER_PARAM, holders, bandwidth_gbs)
            + ring_allreduce_s(param_count * precision.element_bytes, holders,
                               bandwidth_gbs)) / 2


# ---- whole-plan evaluation -----------------------------------------------------------------------

@dataclass(frozen=True)
class TimelineEvent:
    start_s: float
    end_s: float
    kind: str         # "fwd" or "bwd"
    microbatch: int


@dataclass
class StageCost:
    pipeline: int
    stage: int
    gpu: str
    tp: int
    layers: tuple[int, int]
    forward_s: float            # one micro-batch
    backward_s: float           # one micro-batch, recompute included
    p2p_s: float                # outgoing boundary, activation + gradient, per micro-batch
    p2p_bandwidth_gbs: float | None
    in_flight_microbatches: int
    param_count: int            # per GPU
    memory_gib: float           # peak per GPU
    memory_limit_gib: float
    sync_s: float               # gradient collectives of its busiest GPU, one after the other
                                # (with overlap_grad_reduce: what the backward does not hide)
    optimizer_s: float
    timeline: list[TimelineEvent] = field(default_factory=list)

    @property
    def time_s(self) -> float:
        return self.forward_s + self.backward_s

    @property
    def fits(self) -> bool:
        return self.memory_gib <= self.memory_limit_gib


@dataclass
class PipelineCost:
    num_microbatches: int
    time_s: float
    stages: list[StageCost]


@dataclass
class PlanCost:
    iteration_time_s: float
    pipeline_time_s: float      # max over pipelines
    grad_sync_s: float
    optimizer_s: float
    tokens_per_s: float
    pipelines: list[PipelineCost]
    # GPUs of the cluster the plan leaves out, per type
    idle_gpus: dict[str, int] = field(default_factory=dict)
    # USD per million tokens (module doc, "Price"); None when a used node has no spot price.
    usd_per_million_tokens: float | None = None
    # "<gpu> tp<t>" -> {part: source} for the profile entries the plan used (module doc).
    sources: dict[str, dict[str, str]] = field(default_factory=dict)
    memory_headroom: float = DEFAULT_MEMORY_HEADROOM    # what "fits" left free of each GPU
    # USD per hour of the GPUs the plan pays for, by ``charge`` (module doc, "Price"); None
    # when a used node has no spot price.
    usd_per_hour: float | None = None
    charge: str = DEFAULT_CHARGE
    # USD per iteration of the bytes crossing zones (module doc, "Zones"); in
    # ``usd_per_million_tokens``, not in ``usd_per_hour`` (the GPUs' rate)
    egress_usd_per_iteration: float = 0.0

    def hours_to_train(self, tokens: float) -> float:
        return tokens / self.tokens_per_s / 3600

    @property
    def stages(self) -> list[StageCost]:
        return [s for p in self.pipelines for s in p.stages]

    @property
    def fits_memory(self) -> bool:
        return all(s.fits for s in self.stages)

    @property
    def peak_memory_gib(self) -> float:
        return max(s.memory_gib for s in self.stages)

    def predicted(self) -> dict:
        """The ``predicted`` mapping of a plan file."""
        return {"iteration_time_s": round(self.iteration_time_s, 6),
                "tokens_per_s": round(self.tokens_per_s, 1),
                "pipeline_time_s": round(self.pipeline_time_s, 6),
                "grad_sync_s": round(self.grad_sync_s, 6),
                "optimizer_s": round(self.optimizer_s, 6),
                "peak_memory_gib": round(self.peak_memory_gib, 3),
                "fits_memory": self.fits_memory,
                "idle_gpus": dict(self.idle_gpus),
                "usd_per_million_tokens": (None if self.usd_per_million_tokens is None
                                           else round(self.usd_per_million_tokens, 6)),
                "memory_headroom": self.memory_headroom,
                "usd_per_hour": (None if self.usd_per_hour is None
                                 else round(self.usd_per_hour, 6)),
                "charge": self.charge,
                "profile_sources": {k: dict(v) for k, v in self.sources.items()},
                # only where bytes cross zones: a plan without is what it always was
                **({"egress_usd_per_iteration": float(f"{self.egress_usd_per_iteration:.9g}")}
                   if self.egress_usd_per_iteration else {})}


@dataclass(frozen=True)
class SyncRing:
    """What a sync group's ring crosses (:func:`_sync_rings`)."""

    bandwidth_gbs: float        # the slowest link a member's sends take, a zone link's share
    latency_s: float            # the slowest crossed link's, paid per ring step
    egress_usd_per_gb: float    # the sum over the ring's edges between zones of their prices


def _ring_zone_edges(cluster: Cluster, nodes: list[str]) -> list[tuple[str, str]]:
    """The edges between zones of a ring over these nodes (sorted zone pairs): the ring visits
    each zone's members one after the other, regions together (module doc, "Zones")."""
    zones = sorted({cluster.node(n).zone for n in nodes},
                   key=lambda z: (cluster.regions[z], z)) if cluster.regions else []
    if len(zones) < 2:
        return []
    return [tuple(sorted((a, b))) for a, b in zip(zones, zones[1:] + zones[:1])]


def _sync_rings(cluster: Cluster, groups_nodes: list[list[str]]) -> list[SyncRing]:
    """Each sync group's ring (module doc, "Zones"): its slowest node link
    (:func:`_slowest_link_gbs`), and where it crosses zones each zone link's bandwidth shared
    by every group crossing that zone pair, the slowest crossed latency, the edges' prices."""
    edges = [_ring_zone_edges(cluster, nodes) for nodes in groups_nodes]
    sharing = Counter(pair for ring in edges for pair in set(ring))
    out = []
    for nodes, ring in zip(groups_nodes, edges):
        bw = _slowest_link_gbs(cluster, nodes)
        if not ring:
            out.append(SyncRing(bw, 0.0, 0.0))
            continue
        crossed = {pair: cluster.zone_link(*pair) for pair in ring}
        bw = min([bw] + [link.bandwidth_gbs / sharing[pair] for pair, link in crossed.items()])
        out.append(SyncRing(bw, max(link.latency_ms for link in crossed.values()) / 1e3,
                            sum(crossed[pair].egress_usd_per_gb for pair in ring)))
    return out


def _slowest_link_gbs(cluster: Cluster, ranks_nodes: list[str]) -> float:
    """Slowest link between two members: a shared node's intra-node link, or a NIC. A pair of
    nodes crosses the slower of their two NICs, so with 2+ nodes the slowest pair is simply the
    slowest NIC among them (linear in the group, where comparing pairs was quadratic)."""
    counts = Counter(ranks_nodes)
    nodes = [cluster.node(n) for n in counts]
    speeds = [n.intra_node_bandwidth_gbs for n in nodes if counts[n.name] > 1]
    if len(nodes) > 1:
        speeds.append(min(n.inter_node_bandwidth_gbs for n in nodes))
    return min(speeds) if speeds else float("inf")


def sync_group_elements(model: ModelSpec, kind: str, n_layers: int, tp: int, vocab: int
                        ) -> int:
    """Elements of one sync group's tensors that a holder of TP degree ``tp`` keeps: one TP
    shard of the split tensors plus every TP-replicated one (norms, row-parallel biases,
    position embeddings); ``tp=1`` gives the full, unsharded tensors. ``vocab``: the padded
    vocabulary. The planner's sync terms (planner/space.py) count with it too."""
    if kind == "layers":
        return n_layers * layer_param_count(model, tp)
    if kind == "word_embeddings":
        return vocab * model.hidden_size // tp
    if kind == "position_embeddings":
        # replicated on every TP rank; GPTModel sizes it by the model's seq_length
        return model.seq_length * model.hidden_size
    # "post_process": final norm (replicated), untied output layer (vocab-parallel)
    output = 0 if model.tie_embeddings else vocab * model.hidden_size // tp
    return norm_param_count(model) + output


def _sync_group_params(plan: Plan, with_local: bool = True) -> list[tuple]:
    """``(spec, group ranks, parameters, {rank: elements it holds})`` of every sync group of 2+
    ranks. ``parameters`` are the elements one member reduces: one TP shard when symmetric, the
    full tensors (TP-replicated ones once) when asymmetric. ``with_local`` False leaves the
    per-rank elements out (None): only the distributed optimizer's state needs them."""
    model = plan.model
    tp_of_rank = {r: stage.tp for pipe in plan.pipelines for stage in pipe.stages
                  for r in stage.ranks}
    # every copy of the vocabulary is padded alike, for the plan's TP degrees (runtime)
    vocab = model.padded_vocab_size(set(tp_of_rank.values()))
    out = []
    for spec in sync_group_specs(plan):
        n_layers = spec.layers[1] - spec.layers[0] if spec.kind == "layers" else 0
        # per TP degree, not per rank: a group of a 4096-GPU plan has hundreds of members
        of_tp = {t: sync_group_elements(model, spec.kind, n_layers, t, vocab)
                 for t in {len(h) for h in spec.holders}}
        for group in spec.groups():
            if len(group) < 2:
                continue
            local = {r: of_tp[tp_of_rank[r]] for r in group} if with_local else None
            params = (of_tp[tp_of_rank[group[0]]] if spec.symmetric
                      else sync_group_elements(model, spec.kind, n_layers, 1, vocab))
            out.append((spec, group, params, local))
    return out


def _unsharded_state_params(groups: list[tuple]) -> dict[int, float]:
    """Per rank, the parameters whose optimizer state the distributed optimizer moves to other
    ranks: of each group it keeps ``1/D`` of what the group reduces (module doc)."""
    away: dict[int, float] = {}
    for _, group, params, local in groups:
        for r in group:
            away[r] = away.get(r, 0.0) + local[r] - params / len(group)
    return away


def _stage_shape(plan: Plan, cluster: Cluster, profile: Profile, memory_headroom: float,
                 sources: dict[str, dict[str, str]], gpu: str, tp: int, num_layers: int,
                 first: bool, last: bool, bw: float | None, latency_s: float, in_flight: int,
                 away: float, speed: float) -> tuple:
    """(forward, backward, P2P seconds, parameters, peak GiB, usable GiB, optimizer seconds) of
    a stage of this shape (evaluate_plan); records its profile entry's sources. ``speed``: its
    slowest GPU's (module doc, "Slow GPUs")."""
    model, precision = plan.model, profile.precision
    entry = profile.get(gpu, tp, plan.micro_batch_size, plan.seq_length)
    if f"{gpu} tp{tp}" not in sources:
        sources[f"{gpu} tp{tp}"] = {part: getattr(entry, part).source for part in PARTS}
    fwd, bwd = stage_compute_s(entry, num_layers, first, last, plan.activation_recompute)
    fwd, bwd = fwd / speed, bwd / speed
    comm = 0.0 if bw is None else p2p_s(model, plan.micro_batch_size, plan.seq_length, bw,
                                        precision, latency_s)
    params = stage_param_count(entry, model, num_layers, first, last)
    # the elements whose master weight and moments this GPU keeps (all without sharding)
    state_params = params - away
    memory = stage_memory_bytes(entry, model, num_layers, first, last,
                                plan.activation_recompute, in_flight, precision,
                                optimizer_shards=params / state_params)
    gpu_type = cluster.gpu_types[gpu]
    return (fwd, bwd, comm, params, memory / GIB, usable_memory_gib(gpu_type, memory_headroom),
            optimizer_step_s(state_params, gpu_type.memory_bandwidth_gbs, precision))


def evaluate_plan(plan: Plan, cluster: Cluster, profile: Profile, with_timeline: bool = True,
                  memory_headroom: float = DEFAULT_MEMORY_HEADROOM,
                  charge: str = DEFAULT_CHARGE) -> PlanCost:
    """Predicted iteration time, throughput, per-stage time and memory of a plan (see module
    doc); a stage fits when its peak is within ``usable_memory_gib`` of its GPU. Bytes are
    counted in the profile's precision (the job's); the price is charged by ``charge``."""
    precision = profile.precision
    node_of = [r.node for r in plan.ranks]
    groups = _sync_group_params(plan, with_local=plan.use_distributed_optimizer)
    spec_order = {id(spec): i for i, (spec, *_) in enumerate(groups)}     # plan order
    unsharded = _unsharded_state_params(groups) if plan.use_distributed_optimizer else {}
    pipelines: list[PipelineCost] = []
    stage_of_rank: dict[int, StageCost] = {}
    sources: dict[str, dict[str, str]] = {}
    # A stage's figures depend only on its shape (GPU type, TP degree, layers, position, link
    # to the next stage, micro-batches in flight, optimizer state moved away): computed once
    # per shape, since a plan of thousands of GPUs repeats a few shapes hundreds of times.
    shapes: dict[tuple, tuple] = {}
    links: dict[tuple[str, str], Link] = {}
    # USD of the bytes crossing zones per iteration (module doc, "Zones")
    egress_usd = 0.0
    activation_bytes = activation_transfer_bytes(plan.model, plan.micro_batch_size,
                                                 plan.seq_length, precision)
    simulated: dict[tuple, tuple[float, list[list[TimelineEvent]]]] = {}
    standards: dict[tuple[int, int], list[int]] = {}
    for p, pipe in enumerate(plan.pipelines):
        S, m, v = len(pipe.stages), pipe.num_microbatches, pipe.virtual_stages
        if (S, m) not in standards:
            standards[S, m] = standard_warmup_depths(S, m)
        # the plan's depths where it sets them, else the standard ones (read, never changed)
        standard_depths = standards[S, m]
        explicit = any(st.warmup_microbatches is not None for st in pipe.stages)
        depths = pipe.warmup_depths() if explicit else standard_depths
        stages: list[StageCost] = []
        for s, stage in enumerate(pipe.stages):
            gpu, tp = plan.ranks[stage.ranks[0]].gpu, len(stage.ranks)
            first, last = s == 0, s == S - 1
            bw, latency = None, 0.0
            if not last or pipe.interleaved:          # an interleaved pipeline is a ring
                after = pipe.stages[(s + 1) % S]
                pair = (node_of[stage.ranks[0]], node_of[after.ranks[0]])
                link = links.get(pair)
                if link is None:
                    link = links[pair] = cluster.link(*pair)
                bw, latency = link.bandwidth_gbs, link.latency_s
                # forward, a copy for each receiving TP rank; backward, one for each sending
                # TP rank (runtime/p2p.py)
                # each micro-batch crosses v times, v - 1 where the ring closes
                crossings = m * (v - 1 if last else v)
                egress_usd += (crossings * (len(after.ranks) + len(stage.ranks))
                               * activation_bytes / 1e9 * link.egress_usd_per_gb)
            in_flight = (min(depths[s] + 1, m) if not pipe.interleaved
                         else min(-(-(2 * (S - s - 1) + (v - 1) * S + 1) // v), m))
            away = unsharded.get(stage.ranks[0], 0.0)
            # a TP group computes in lock step: at its slowest GPU's speed
            speed = min(cluster.speed(plan.ranks[r].node, plan.ranks[r].local_rank)
                        for r in stage.ranks) if cluster.speeds else 1.0
            key = (gpu, tp, stage.num_layers, first, last, bw, latency, in_flight, away, speed)
            shape = shapes.get(key)
            if shape is None:
                shape = shapes[key] = _stage_shape(plan, cluster, profile, memory_headroom,
                                                   sources, *key)
            fwd, bwd, comm, params, memory_gib, limit_gib, optimizer_s = shape
            cost = StageCost(p, s, gpu, tp, stage.layers, fwd, bwd, comm, bw, in_flight,
                             params, memory_gib, limit_gib, 0.0, optimizer_s)
            stages.append(cost)
            for r in stage.ranks:
                stage_of_rank[r] = cost
        # a pass of a stage runs one chunk: priced at its largest (chunks may differ in size)
        time = pipeline_time_s([c.time_s * _largest_chunk_share(st) + c.p2p_s
                                for c, st in zip(stages, pipe.stages)], m, v)
        standard = depths == standard_depths
        if not pipe.interleaved and (not standard or with_timeline):
            # Pipelines of equal stage times, micro-batches and depths have one schedule:
            # simulated once, its timeline copied (a plan may hold hundreds of them).
            key = (tuple((c.forward_s, c.backward_s, c.p2p_s) for c in stages), m,
                   tuple(depths))
            done = simulated.get(key)
            if done is None:
                if standard:
                    saving = 0.0
                    simulate_1f1b(stages, m, depths)
                else:
                    # HAPT depths: the simulated saving over the standard depths (module
                    # doc); the second simulation leaves the plan's own timeline in the stages
                    saving = simulate_1f1b(stages, m) - simulate_1f1b(stages, m, depths)
                done = simulated[key] = (saving, [c.timeline for c in stages])
            else:
                for c, events in zip(stages, done[1]):
                    c.timeline = list(events)
            time -= done[0]
        pipelines.append(PipelineCost(m, time, stages))

    # Layer-wise gradient sync: charge each group's collectives to every GPU in it (the TP ranks
    # of a stage sync their shards in separate, concurrent groups); a stage reports its busiest GPU.
    sync_of_rank = {r: 0.0 for r in stage_of_rank}
    # with overlap_grad_reduce: each GPU's groups, (ready, hideable, after the step) seconds
    launches_of_rank: dict[int, list[tuple[tuple, float, float, float]]] = {
        r: [] for r in stage_of_rank}
    # An asymmetric group also has a zero full-size fp32 staging buffer on every member
    # (runtime/grad_sync.py): its bytes add to the stage's peak.
    staging_of_rank = {r: 0.0 for r in stage_of_rank}
    stage_bytes = {id(c): c.memory_gib * GIB for c in stage_of_rank.values()}
    rings = _sync_rings(cluster, [[node_of[r] for r in group] for _, group, _, _ in groups])
    for (spec, group, params, _), ring in zip(groups, rings):
        holders = len(spec.holders)
        bw = ring.bandwidth_gbs
        t = (grad_reduce_scatter_all_gather_s(params, holders, bw, precision)
             if plan.use_distributed_optimizer else grad_allreduce_s(params, holders, bw))
        # each of the ring's 2 (D - 1) steps waits for its slowest crossed link's latency
        t += 2 * (holders - 1) * ring.latency_s
        if ring.egress_usd_per_gb:
            # every ring edge carries what one member sends: (D - 1) / D of the gradients
            # twice (all-reduce), or of the gradients and the weights (distributed optimizer)
            sent = (holders - 1) / holders * params * (
                GRAD_BYTES_PER_PARAM + precision.element_bytes if plan.use_distributed_optimizer
                else 2 * GRAD_BYTES_PER_PARAM)
            egress_usd += sent / 1e9 * ring.egress_usd_per_gb
        after = (weight_all_gather_s(params, holders, bw, precision)
                 if plan.use_distributed_optimizer else 0.0)
        for r in group:
            sync_of_rank[r] += t
            if plan.overlap_grad_reduce:
                stage = stage_of_rank[r]
                order = (-gradient_ready_key(spec), spec_order[id(spec)])
                launches_of_rank[r].append((order, sync_ready_s(
                    spec.kind, spec.layers, stage.layers, stage.backward_s), t - after, after))
            if not spec.symmetric:
                staging_of_rank[r] += params * GRAD_BYTES_PER_PARAM
    if plan.overlap_grad_reduce:
        for r, launches in launches_of_rank.items():
            launches.sort(key=lambda launch: launch[0])     # the runtime's launch order
            sync_of_rank[r] = overlapped_sync_s(stage_of_rank[r].backward_s,
                                                [launch[1:] for launch in launches])
    for r, t in sync_of_rank.items():
        stage_of_rank[r].sync_s = max(stage_of_rank[r].sync_s, t)
    for r, extra in staging_of_rank.items():
        stage = stage_of_rank[r]
        stage.memory_gib = max(stage.memory_gib, stage_bytes[id(stage)] / GIB + extra / GIB)

    pipeline_time = max(p.time_s for p in pipelines)
    all_stages = [s for p in pipelines for s in p.stages]
    sync = max(s.sync_s for s in all_stages)
    opt = max(s.optimizer_s for s in all_stages)
    iteration = pipeline_time + sync + opt
    tokens = plan.global_batch_size * plan.seq_length / iteration
    used = {(r.node, r.local_rank) for r in plan.ranks}
    idle: dict[str, int] = {}
    for d in cluster.devices():
        if (d.node, d.local_rank) not in used:
            idle[d.gpu] = idle.get(d.gpu, 0) + 1
    rate = usd_per_hour(plan, cluster, charge)
    usd = None if rate is None else (rate / 3600 + egress_usd / iteration) / tokens * 1e6
    return PlanCost(iteration, pipeline_time, sync, opt, tokens, pipelines, idle, usd, sources,
                    memory_headroom, rate, charge, egress_usd)


def usd_per_hour(plan: Plan, cluster: Cluster, charge: str = DEFAULT_CHARGE) -> float | None:
    """What the GPUs the plan pays for cost per hour (module doc, "Price"); None when a node it
    uses has no spot price."""
    check_charge(charge)
    if charge == "per-gpu":
        prices = [cluster.node(r.node).spot_price for r in plan.ranks]
        return None if None in prices else sum(prices)
    nodes = [cluster.node(name) for name in dict.fromkeys(r.node for r in plan.ranks)]
    if any(n.spot_price is None for n in nodes):
        return None
    return sum(n.spot_price * n.num_gpus for n in nodes)


def simulate_1f1b(stages: list[StageCost], num_microbatches: int,
                  warmups: list[int] | None = None, record: bool = True) -> float:
    """Fill ``stage.timeline`` with the event-level 1F1B schedule (``record`` False: leave the
    timelines alone); returns its makespan.

    The runtime's semantics (module doc, "Warm-up depth"), op by op: stage s runs its
    ``warmups[s]`` forwards (standard depths by default), then alternates one forward / one
    backward, then drains its backwards. An op starts when the stage is free and its input has
    arrived. A send is posted when the op that produced it ends and never holds its stage up; it
    occupies its link (one per boundary and direction) for ``p2p_s / 2``, messages one after the
    other, and arrives when it leaves the link. At the standard depths the makespan is at most
    :func:`pipeline_time_s`; with other depths only this simulation prices them (module doc).
    """
    S, m = len(stages), num_microbatches
    depths = warmups if warmups is not None else standard_warmup_depths(S, m)
    # Per stage its ops in order: forward? and micro-batch.
    kinds: list[list[bool]] = []
    batches: list[list[int]] = []
    for s in range(S):
        w = min(depths[s], m)
        kind, batch = [True] * w, list(range(w))
        for i in range(m - w):
            kind += (True, False)
            batch += (w + i, i)
        kind += [False] * w
        batch += range(m - w, m)
        kinds.append(kind)
        batches.append(batch)
    # When the input of (stage, micro-batch) is there, per direction (None: not yet); the first
    # stage's forward inputs are there from the start.
    arrive_fwd: list[list[float | None]] = [[None] * m for _ in range(S)]
    arrive_fwd[0] = [0.0] * m
    arrive_bwd: list[list[float | None]] = [[None] * m for _ in range(S)]
    # When each boundary's link is free, per direction: stage s alone sends forward on link s
    # and backward on link s - 1, in its own op order, so every time below depends only on
    # the ops it waits for, never on the order the stages are advanced in.
    link_fwd, link_bwd = [0.0] * S, [0.0] * S
    half_p2p = [st.p2p_s / 2 for st in stages]
    free = [0.0] * S
    nxt = [0] * S
    events: list[list[tuple[float, float, bool, int]]] = [[] for _ in range(S)]
    remaining, ops = S * 2 * m, 2 * m
    # Activations flow to higher stages, gradients to lower ones: sweeps alternate between
    # the two directions, so each advances either as far as it can.
    sweeps = (range(S), range(S - 1, -1, -1))
    sweep = stalled = 0
    while remaining:
        progressed = False
        for s in sweeps[sweep]:
            pos = nxt[s]
            if pos == ops:
                continue
            kind, batch, done = kinds[s], batches[s], events[s]
            forward_s, backward_s = stages[s].forward_s, stages[s].backward_s
            mine_fwd, mine_bwd = arrive_fwd[s], arrive_bwd[s]
            last, t = s == S - 1, free[s]
            next_fwd = None if last else arrive_fwd[s + 1]
            prev_bwd = arrive_bwd[s - 1] if s > 0 else None
            half_fwd = half_p2p[s]
            half_bwd = half_p2p[s - 1] if s > 0 else 0.0
            link_f = link_fwd[s]
            link_b = link_bwd[s - 1] if s > 0 else 0.0
            start_pos = pos
            while pos < ops:
                i = batch[pos]
                if kind[pos]:
                    dep = mine_fwd[i]
                    if dep is None:
                        break
                    start = t if t >= dep else dep
                    end = start + forward_s
                    # Post the send (activation forward) or hand over locally.
                    if last:
                        mine_bwd[i] = end
                    else:
                        link_f = (end if end >= link_f else link_f) + half_fwd
                        next_fwd[i] = link_f
                    if record:
                        done.append((start, end, True, i))
                else:
                    dep = mine_bwd[i]
                    if dep is None:
                        break
                    start = t if t >= dep else dep
                    end = start + backward_s
                    if prev_bwd is not None:    # the gradient back to the stage before
                        link_b = (end if end >= link_b else link_b) + half_bwd
                        prev_bwd[i] = link_b
                    if record:
                        done.append((start, end, False, i))
                t = end
                pos += 1
            if pos != start_pos:
                free[s], nxt[s] = t, pos
                link_fwd[s] = link_f
                if s > 0:
                    link_bwd[s - 1] = link_b
                remaining -= pos - start_pos
                progressed = True
        stalled = 0 if progressed else stalled + 1
        if stalled == 2:    # cannot happen for a valid warm-up; guard against a silent hang
            raise ConfigError("<plan>", "warmup_microbatches", "the 1F1B order deadlocks",
                              "warm-up depths that let every stage make progress")
        sweep ^= 1
    if record:
        for st, done in zip(stages, events):
            st.timeline = [TimelineEvent(a, b, "fwd" if fwd else "bwd", i)
                           for a, b, fwd, i in done]
    return max(free)


def fleet_ideal_tokens_per_s(cluster: Cluster, profile: Profile, model: ModelSpec,
                             micro_batch_size: int, seq_length: int) -> float:
    """The yardstick of plan efficiency: the sum over the fleet's GPUs of each GPU's lone
    token rate, one micro-batch's forward and backward through the whole model (embedding,
    every layer, output layer) at TP 1 with nothing else charged: no pipeline bubble, no
    communication, no gradient sync or optimizer step, no memory limit. A plan's tokens/s over
    this is the fraction of the fleet's raw compute it turns into training."""
    rate_of_type: dict[str, float] = {}
    for gpu in cluster.gpu_types:
        entry = profile.get(gpu, 1, micro_batch_size, seq_length)
        fwd, bwd = stage_compute_s(entry, model.num_layers, True, True, False)
        rate_of_type[gpu] = micro_batch_size * seq_length / (fwd + bwd)
    return sum(rate_of_type[n.gpu] * n.num_gpus for n in cluster.nodes)


def annotate_plan(plan: Plan, cost: PlanCost) -> Plan:
    """Write the predictions into the plan (per-stage time and memory, plan-level figures)."""
    for pipe, pcost in zip(plan.pipelines, cost.pipelines):
        for stage, scost in zip(pipe.stages, pcost.stages):
            stage.predicted_time_s = round(scost.time_s, 6)
            stage.predicted_memory_gib = round(scost.memory_gib, 3)
    plan.predicted = cost.predicted()
    return plan
