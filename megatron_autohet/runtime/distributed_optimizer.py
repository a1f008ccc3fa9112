"""Megatron-LM's distributed optimizer (``--use-distributed-optimizer``) on layer-wise sync groups.

Megatron's ``DistributedOptimizer`` shards the master weights and Adam moments over the one
data-parallel group of a homogeneous model. Here every gradient bucket of
:class:`~megatron_autohet.runtime.grad_sync.GradSync` has its own group (the holders of its
parameters, runtime/grad_sync.py), so every bucket is sharded over ITS group: the ``D`` members
each own one contiguous ``1/D`` of the bucket's flat reduced buffer (``grad_data``, or the
full-size ``full_data`` of an asymmetric-TP bucket; GradSync pads it to a multiple of ``D``).
Per iteration, instead of the all-reduce:

1. reduce-scatter of the fp32 gradient bucket, in place: each member's shard of its own buffer
   receives the global-batch gradient of that shard (the sum over holders, as the all-reduce;
   runtime/grad_sync.py explains why a sum); the rest of the buffer is left partial. GradSync
   launches it (``shard_padding``), in its launch order, during the backward with
   ``overlap_grad_reduce``;
2. grad norm: every element of the world is in exactly one shard of exactly one group, except a
   TP-replicated parameter of a symmetric bucket, which each TP rank's group holds; it is counted
   by TP rank 0's group only. :meth:`DistributedOptimizer.owned_sum_of_squares` is this rank's
   share, which the trainer sums over the world as it does GradSync's; clipping scales the shard;
3. ``torch.optim.AdamW`` steps the shard: its parameters are views into an fp32 master copy of
   the shard (``master``), one per parameter segment the shard contains, with the gradient
   views into the reduce-scattered shard and Adam moments that are views into flat shard buffers.
   The views sit in the two parameter groups of runtime/optimizer.py by the parameter's global
   identity (``applies_weight_decay``), with ``wd_mult``, so megatron-core's
   ``OptimizerParamScheduler`` drives their learning rate and weight decay exactly as it drives
   the non-distributed optimizer. AdamW is elementwise, so stepping a segment equals stepping the
   whole tensor and slicing;
4. all-gather of the updated shards in the weights' dtype, then each parameter is written back
   with ``param.data.copy_`` (an asymmetric bucket's parameter takes its TP slice of the full
   tensor): a 16-bit weight is written by a cast of the fp32 master.

Mixed precision (Megatron-LM's ``--bf16 --use-distributed-optimizer``): the master copy is fp32
whatever the weights' dtype. At construction it is filled from the live parameters (fp32 copies of
the 16-bit initial weights, as megatron's ``DistributedOptimizer`` does); a checkpoint load
(:meth:`DistributedOptimizer.load`) fills it from the checkpoint's fp32 masters (or, without
them, its fp32 weights), never from the 16-bit weights, which would round every master to bf16
and end a bit-identical resume. A symmetric bucket's values are the concatenated local tensors
(every member holds the same replica); an asymmetric bucket's full tensors are assembled by one
sum-all-reduce in which only the main replica (layout/owners.py) writes its chunks.

Checkpoints stay layout-independent (checkpoint/state.py): :meth:`DistributedOptimizer.param_states`
all-gathers the moment shards (and, in 16-bit training, the master shards as ``fp32_param``) and
returns per-parameter fp32 tensors in the local shapes, the keys of the non-distributed
optimizer; :meth:`DistributedOptimizer.load` takes the same per-parameter tensors back, so a
checkpoint saved with or without the distributed optimizer loads into either. Both go through
host memory one bucket at a time (a save's per-parameter tensors and a load's targets are host
tensors): the unsharded state is 12 B per parameter of a 16-bit stage, which a plan that fits
only thanks to the distributed optimizer does not have on its GPUs. What remains on the device
is one bucket's fp32 flat buffer (at most GradSync's ``bucket_numel`` elements) while a save
gathers or a load assembles it, at a point of the iteration where no activations are alive.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

from megatron_autohet.runtime.grad_sync import GradSync, _Bucket
from megatron_autohet.runtime.mixed_precision import MASTER_KEY
from megatron_autohet.runtime.optimizer import (ADAM_STATE_KEYS, OptimizerSettings, adam_step,
                                                megatron_adamw)

# torch 2.13 renamed all_gather_into_tensor to all_gather_single (same arguments; the old name
# warns that it will go), torch 2.11 has only the old one (tests/test_torch_api.py checks every
# name against 2.11's); the reduce-scatter's is runtime/grad_sync.py's.
_all_gather_flat = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


@dataclass
class _Segment:
    """The part of one bucket parameter inside this rank's shard."""
    index: int              # the parameter's index in the bucket
    shard_start: int        # where it starts in the shard
    numel: int
    view: torch.Tensor      # master[shard_start:shard_start + numel]: what AdamW steps


class _ShardedBucket:
    def __init__(self, bucket: _Bucket, main: list[bool]):
        self.bucket = bucket
        self.main = main                      # whether this rank holds each param's main replica
        group = bucket.group
        self.size = dist.get_world_size(group) if bucket.reduces else 1
        self.rank_in_group = dist.get_rank(group) if bucket.reduces else 0
        total = bucket.reduced.numel()        # GradSync padded it to a multiple of size
        if total % self.size:
            raise ValueError(f"bucket of {total} elements does not split over {self.size} ranks")
        self.shard_numel = total // self.size
        lo = self.rank_in_group * self.shard_numel
        hi = lo + self.shard_numel
        self.lo = lo
        device = bucket.grad_data.device
        # GradSync's reduce-scatter fills it in place: the shard takes no gradient memory.
        self.grad_shard = bucket.shard
        self.master = torch.zeros(self.shard_numel, dtype=torch.float32, device=device)
        self.moments = {key: torch.zeros_like(self.master) for key in ADAM_STATE_KEYS}
        self.segments: list[_Segment] = []
        for i, offset in enumerate(bucket.reduced_offsets):
            start, end = max(offset, lo), min(offset + self._numel(i), hi)
            if start < end:
                view = self.master[start - lo:end - lo]
                view.grad = self.grad_shard[start - lo:end - lo]
                self.segments.append(_Segment(i, start - lo, end - start, view))

    def _numel(self, i: int) -> int:
        """What parameter ``i`` takes in the reduced buffer (the full tensor if asymmetric)."""
        if self.bucket.full_data is None:
            return self.bucket.params[i].numel()
        return torch.Size(self.bucket.layouts[i].full_shape).numel()

    def counted(self, segment: _Segment) -> bool:
        """Whether the grad norm counts this segment (module doc, step 2)."""
        layout = self.bucket.layouts[segment.index]
        return (self.bucket.full_data is not None or layout.partition_dim is not None
                or layout.tp_rank == 0)

    # ---- flat buffer <-> parameters ----------------------------------------------------------
    def assemble(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """This rank's shard of the flat buffer whose parameter ``i`` holds ``tensors[i]``
        (local shapes; the same values on every replica)."""
        bucket = self.bucket
        flat = torch.zeros(bucket.reduced.numel(), dtype=torch.float32,
                           device=bucket.grad_data.device)
        for i, (tensor, offset) in enumerate(zip(tensors, bucket.reduced_offsets)):
            if bucket.full_data is None:
                flat[offset:offset + tensor.numel()].copy_(tensor.reshape(-1))
            elif self.main[i]:
                layout = bucket.layouts[i]
                full = flat[offset:offset + self._numel(i)].view(layout.full_shape)
                layout.write_shard(full, tensor.to(torch.float32))
        if bucket.full_data is not None and bucket.reduces:
            dist.all_reduce(flat, group=bucket.group)    # one writer per chunk: the sum is exact
        return flat[self.lo:self.lo + self.shard_numel]

    def gather(self, shard: torch.Tensor, dtype: torch.dtype, async_op: bool = False,
               out: torch.Tensor | None = None):
        """All-gather ``shard`` (cast to ``dtype``) into a flat buffer (the first elements of
        ``out`` if given, else a new one); (buffer, work)."""
        if self.size == 1:
            return shard.to(dtype), None
        numel = self.shard_numel * self.size
        flat = (torch.empty(numel, dtype=dtype, device=shard.device) if out is None
                else out[:numel])
        work = _all_gather_flat(flat, shard.to(dtype), group=self.bucket.group,
                                async_op=async_op)
        return flat, work

    def local_values(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's local tensor out of a gathered flat buffer."""
        bucket = self.bucket
        out = []
        for i, (param, offset) in enumerate(zip(bucket.params, bucket.reduced_offsets)):
            values = flat[offset:offset + self._numel(i)]
            if bucket.full_data is None:
                out.append(values.view_as(param))
            else:
                out.append(bucket.layouts[i].shard(values.view(bucket.layouts[i].full_shape)))
        return out


class DistributedOptimizer:
    """AdamW with master weights and moments sharded over each bucket's sync group.

    The trainer uses it in place of both GradSync's all-reduce and ``make_optimizer``'s AdamW:
    :meth:`sync`, :meth:`owned_sum_of_squares` and :meth:`clip` as GradSync's, then :meth:`step`;
    ``param_groups`` are the shard AdamW's (the scheduler's handle).

    Args:
        grad_sync: the stage's GradSync, built with ``shard_padding=True``.
        model: the stage model (parameter names for the checkpoint's per-parameter states).
        settings: AdamW hyper-parameters (runtime/optimizer.py).
        fused: torch's fused AdamW kernel (runtime/optimizer.py ``fused_adamw``).
    """

    def __init__(self, grad_sync: GradSync, model: torch.nn.Module, settings: OptimizerSettings,
                 fused: bool = False):
        if not grad_sync.shard_padding:
            raise ValueError("the distributed optimizer needs GradSync(shard_padding=True)")
        settings.validate()
        self.grad_sync = grad_sync
        self.names = {param: name for name, param in model.named_parameters()}
        main = set(grad_sync.norm_params)
        self.buckets = [_ShardedBucket(bucket, [p in main for p in bucket.params])
                        for bucket in grad_sync.buckets]
        # The same two groups as make_optimizer (group 0 decayed), of shard views.
        self.optimizer = megatron_adamw(
            ((segment.view, sharded.bucket.layouts[segment.index])
             for sharded in self.buckets for segment in sharded.segments), settings, fused)
        self._set_step(0)
        self.load()

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def summary(self) -> str:
        """The log line of a job's rank 0: how much of the optimizer state this rank keeps."""
        kept = sum(sharded.shard_numel for sharded in self.buckets)   # padding included
        local = sum(p.numel() for p in self.grad_sync.params)
        return (f"> distributed optimizer: rank {dist.get_rank()} keeps master weights and Adam "
                f"moments of {kept:,} of its {local:,} parameter elements")

    # ---- per iteration -----------------------------------------------------------------------
    def sync(self) -> None:
        """Reduce-scatter every bucket (GradSync's sync with ``shard_padding``, overlapped with
        the backward when it is built so): each rank gets the global-batch gradient of its
        shards."""
        self.grad_sync.sync()

    def owned_sum_of_squares(self) -> torch.Tensor:
        """This rank's share of the squared global grad norm (module doc, step 2), float64."""
        grads = [segment.view.grad for sharded in self.buckets
                 for segment in sharded.segments if sharded.counted(segment)]
        total = torch.zeros((), dtype=torch.float64, device=self.grad_sync.params[0].device)
        if grads:
            total += torch.stack(torch._foreach_norm(grads)).double().square().sum()
        return total

    def clip(self, max_norm: float, total_norm: float) -> None:
        clip_grad_by_total_norm_fp32(self._views(), max_norm, total_norm)

    @torch.no_grad()
    def step(self) -> None:
        """AdamW on the shards, then every member's updated shards written into its weights."""
        self.optimizer.step()
        self.steps += 1
        self._write_params()

    def _views(self) -> list[torch.Tensor]:
        return [segment.view for sharded in self.buckets for segment in sharded.segments]

    def _write_params(self) -> None:
        """All-gather every bucket's updated shards and write them into its weights. One
        bucket's all-gather runs while the previous one is written, and no more than those two
        gathered buffers are alive: all buckets' at once would be a transient of 2 B per
        parameter of a bf16 stage beside the state at every step."""
        in_flight: list[tuple] = []
        for sharded in self.buckets:
            in_flight.append((sharded, *sharded.gather(
                sharded.master, sharded.bucket.params[0].dtype, async_op=True)))
            if len(in_flight) == 2:
                self._write_bucket(*in_flight.pop(0))
        for gathered in in_flight:
            self._write_bucket(*gathered)

    @staticmethod
    def _write_bucket(sharded: _ShardedBucket, flat: torch.Tensor, work) -> None:
        if work is not None:
            work.wait()
        for param, value in zip(sharded.bucket.params, sharded.local_values(flat)):
            param.data.copy_(value)

    # ---- checkpoints -------------------------------------------------------------------------
    @torch.no_grad()
    def param_states(self, host: torch.device = torch.device("cpu")
                     ) -> dict[str, dict[str, torch.Tensor]]:
        """Adam moments per local parameter name, in the parameter's local shape (fp32): the
        non-distributed optimizer's per-parameter state, plus ``MASTER_KEY`` (the fp32 master)
        for 16-bit parameters, on ``host`` (their own memory: training may go on while they
        are written). A collective: every rank calls it.

        The unsharded state never sits on the device: each bucket's shards are all-gathered
        into one staging buffer, reused by every bucket and key, and copied from it to the
        host, so a save needs one bucket's fp32 elements of device memory beside the state
        (GradSync's ``bucket_numel`` at most), not the 12 B per parameter of a 16-bit stage's
        unsharded masters and moments."""
        gathered = [sharded.shard_numel * sharded.size for sharded in self.buckets
                    if sharded.size > 1]
        staging = (torch.empty(max(gathered), dtype=torch.float32,
                               device=self.buckets[0].master.device) if gathered else None)
        out: dict[str, dict[str, torch.Tensor]] = {}
        for sharded in self.buckets:
            keys = dict(zip(ADAM_STATE_KEYS, (sharded.moments[k] for k in ADAM_STATE_KEYS)))
            if sharded.bucket.params[0].dtype != torch.float32:
                keys[MASTER_KEY] = sharded.master
            for key, shard in keys.items():
                flat, _ = sharded.gather(shard, torch.float32, out=staging)
                on_host = flat.to(host, copy=True)    # a copy even where the device is the host
                for param, value in zip(sharded.bucket.params, sharded.local_values(on_host)):
                    out.setdefault(self.names[param], {})[key] = value
        return out

    @torch.no_grad()
    def load(self, param_states: dict[str, dict[str, torch.Tensor]] | None = None,
             step: int = 0, masters: dict[str, torch.Tensor] | None = None) -> None:
        """Refill the master shards from ``masters`` (local name -> fp32 tensor in the local
        shape: a checkpoint's masters or fp32 weights), or without it from the live parameters
        (construction); and, if ``param_states`` is given (local name ->
        ``exp_avg``/``exp_avg_sq`` in local shapes, as :meth:`param_states` returns), the
        moment shards and the step count; without it the moments and step stay as they are.
        The live weights are not written: the caller loads them. A collective: every rank
        calls it."""
        for sharded in self.buckets:
            params = sharded.bucket.params
            sharded.master.copy_(sharded.assemble(
                [p.detach() if masters is None else masters[self.names[p]] for p in params]))
            if param_states is not None:
                for key in ADAM_STATE_KEYS:
                    sharded.moments[key].copy_(sharded.assemble(
                        [param_states[self.names[p]][key] for p in params]))
        if param_states is not None:
            self._set_step(step)

    def _set_step(self, step: int) -> None:
        """Adam state of every shard view: the step, and its windows of the moment shards."""
        for sharded in self.buckets:
            for segment in sharded.segments:
                window = slice(segment.shard_start, segment.shard_start + segment.numel)
                self.optimizer.state[segment.view] = {
                    "step": adam_step(step, segment.view, self.optimizer.defaults),
                    **{key: sharded.moments[key][window] for key in ADAM_STATE_KEYS}}
        self.steps = step
