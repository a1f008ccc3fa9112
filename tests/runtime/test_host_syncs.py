"""The trainer does not wait for the device once per micro-batch.

Every ``.item()`` / ``float(tensor)`` is a host sync on a GPU (it waits for the device's queue to
drain) and reaches the dispatcher as ``aten._local_scalar_dense``, on the CPU too. An iteration
(and an evaluation) must read the same number of scalars whatever the number of micro-batches:
the losses are summed on the device and read once with the grad norm.
"""

from __future__ import annotations

import pytest
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helpers.dist_utils import run_on_ranks
from megatron_autohet.spec.model import load_model
from helpers.training import OPTIMIZER, global_batches

pytestmark = pytest.mark.integration

TINY = load_model(Path(__file__).resolve().parents[2] / "configs/models/tiny.yaml")


class ScalarReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _scalar_reads(rank, world, num_microbatches):
    from megatron_autohet.testing.reference import reference_plan
    from megatron_autohet.runtime.trainer import HeteroTrainer

    plan = reference_plan(TINY, micro_batch_size=1, num_microbatches=num_microbatches,
                          seq_length=16)
    trainer = HeteroTrainer(plan, plan.model, rank=rank, seed=3, optimizer=OPTIMIZER)
    batch = global_batches(plan, 1)[0]
    trainer.train_step(batch)                 # the first step's one-time work is not counted
    step = ScalarReads()
    with step:
        metrics = trainer.train_step(batch)
    evaluation = ScalarReads()
    with evaluation:
        trainer.evaluate([batch, batch])
    return step.count, evaluation.count, metrics.loss


def test_reads_per_iteration_do_not_grow_with_the_micro_batches():
    two = run_on_ranks(1, _scalar_reads, 2)[0]
    six = run_on_ranks(1, _scalar_reads, 6)[0]
    assert two[:2] == six[:2], (two, six)
    assert two[2] > 0 and six[2] > 0
