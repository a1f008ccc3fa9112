"""Layer-wise data-parallel gradient sync across pipelines of different shapes.

Megatron's ``DistributedDataParallel`` assumes one data-parallel group for every parameter. In a
heterogeneous plan the replicas cut the model at different layers, so each parameter is synced in
the group of *its* holders: :func:`megatron_autohet.layout.topology.sync_group_specs` splits the
model into runs of layers (plus the embeddings and the post-process part of the last stages)
whose holders are the same TP groups in every pipeline, and the parallel state creates one torch
group per spec (per TP shard when the spec is symmetric).

Scaling. The trainer's loss function multiplies every micro-batch loss by ``m_p / M`` (see
``runtime/trainer.py``), so after Megatron's schedule has divided it by the pipeline's own
micro-batch count ``m_p`` each replica's gradient is ``sum over its micro-batches of grad / M``.
The global-batch gradient is then the plain SUM over replicas: every reduction here is a sum and
nothing is rescaled, whatever the micro-batch counts are.

Buckets. The parameters are packed into flat buckets per process group, not per spec: specs whose
groups are the same rank set (a layer run and the position embedding of the first stages, a layer
run and the final norm of the last stages) share buckets, so a rank pays one collective per
distinct group and bucket, as Megatron's DP all-reduce does with one grad buffer. This is
consistent across ranks because a spec's groups are a property of the spec: every member of a
group maps the same specs to it, so all members build the same buckets (specs in plan order, each
in global-name order). Each parameter's ``main_grad`` is a view into its bucket, so a symmetric
bucket is all-reduced with no copy at all.

Main gradients (Megatron's mixed precision, ``--accumulate-allreduce-grads-in-fp32``): the buckets
are fp32 whatever the parameters' dtype, and every backward's gradient is added into the
parameter's fp32 ``main_grad`` view, so gradients are accumulated over micro-batches, reduced,
normed and clipped in fp32; the optimizer steps fp32 master weights whose ``.grad`` is that view
(runtime/mixed_precision.py). A 16-bit parameter's ``.grad`` is added into it by a
post-accumulate-grad hook and freed, as megatron-core's DDP does without
``gradient_accumulation_fusion`` (``_make_backward_post_hook``). An fp32 parameter's ``.grad`` IS
its ``main_grad`` view: autograd accumulates into it in place, the same sums with no copy.

Launch order. Every rank launches its buckets asynchronously in one fixed order and waits for
them in that order: the order in which a backward makes them final, by
:func:`~megatron_autohet.layout.topology.gradient_ready_key` (the post-process part first, then
the layers from the last to the first, by a bucket's first layer, the embeddings last), ties in
build order. The order is deadlock-free by construction: a bucket's key (its parameters' global
names) and its build position (its group's first spec in plan order, its place in the group) are
computed alike by every member of its group, so every rank's launches are a subsequence of one
order of all the job's collectives, and the earliest collective not yet done has been launched
by all its members. Interleaved pipelines change none of it: a stage of several model chunks
holds several layer runs, but a parameter's sync group, bucket and key still come from its
global name and the plan alone (layout/topology.py ``sync_group_specs`` walks every chunk), not
from which chunk, stage or pipeline shape holds it, so a layer's copies in pipelines of different
v and cut sync in the same bucket at the same place in the one order; the chunks' parameters
are only grouped under their chunk index locally (runtime/stage_model.py ``ModelChunks``).

Overlapped sync (Megatron-LM's ``--overlap-grad-reduce``, ``overlap_grad_reduce``): a bucket's
collective starts during the backward, as soon as the last micro-batch's backward has produced
its gradients, so it runs while the backward of the earlier layers computes. The mechanism is
megatron-core's ``DistributedDataParallel`` one (distributed/distributed_data_parallel.py,
distributed/param_and_grad_buffer.py): a post-accumulate-grad hook per parameter (after the
16-bit gradient was added into ``main_grad``) calls megatron-core's own
``_ParamAndGradBucketGroup.register_grad_ready`` on the parameter's bucket, which counts a
gradient only while ``is_last_microbatch`` (megatron's schedules clear it through the model
config's ``no_sync_func``, :meth:`GradSync.no_sync`, for every micro-batch but the last) and
declares the bucket ready when every parameter has reached the counts of the first iteration
(megatron's ``golden_per_param_grad_ready_counts``: the first iteration launches at its end, as
megatron's does). A ready bucket is launched only after every bucket before it in the launch
order: a bucket that is ready early waits for the ones before it, so the overlapped launches keep
exactly the order above and the same deadlock-freedom. :meth:`GradSync.sync` then launches what
is left (nothing after the first iteration) and waits. The sums are the same collectives on the
same buffers: overlapped training is bit-identical to the non-overlapped run.

Asymmetric TP (holders of a spec differ in TP degree; opt-in in the planner): a bucket also has a
zero full-size staging buffer; every holder writes its shard at its slice of the full tensor
(TP-replicated parameters once per holder TP group, by TP rank 0), one sum-all-reduce over all
holder ranks gives the full gradient everywhere, and each rank copies back its slice. That is exact
(it is the same sum) and only asymmetric specs pay for the full-size buffer.

With ``shard_padding`` the buckets are padded to a multiple of their group size and each bucket's
collective is a reduce-scatter into this rank's shard of it instead of the all-reduce (the
distributed optimizer's, runtime/distributed_optimizer.py, which reads the shards); the launch
order and the overlap are the same.

Sequence parallelism: Megatron's TP layers already all-reduce the *activation* gradients inside the
TP group, so TP-partitioned weights and, without sequence parallelism, TP-replicated weights
(layernorms) have complete gradients. With sequence parallelism each TP rank sees only its
sequence chunk, so parameters Megatron tags ``.sequence_parallel`` (layernorms) hold partial sums;
they are summed over the TP group first, as ``finalize_model_grads`` does: a bucket's launch
all-reduces its sequence-parallel gradients over the TP group before its own collective (the TP
ranks of a stage launch the same buckets at the same point of the same backward).

Grad norm: each logical parameter is counted exactly once in the whole world, by its main replica
(layout/owners.py): only by the first holder TP group of its spec (pipeline order) and, if
TP-replicated, only by TP rank 0 there.
:meth:`GradSync.owned_sum_of_squares` is this rank's share; the trainer sums the shares over the
world in the one all-reduce it also needs for the loss, so every rank gets the same norm; the
trainer clips the main gradients through the master weights' ``.grad`` with megatron-core's
``clip_grad_by_total_norm_fp32`` (the reference's formula).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

from megatron_autohet.layout.owners import holds_main_replica
from megatron_autohet.layout.topology import (SyncGroupSpec, gradient_ready_key, layer_of,
                                              spec_index_of)
from megatron_autohet.runtime.mixed_precision import MAIN_GRAD_DTYPE

# Megatron's DDP default: 40M elements per bucket.
DEFAULT_BUCKET_NUMEL = 40_000_000

# torch 2.13 renamed reduce_scatter_tensor to reduce_scatter_single (same arguments; the old name
# warns that it will go), torch 2.11 has only the old one (tests/test_torch_api.py checks every
# name against 2.11's).
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


@dataclass
class _Bucket:
    params: list[torch.nn.Parameter]
    layouts: list                       # layout.params.ParamLayout of each param
    grads: list[torch.Tensor]           # each param's main_grad: its view into grad_data
    group: dist.ProcessGroup | None     # None or one rank: nothing to reduce
    grad_data: torch.Tensor             # flat fp32 local grads, each param's main_grad a view
    full_data: torch.Tensor | None      # asymmetric only: flat full-size staging buffer
    full_offsets: list[int]             # of each param in full_data
    grad_offsets: list[int]             # of each param in grad_data
    sharded: bool                       # shard_padding: reduce-scatter into `shard`
    sequence_parallel_params: list[torch.nn.Parameter] = field(default_factory=list)

    @property
    def reduces(self) -> bool:
        return self.group is not None and dist.get_world_size(self.group) > 1

    def full_view(self, i: int) -> torch.Tensor:
        shape = torch.Size(self.layouts[i].full_shape)
        off = self.full_offsets[i]
        return self.full_data[off:off + shape.numel()].view(shape)

    def check_grad_views(self) -> None:
        # Identity, not data pointers: one attribute read per parameter (each torch call costs
        # a trip through CPU mode's function mode, and this runs every iteration).
        for param, grad in zip(self.params, self.grads):
            # fp32: .grad is the main_grad view; 16-bit: the hook freed it after each backward
            if param.grad is not (grad if param.dtype == grad.dtype else None):
                raise RuntimeError("a parameter's .grad was replaced; zero gradients with "
                                   "GradSync.zero_grad(), not optimizer.zero_grad()")

    @property
    def reduced(self) -> torch.Tensor:
        """The flat buffer the group sums: ``grad_data``, or ``full_data`` when asymmetric."""
        return self.grad_data if self.full_data is None else self.full_data

    @property
    def reduced_offsets(self) -> list[int]:
        """Where each parameter starts in :attr:`reduced`."""
        return self.grad_offsets if self.full_data is None else self.full_offsets

    def stage(self) -> None:
        """Asymmetric only: write this rank's gradients at their slices of ``full_data``."""
        if self.full_data is None:
            return
        self.full_data.zero_()
        for i, (param, layout) in enumerate(zip(self.params, self.layouts)):
            if layout.partition_dim is not None or layout.tp_rank == 0:
                layout.write_shard(self.full_view(i), self.grads[i])

    @property
    def shard(self) -> torch.Tensor:
        """This rank's contiguous ``1/D`` of :attr:`reduced` (``shard_padding`` makes it split
        evenly), which the reduce-scatter fills in place (as megatron's DistributedOptimizer
        does: NCCL's in-place form, the output at rank * count of the input)."""
        size = dist.get_world_size(self.group) if self.reduces else 1
        numel = self.reduced.numel() // size
        rank = dist.get_rank(self.group) if self.reduces else 0
        return self.reduced[rank * numel:(rank + 1) * numel]

    def start(self, tp_group: dist.ProcessGroup | None) -> dist.Work | None:
        """Launch the bucket's collective: its sequence-parallel partial gradients summed over
        ``tp_group`` first (module doc), its staging, then the all-reduce (or the reduce-scatter
        into :attr:`shard`), asynchronous; None where the group has one rank."""
        if self.sequence_parallel_params and dist.get_world_size(tp_group) > 1:
            grads = [p.main_grad for p in self.sequence_parallel_params]
            flat = torch._utils._flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=tp_group)
            for grad, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                grad.copy_(synced)
        self.stage()
        if not self.reduces:
            return None
        if self.sharded:
            return reduce_scatter_flat(self.shard, self.reduced, group=self.group,
                                       async_op=True)
        return dist.all_reduce(self.reduced, group=self.group, async_op=True)

    def finish(self) -> None:
        """After the collective: an asymmetric all-reduced bucket copies its slices back (a
        reduce-scattered one is read through its shard)."""
        if self.full_data is None or self.sharded:
            return
        for i, layout in enumerate(self.layouts):
            self.grads[i].copy_(layout.shard(self.full_view(i)))


class _BucketReadiness(_ParamAndGradBucketGroup):
    """One bucket's readiness in an overlapped sync, by megatron-core's own bookkeeping: its
    ``register_grad_ready`` (called by the backward hook), ``is_last_microbatch`` (cleared by
    :meth:`GradSync.no_sync`) and ``reset`` (each iteration's start; after the first iteration
    it records the golden counts). Its ``start_grad_sync``, which megatron calls when the bucket
    is ready, hands the bucket to ``on_ready`` instead of launching megatron's collective (this
    runtime's buckets have their own, module doc). megatron's ``__init__`` is not run: it builds
    megatron's buffers; the attributes the three methods read are set here."""

    def __init__(self, params: list[torch.nn.Parameter], on_ready):
        self.ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=True)
        self.params = set(params)
        self.param_to_bucket = dict.fromkeys(params)   # membership is all megatron reads
        self.per_param_grad_ready_counts: dict = {}
        self.golden_per_param_grad_ready_counts: dict = {}
        self.is_last_microbatch = True
        self.is_first_batch = True
        self.on_ready = on_ready

    def start_grad_sync(self, force_all_reduce: bool = False) -> None:
        self.on_ready()


class GradSync:
    """Owns the fp32 main-gradient buffers of one stage model and syncs them across replicas.

    Args:
        model: this rank's stage model.
        layouts: ``param_layouts(model, state)``: local parameter name -> ParamLayout.
        specs: ``topology.sync_group_specs(plan)``, all of them, in order.
        groups: for each spec, the torch group this rank syncs in, or None if it is no holder.
        holder: this rank's stage TP group (ranks in TP-rank order).
        tp_group: this rank's stage TP group as a torch group.
        sequence_parallel: whether the stage runs with Megatron sequence parallelism.
        bucket_numel: the most elements per bucket (a parameter is never split).
        shard_padding: pad each bucket's reduced buffer with zeros to a multiple of its group
            size, so that it splits into equal contiguous shards, and reduce-scatter it into
            this rank's shard (the distributed optimizer's, runtime/distributed_optimizer.py).
        overlap_grad_reduce: launch each bucket during the backward, as soon as the last
            micro-batch has produced its gradients (module doc, "Overlapped sync"); the model
            config's ``no_sync_func`` must be :meth:`no_sync` (the trainer sets it).
    """

    def __init__(self, model: torch.nn.Module, layouts: dict, specs: list[SyncGroupSpec],
                 groups: list, *, holder: tuple[int, ...], tp_group: dist.ProcessGroup | None,
                 sequence_parallel: bool, bucket_numel: int = DEFAULT_BUCKET_NUMEL,
                 shard_padding: bool = False, overlap_grad_reduce: bool = False):
        if len(specs) != len(groups):
            raise ValueError(f"{len(specs)} sync group specs but {len(groups)} groups")
        holder = tuple(holder)
        self.shard_padding = shard_padding
        self.tp_group = tp_group
        self.params: list[torch.nn.Parameter] = []
        sequence_parallel_params: set[torch.nn.Parameter] = set()
        self.norm_params: list[torch.nn.Parameter] = []
        per_spec: list[list] = [[] for _ in specs]
        ready_key: dict[torch.nn.Parameter, float] = {}     # module doc, "Launch order"
        for name, param in model.named_parameters():
            if not param.requires_grad:
                continue
            layout = layouts[name]
            i = spec_index_of(layout.global_name, specs)
            if holder not in specs[i].holders:
                raise ValueError(f"parameter {name} ({layout.global_name}) is synced by holders "
                                 f"{specs[i].holders}, which do not include this rank's stage "
                                 f"{holder}")
            per_spec[i].append((layout.global_name, param, layout))
            ready_key[param] = gradient_ready_key(specs[i], layer_of(layout.global_name))
            self.params.append(param)
            if sequence_parallel and getattr(param, "sequence_parallel", False):
                sequence_parallel_params.add(param)
            if holds_main_replica(specs[i].holders, holder, layout):
                self.norm_params.append(param)

        # Specs sharing a rank set share buckets (module doc); the dict keeps plan order.
        per_group: dict[tuple, tuple[object, list]] = {}
        for spec, group, members in zip(specs, groups, per_spec):
            if not members:
                continue
            members.sort(key=lambda member: member[0])   # the same order on every holder
            ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else ()
            per_group.setdefault((ranks, spec.symmetric), (group, []))[1].extend(members)
        self.buckets: list[_Bucket] = []
        for (_, symmetric), (group, members) in per_group.items():
            self._add_buckets(group, symmetric, [m[1] for m in members],
                              [m[2] for m in members], bucket_numel)
        self._verify_bucket_extents()
        tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
        for bucket in self.buckets:
            bucket.sequence_parallel_params = [p for p in bucket.params
                                               if p in sequence_parallel_params]
        # The launch order (module doc): the buckets that have a collective to run (their
        # group's or their sequence-parallel TP sum), each ready with its last parameter.
        built = sorted(range(len(self.buckets)), key=lambda i: (
            -min(ready_key[p] for p in self.buckets[i].params), i))
        self.launch_order = [self.buckets[i] for i in built if self.buckets[i].reduces or (
            self.buckets[i].sequence_parallel_params and tp_size > 1)]
        self._pending: list[tuple[_Bucket, dist.Work | None]] = []
        self.overlap_grad_reduce = overlap_grad_reduce
        self._readiness: list[_BucketReadiness] = []
        if overlap_grad_reduce:
            self._ready = [False] * len(self.launch_order)
            for i, bucket in enumerate(self.launch_order):
                readiness = _BucketReadiness(bucket.params, self._on_ready_callback(i))
                self._readiness.append(readiness)
                for param in bucket.params:
                    param.register_post_accumulate_grad_hook(
                        self._grad_ready_hook(readiness))

    @staticmethod
    def _grad_ready_hook(readiness: _BucketReadiness):
        """megatron-core DDP's backward post-hook, minus the main-grad add (``attach_main_grads``'
        hook, registered before this one, has done it): the parameter's gradient of this
        backward is in its ``main_grad``."""
        def hook(param: torch.Tensor) -> None:
            readiness.register_grad_ready(param)
        return hook

    def _on_ready_callback(self, index: int):
        def on_ready() -> None:
            self._ready[index] = True
            # launch every bucket whose predecessors are launched (module doc)
            while (len(self._pending) < len(self.launch_order)
                   and self._ready[len(self._pending)]):
                self._launch_next()
        return on_ready

    def _launch_next(self) -> None:
        bucket = self.launch_order[len(self._pending)]
        self._pending.append((bucket, bucket.start(self.tp_group)))

    @contextmanager
    def no_sync(self):
        """megatron-core DDP's ``no_sync``: the gradients of the micro-batches run inside are
        accumulated and not counted towards a bucket's readiness (megatron's schedules enter it
        through the model config's ``no_sync_func`` for every micro-batch but the last)."""
        for readiness in self._readiness:
            readiness.is_last_microbatch = False
        try:
            yield
        finally:
            for readiness in self._readiness:
                readiness.is_last_microbatch = True

    def _add_buckets(self, group, symmetric, params, layouts, bucket_numel):
        def numel(i):   # what the bucket all-reduces per parameter
            return params[i].numel() if symmetric else torch.Size(
                layouts[i].full_shape).numel()

        start, total = 0, 0
        for i in range(len(params)):
            if total and total + numel(i) > bucket_numel:
                self._make_bucket(group, params[start:i], layouts[start:i], symmetric)
                start, total = i, 0
            total += numel(i)
        if params:
            self._make_bucket(group, params[start:], layouts[start:], symmetric)

    def _make_bucket(self, group, params, layouts, symmetric):
        multiple = (dist.get_world_size(group) if self.shard_padding and group is not None
                    else 1)
        offsets = _offsets([p.numel() for p in params])
        grad_data = torch.zeros(_round_up(offsets[-1], multiple if symmetric else 1),
                                dtype=MAIN_GRAD_DTYPE, device=params[0].device)
        grads = [grad_data[off:off + param.numel()].view_as(param)
                 for param, off in zip(params, offsets)]
        attach_main_grads(params, grads)
        full_data, full_offsets = None, []
        if not symmetric:
            full_offsets = _offsets([torch.Size(layout.full_shape).numel() for layout in layouts])
            full_data = torch.zeros(_round_up(full_offsets[-1], multiple),
                                    dtype=grad_data.dtype, device=grad_data.device)
        self.buckets.append(_Bucket(params, layouts, grads, group, grad_data, full_data,
                                    full_offsets[:-1], offsets[:-1],
                                    sharded=self.shard_padding))

    def _verify_bucket_extents(self) -> None:
        """Every member of a group must bucket the same number of elements; a plan whose ranks
        disagree (e.g. a TP-dependent padded vocabulary) fails here instead of hanging."""
        for bucket in self.buckets:
            if not bucket.reduces:
                continue
            numel = bucket.reduced.numel()
            extent = torch.tensor([numel, -numel], dtype=torch.int64,
                                  device=bucket.grad_data.device)   # NCCL needs device tensors
            dist.all_reduce(extent, op=dist.ReduceOp.MAX, group=bucket.group)
            if int(extent[0]) != numel or -int(extent[1]) != numel:
                raise RuntimeError(
                    f"gradient bucket {bucket.layouts[0].global_name}.."
                    f"{bucket.layouts[-1].global_name}: this rank has {numel} elements, its sync "
                    f"group {dist.get_process_group_ranks(bucket.group)} between "
                    f"{-int(extent[1])} and {int(extent[0])}")

    # ---- per iteration -----------------------------------------------------------------------
    def zero_grad(self) -> None:
        """Zero the gradient buffers in place (never ``optimizer.zero_grad()``: setting grads to
        None would detach them from the buckets) and start an iteration's readiness."""
        if self._pending:
            raise RuntimeError("gradient buckets launched but not synced: call sync() first")
        for bucket in self.buckets:
            bucket.grad_data.zero_()
        for readiness in self._readiness:
            readiness.reset()
        if self.overlap_grad_reduce:
            self._ready = [False] * len(self.launch_order)

    def sync(self) -> None:
        """Sum every gradient over its holders (with ``shard_padding``: into this rank's shard
        of each bucket): launch the buckets the backward has not launched, in the launch order,
        and wait for all; afterwards each replica holds the global-batch gradient of its
        parameters."""
        for bucket in self.buckets:
            bucket.check_grad_views()
        while len(self._pending) < len(self.launch_order):
            self._launch_next()
        for bucket, work in self._pending:
            if work is not None:
                work.wait()
            bucket.finish()
        self._pending = []

    def owned_sum_of_squares(self) -> torch.Tensor:
        """This rank's share of the squared global grad norm (call after :meth:`sync`): the sum
        of squares of the gradients it owns (module doc), as a float64 scalar tensor. Summed over
        the world it is the squared norm of the global gradient; the trainer does that sum in the
        same all-reduce as the loss, so an iteration pays one world collective for both."""
        grads = [p.main_grad for p in self.norm_params]
        total = torch.zeros((), dtype=torch.float64, device=self.params[0].device)
        if grads:
            total += torch.stack(torch._foreach_norm(grads)).double().square().sum()
        return total


def attach_main_grads(params: list[torch.nn.Parameter], grads: list[torch.Tensor]) -> None:
    """Make each fp32 ``grads[i]`` (the parameter's shape) the ``main_grad`` every backward of
    ``params[i]`` adds into (module doc, "Main gradients"): an fp32 parameter's ``.grad`` is the
    view itself, a 16-bit one's ``.grad`` is added into it by a post-accumulate-grad hook and
    freed. GradSync's buckets use it, and so does the profiler, whose measured backward pays
    the same accumulation as training's."""
    for param, grad in zip(params, grads):
        param.main_grad = grad
        if param.dtype == MAIN_GRAD_DTYPE:
            param.grad = grad
        else:
            param.register_post_accumulate_grad_hook(_add_to_main_grad)


def _add_to_main_grad(param: torch.Tensor) -> None:
    """After autograd accumulated a backward's 16-bit gradient into ``param.grad``: add it into
    the fp32 ``main_grad`` and free it, so the next backward starts from no ``.grad``."""
    param.main_grad.add_(param.grad)
    param.grad = None


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _offsets(sizes: list[int]) -> list[int]:
    out = [0]
    for size in sizes:
        out.append(out[-1] + size)
    return out
