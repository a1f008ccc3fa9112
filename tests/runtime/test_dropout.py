"""Megatron-LM's --hidden-dropout / --attention-dropout in the plan runtime.

Dropout masks depend on the plan (runtime/stage_model.py), so a run with dropout cannot be
compared with the single-process reference; what is proved instead:

* dropout is honoured: training losses differ from the same job without it, evaluation (dropout
  off in ``model.eval()``) does not, and the same job twice gives the same losses;
* the TP ranks of a stage draw the same hidden-state masks: the TP-replicated parameters (norms,
  row-parallel biases), whose gradients are not summed over TP, stay bit-identical on both TP
  ranks (were the masks different, the replicated activations, their gradients and then the
  weights would diverge);
* a job resumed from its own checkpoint on the same plan continues bit for bit (the RNG
  streams are saved per rank and restored).
"""

from __future__ import annotations

import pytest
import torch

from megatron_autohet.checkpoint.options import CheckpointOptions
from helpers.dist_utils import run_on_ranks
from helpers.checkpointing import one_node_lost, train_job
from helpers.training import OPTIMIZER, SEED, global_batches

pytestmark = pytest.mark.integration

DROPOUT = 0.1
ITERS = 3


def _dropout_runs(rank, world, plan, batches):
    from megatron_autohet.runtime.trainer import HeteroTrainer

    runs = []
    for dropout in (DROPOUT, DROPOUT, 0.0):      # one after the other: the streams are global
        trainer = HeteroTrainer(plan, plan.model, rank=rank, seed=SEED, optimizer=OPTIMIZER,
                                hidden_dropout=dropout, attention_dropout=dropout)
        evaluation = trainer.evaluate(batches[:1])
        runs.append((evaluation, [trainer.train_step(b).loss for b in batches], trainer))
    trainer = runs[0][2]
    replicated = {trainer.layouts[name].global_name: p.detach().clone()
                  for name, p in trainer.model.named_parameters()
                  if trainer.layouts[name].partition_dim is None}
    return {"evaluations": [run[0] for run in runs], "losses": [run[1] for run in runs],
            "tp_rank": trainer.state.role.tp_rank, "stage": trainer.state.role.stage.stage,
            "replicated": replicated}


def test_dropout_is_honoured_and_tp_ranks_draw_the_same_masks():
    plan = one_node_lost()                         # [TP2 on a100 | TP1 on h800]
    batches = global_batches(plan, ITERS)
    results = run_on_ranks(plan.world_size, _dropout_runs, plan, batches)
    first = results[0]
    with_dropout, again, without = first["losses"]
    assert with_dropout == again                                    # deterministic
    assert all(a != b for a, b in zip(with_dropout, without))      # dropout trains
    assert len(set(first["evaluations"])) == 1                      # and is off in eval
    assert all(r["losses"] == first["losses"] for r in results)     # every rank reports the same
    tp = [r for r in results if r["stage"] == 0]
    assert sorted(r["tp_rank"] for r in tp) == [0, 1]
    assert tp[0]["replicated"], "the TP2 stage has TP-replicated parameters"
    for name, value in tp[0]["replicated"].items():
        assert torch.equal(value, tp[1]["replicated"][name]), name


def test_dropout_job_resumes_bit_exactly_on_its_plan(tmp_path):
    plan = one_node_lost()
    total, half = 4, 2
    batches = global_batches(plan, total)
    full = run_on_ranks(plan.world_size, train_job, plan, batches, CheckpointOptions(),
                        total=total, dropout=DROPOUT)[0]
    save = tmp_path / "ckpt"
    first = run_on_ranks(plan.world_size, train_job, plan, batches,
                         CheckpointOptions(save=str(save), save_interval=half),
                         exit_interval=half, total=total, dropout=DROPOUT)[0]
    assert first == full[:half]
    rest = run_on_ranks(plan.world_size, train_job, plan, batches,
                        CheckpointOptions(load=str(save)), total=total, dropout=DROPOUT)[0]
    assert full[:half] + rest == full


@pytest.mark.parametrize("flag", ["--hidden-dropout", "--attention-dropout"])
def test_autohet_train_refuses_a_dropout_outside_0_1(flag, capsys):
    from megatron_autohet.cli.main import main

    assert main(["train", "--plan", "x.yaml", "--model", "x.yaml", flag, "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"autohet train: error: <command line>: field '{flag}': got 1.0 "
                   "(allowed: a probability in [0, 1))"]
