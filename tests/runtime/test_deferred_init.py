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

from helpers.checkpointing import Batches, one_node_lost
from helpers.dist_utils import run_on_ranks
from helpers.training import OPTIMIZER, SEED, global_batches

pytestmark = pytest.mark.integration

TOTAL, HALF = 4, 2
CONFIGS = {"fp32, dropout": dict(precision=FP32, dropout=0.1),
           "bf16": dict(precision=BF16, dropout=0.0),
           "bf16, distributed optimizer, dropout": dict(precision=BF16, dropout=0.1,
                                                        distributed_optimizer=True)}


def _train(rank, world, plan, batches, options, *, initialize, precision, dropout,
           distributed_optimizer=False, exit_interval=None):
    """One job as ``autohet train`` runs it (train_iterations with the Checkpointer), built
    with or without initial weights: its (loss, grad norm) per iteration and how many full
    initial tensors this rank drew (runtime/init.py ``initial_value``)."""
    import megatron_autohet.runtime.init as init
    from megatron_autohet.checkpoint.checkpointer import Checkpointer
    from megatron_autohet.runtime.optimizer import make_lr_scheduler
    from megatron_autohet.runtime.trainer import HeteroTrainer, train_iterations

    drawn = []
    original_value = init.initial_value

    def counted(layout, *args):
        drawn.append(layout.global_name)
        return original_value(layout, *args)

    init.initial_value = counted
    trainer = HeteroTrainer(plan, plan.model, rank=rank, seed=SEED, optimizer=OPTIMIZER,
                            precision=precision, distributed_optimizer=distributed_optimizer,
                            hidden_dropout=dropout, attention_dropout=dropout,
                            initialize=initialize)
    if not initialize:
        with pytest.raises(RuntimeError, match="initialize=False"):
            trainer.train_step(batches[0])
    scheduler = make_lr_scheduler(trainer.optimizer, OPTIMIZER, TOTAL, plan.global_batch_size)
    checkpointer = Checkpointer(options, trainer, scheduler, seed=SEED, train_args={})
    metrics = []
    original_step = trainer.train_step

    def recording_step(batch):
        step = original_step(batch)
        metrics.append((step.loss, step.grad_norm))
        return step

    trainer.train_step = recording_step
    train_iterations(trainer, Batches(batches), scheduler, train_iters=TOTAL,
                     scheduler_increment=plan.global_batch_size, log=False,
                     checkpointer=checkpointer, exit_interval=exit_interval)
    return metrics, len(drawn)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_a_resume_draws_no_initial_weights_and_continues_exactly(tmp_path, config):
    plan = one_node_lost()                         # [TP2 on a100 | TP1 on h800]
    batches = global_batches(plan, TOTAL)
    kw = CONFIGS[config]
    full = run_on_ranks(plan.world_size, _train, plan, batches, CheckpointOptions(),
                        initialize=True, **kw)
    assert all(drawn > 0 for _, drawn in full)
    save = tmp_path / "ckpt"
    run_on_ranks(plan.world_size, _train, plan, batches,
                 CheckpointOptions(save=str(save), save_interval=HALF), initialize=True,
                 exit_interval=HALF, **kw)
    rest = run_on_ranks(plan.world_size, _train, plan, batches,
                        CheckpointOptions(load=str(save)), initialize=False, **kw)
    assert [drawn for _, drawn in rest] == [0] * plan.world_size
    assert full[0][0][:HALF] + rest[0][0] == full[0][0]


@pytest.mark.parametrize("config", list(CONFIGS))
def test_no_checkpoint_to_load_gives_the_initial_weights_of_a_build(tmp_path, config):
    """--load of an empty directory: the weights (and masters) are initialised after the
    resume found nothing, and the run is the one of a job built with them."""
    plan = one_node_lost()
    batches = global_batches(plan, TOTAL)
    kw = CONFIGS[config]
    full = run_on_ranks(plan.world_size, _train, plan, batches, CheckpointOptions(),
                        initialize=True, **kw)
    late = run_on_ranks(plan.world_size, _train, plan, batches,
                        CheckpointOptions(load=str(tmp_path / "empty")), initialize=False, **kw)
    assert [drawn for _, drawn in late] == [drawn for _, drawn in full]
    assert late[0][0] == full[0][0]
