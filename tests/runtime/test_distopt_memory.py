"""The distributed optimizer never holds its unsharded state on the device: not in a save, not
in the weights' all-gather of a step.

``DistributedOptimizer.param_states`` returns per-parameter tensors on the host it is given and
stages each bucket through one reused device buffer. On the CPU machine the "device" is the CPU,
so the host copies go to the ``meta`` device here: every tensor the call allocates on the CPU is
then device memory, and their total is bounded by one bucket's fp32 elements (the old save
cloned every gathered parameter state on the device: 12 B per parameter of a bf16 stage).
A step all-gathers the updated shards bucket by bucket with at most two buckets' buffers alive.
Save and resume equivalence is tests/checkpoint/test_checkpoint.py's (distributed-optimizer cases).
"""

from __future__ import annotations

import weakref
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from helpers.dist_utils import run_on_ranks
from megatron_autohet.plan import load_plan
from megatron_autohet.spec.precision import PRECISIONS

pytestmark = pytest.mark.integration

PLANS = Path(__file__).resolve().parents[2] / "configs" / "plans"
BUCKET_NUMEL = 30_000          # several buckets per stage of the tiny model


class NewStorageBytes(TorchDispatchMode):
    """Bytes of every storage an op creates on the CPU (views and in-place results reuse their
    inputs' storages and are not counted); the largest one."""

    def __init__(self):
        super().__init__()
        self.total = 0
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor) and t.device.type == "cpu"}
        result = func(*args, **(kwargs or {}))
        for out in tree_flatten(result)[0]:
            if isinstance(out, torch.Tensor) and out.device.type == "cpu":
                storage = out.untyped_storage()
                if storage.data_ptr() not in inputs and storage.nbytes():
                    inputs.add(storage.data_ptr())
                    self.total += storage.nbytes()
                    self.largest = max(self.largest, storage.nbytes())
        return result


class LiveBytes(NewStorageBytes):
    """Also the most bytes of those storages alive at once (a storage counts as alive while the
    tensor an op first returned it in is)."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = self.total
        result = super().__torch_dispatch__(func, types, args, kwargs)
        if self.total > before:
            out = next(t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor))
            self.live += self.total - before
            self.peak = max(self.peak, self.live)
            weakref.finalize(out, self._free, self.total - before)
        return result

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes


def _trainer(rank, plan):
    from megatron_autohet.runtime.optimizer import OptimizerSettings
    from megatron_autohet.runtime.trainer import HeteroTrainer

    return HeteroTrainer(plan, plan.model, rank=rank, seed=5,
                         optimizer=OptimizerSettings(lr=1e-3), precision=PRECISIONS["bf16"],
                         distributed_optimizer=True, bucket_numel=BUCKET_NUMEL)


def _save_path_allocations(rank, world, plan):
    trainer = _trainer(rank, plan)
    optimizer = trainer.optimizer
    torch.manual_seed(rank)
    for sharded in optimizer.buckets:
        sharded.grad_shard.normal_()
    optimizer.step()                                       # non-zero moments
    counter = NewStorageBytes()
    with counter:
        on_meta = optimizer.param_states(host=torch.device("meta"))
    states = optimizer.param_states()                      # on the CPU host: the values
    before = {name: {k: v.clone() for k, v in s.items()} for name, s in states.items()}
    for sharded in optimizer.buckets:                      # training goes on after a save
        for moment in sharded.moments.values():
            moment.add_(1.0)
        sharded.master.add_(1.0)
    unchanged = all(torch.equal(states[n][k], before[n][k]) for n in states for k in states[n])
    local = dict(trainer.model.named_parameters())
    return {"devices": sorted({t.device.type for s in on_meta.values() for t in s.values()}),
            "total": counter.total, "largest": counter.largest,
            "bucket_bytes": max(4 * s.shard_numel * s.size for s in optimizer.buckets),
            "buckets": len(optimizer.buckets),
            "state_bytes": sum(t.numel() * 4 for s in on_meta.values() for t in s.values()),
            "keys": sorted({k for s in on_meta.values() for k in s}),
            "shapes_match": all(t.shape == local[n].shape for n, s in states.items()
                                for t in s.values()),
            "unchanged": unchanged}


@pytest.mark.parametrize("plan_file", ["tiny-two-pipelines.yaml", "tiny-homogeneous.yaml"])
def test_save_stages_one_bucket_at_a_time_through_the_host(plan_file):
    plan = replace(load_plan(PLANS / plan_file), use_distributed_optimizer=True)
    results = run_on_ranks(plan.world_size, _save_path_allocations, plan, timeout=240)
    staged_somewhere = False
    for rank, counted in enumerate(results):
        assert counted["devices"] == ["meta"], (rank, counted)
        assert counted["keys"] == ["exp_avg", "exp_avg_sq", "fp32_param"]
        assert counted["shapes_match"] and counted["unchanged"], (rank, counted)
        assert counted["buckets"] > 1, counted
        # one staging buffer of the largest bucket: nothing else of the state on the device
        assert counted["total"] <= counted["bucket_bytes"], (rank, counted)
        assert counted["state_bytes"] > 2 * counted["bucket_bytes"], (rank, counted)
        staged_somewhere |= counted["largest"] > 0
    assert staged_somewhere                     # some bucket is sharded over several ranks


def _weight_gather_peak(rank, world, plan):
    optimizer = _trainer(rank, plan).optimizer
    counter = LiveBytes()
    with counter:
        optimizer._write_params()
    # a bucket in flight: its bf16 gathered buffer and the bf16 cast of this rank's shard
    in_flight = sorted(2 * s.shard_numel * (s.size + 1) for s in optimizer.buckets)
    return {"peak": counter.peak, "two_largest": sum(in_flight[-2:]), "all": sum(in_flight)}


def test_step_gathers_the_weights_two_buckets_at_a_time():
    plan = replace(load_plan(PLANS / "tiny-homogeneous.yaml"), use_distributed_optimizer=True)
    for rank, counted in enumerate(run_on_ranks(plan.world_size, _weight_gather_peak, plan,
                                                timeout=240)):
        assert 0 < counted["peak"] <= counted["two_largest"], (rank, counted)
        assert counted["all"] > counted["two_largest"], (rank, counted)      # it would show


def _gradient_storages(rank, world, plan):
    optimizer = _trainer(rank, plan).optimizer
    return [(s.size, s.grad_shard.untyped_storage().data_ptr()
             == s.bucket.reduced.untyped_storage().data_ptr()) for s in optimizer.buckets]


def test_gradient_shards_are_slices_of_the_buckets():
    """The reduce-scatter fills this rank's slice of the bucket in place: no fp32 gradient shard
    beside GradSync's buffers (4 / D bytes per parameter the cost model does not count)."""
    plan = replace(load_plan(PLANS / "tiny-two-pipelines.yaml"), use_distributed_optimizer=True)
    results = run_on_ranks(plan.world_size, _gradient_storages, plan, timeout=240)
    assert any(size > 1 for rank in results for size, _ in rank)
    assert all(shared for rank in results for _, shared in rank), results
