"""A job that loads a checkpoint builds its model without initial weights (runtime/trainer.py
``initialize``): the checkpoint replaces every weight and master, so the seed's full fp32
tensors are never drawn; when there is no checkpoint to load, the trainer gets exactly the
weights and masters a build with them gives. Either way the run is the uninterrupted one, bit
for bit, with dropout (the RNG streams) and in bf16 with the distributed optimizer (masters
derived from the weights)."""

from __future__ import annotations

import pytest

from megatron_autohet.checkpoint.options import CheckpointOptions
from megatron_autohet.spec.precision import BF16, FP32

from helpers.checkpointing import one_node_lost, train_job
from helpers.dist_utils import run_on_ranks
from helpers.training import global_batches

pytestmark = pytest.mark.integration

TOTAL, HALF = 4, 2
CONFIGS = {"fp32, dropout": dict(precision=FP32, dropout=0.1),
           "bf16": dict(precision=BF16, dropout=0.0),
           "bf16, distributed optimizer, dropout": dict(precision=BF16, dropout=0.1,
                                                        distributed_optimizer=True)}


def _run(plan, batches, options, **kw):
    """One job as ``autohet train`` runs it (helpers/checkpointing.train_job: built without
    initial weights when it has a checkpoint to load) on every rank: per rank, its metrics and
    how many full initial tensors it drew."""
    return run_on_ranks(plan.world_size, train_job, plan, batches, options, total=TOTAL,
                        draws=True, **kw)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_a_resume_draws_no_initial_weights_and_continues_exactly(tmp_path, config):
    plan = one_node_lost()                         # [TP2 on a100 | TP1 on h800]
    batches = global_batches(plan, TOTAL)
    kw = CONFIGS[config]
    full = _run(plan, batches, CheckpointOptions(), **kw)
    assert all(drawn > 0 for _, drawn in full)
    save = tmp_path / "ckpt"
    _run(plan, batches, CheckpointOptions(save=str(save), save_interval=HALF), exit_interval=HALF,
         **kw)
    rest = _run(plan, batches, CheckpointOptions(load=str(save)), **kw)
    assert [drawn for _, drawn in rest] == [0] * plan.world_size
    assert full[0][0][:HALF] + rest[0][0] == full[0][0]


@pytest.mark.parametrize("config", list(CONFIGS))
def test_no_checkpoint_to_load_gives_the_initial_weights_of_a_build(tmp_path, config):
    """--load of an empty directory: the weights (and masters) are initialised after the
    resume found nothing, and the run is the one of a job built with them."""
    plan = one_node_lost()
    batches = global_batches(plan, TOTAL)
    kw = CONFIGS[config]
    full = _run(plan, batches, CheckpointOptions(), **kw)
    late = _run(plan, batches, CheckpointOptions(load=str(tmp_path / "empty")), **kw)
    assert [drawn for _, drawn in late] == [drawn for _, drawn in full]
    assert late[0][0] == full[0][0]
