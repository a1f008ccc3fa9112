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
its ``main_grad`` view: autograd accumulates into it in place, the same sums with no copy. Buckets
are launched asynchronously in that global order on every rank (a consistent order over groups
cannot deadlock) and waited for together.

Asymmetric TP (holders of a spec differ in TP degree; opt-in in the planner): a bucket also has a
zero full-size staging buffer; every holder writes its shard at its slice of the full tensor
(TP-replicated parameters once per holder TP group, by TP rank 0), one sum-all-reduce over all
holder ranks gives the full gradient everywhere, and each rank copies back its slice. That is exact
(it is the same sum) and only asymmetric specs pay for the full-size buffer.

With ``shard_padding`` the buckets are padded to a multiple of their group size, and the
distributed optimizer (runtime/distributed_optimizer.py) reduce-scatters them instead of
:meth:`GradSync.sync` (it calls :meth:`GradSync.prepare` and each bucket's ``stage``).

Sequence parallelism: Megatron's TP layers already all-reduce the *activation* gradients inside the
TP group, so TP-partitioned weights and, without sequence parallelism, TP-replicated weights
(layernorms) have complete gradients. With sequence parallelism each TP rank sees only its
sequence chunk, so parameters Megatron tags ``.sequence_parallel`` (layernorms) hold partial sums;
they are summed over the TP group first, as ``finalize_model_grads`` does.

Grad norm: each logical parameter is counted exactly once in the whole world, by its main replica
(layout/owners.py): only by the first holder TP group of its spec (pipeline order) and, if
TP-replicated, only by TP rank 0 there.
:meth:`GradSync.owned_sum_of_squares` is this rank's share; the trainer sums the shares over the
world in the one all-reduce it also needs for the loss, so every rank gets the same norm; the
trainer clips the main gradients through the master weights' ``.grad`` with megatron-core's
``clip_grad_by_total_norm_fp32`` (the reference's formula).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_autohet.layout.owners import holds_main_replica
from megatron_autohet.layout.topology import SyncGroupSpec, spec_index_of
from megatron_autohet.runtime.mixed_precision import MAIN_GRAD_DTYPE

# Megatron's DDP default: 40M elements per bucket.
DEFAULT_BUCKET_NUMEL = 40_000_000


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

    def start(self) -> dist.Work:
        self.stage()
        return dist.all_reduce(self.reduced, group=self.group, async_op=True)

    def finish(self) -> None:
        if self.full_data is None:
            return
        for i, layout in enumerate(self.layouts):
            self.grads[i].copy_(layout.shard(self.full_view(i)))


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
            size, so that it splits into equal contiguous shards (the distributed optimizer's
            reduce-scatter, runtime/distributed_optimizer.py).
    """

    def __init__(self, model: torch.nn.Module, layouts: dict, specs: list[SyncGroupSpec],
                 groups: list, *, holder: tuple[int, ...], tp_group: dist.ProcessGroup | None,
                 sequence_parallel: bool, bucket_numel: int = DEFAULT_BUCKET_NUMEL,
                 shard_padding: bool = False):
        if len(specs) != len(groups):
            raise ValueError(f"{len(specs)} sync group specs but {len(groups)} groups")
        holder = tuple(holder)
        self.shard_padding = shard_padding
        self.tp_group = tp_group
        self.params: list[torch.nn.Parameter] = []
        self.sequence_parallel_params: list[torch.nn.Parameter] = []
        self.norm_params: list[torch.nn.Parameter] = []
        per_spec: list[list] = [[] for _ in specs]
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
            self.params.append(param)
            if sequence_parallel and getattr(param, "sequence_parallel", False):
                self.sequence_parallel_params.append(param)
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
                                    full_offsets[:-1], offsets[:-1]))

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
        None would detach them from the buckets)."""
        for bucket in self.buckets:
            bucket.grad_data.zero_()

    def prepare(self) -> None:
        """Before any bucket collective: check the gradient views and sum the sequence-parallel
        partial gradients over the TP group (module doc)."""
        for bucket in self.buckets:
            bucket.check_grad_views()
        if self.sequence_parallel_params and dist.get_world_size(self.tp_group) > 1:
            grads = [p.main_grad for p in self.sequence_parallel_params]
            flat = torch._utils._flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=self.tp_group)
            for grad, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                grad.copy_(synced)

    def sync(self) -> None:
        """Sum every gradient over its holders; afterwards each replica holds the global-batch
        gradient of its parameters."""
        self.prepare()
        pending = [(bucket, bucket.start()) for bucket in self.buckets if bucket.reduces]
        for bucket, work in pending:
            work.wait()
            bucket.finish()

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
