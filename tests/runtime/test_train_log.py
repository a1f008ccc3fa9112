"""Megatron-LM's FLOP count of a GPT iteration (runtime/train_log.py), by hand."""

import pytest

from megatron_autohet.runtime.train_log import num_floating_point_operations
from megatron_autohet.spec.model import ModelSpec
from helpers.training import global_batches

GPT3_1_3B = ModelSpec("gpt3-1.3b", num_layers=24, hidden_size=2048, num_attention_heads=16,
                      ffn_hidden_size=8192, vocab_size=50257, seq_length=2048,
                      num_query_groups=16)


@pytest.mark.unit
def test_gpt3_1_3b_by_hand():
    # per token, with 3 (forward + two backward GEMMs) x 2 (multiply-add) = 6 per weight:
    mlp = 6 * 2048 * 8192 * 2 * 24                                  # 4,831,838,208
    # QKV 2048 x 6144, core attention 2048 x 2048 / 2 (causal) twice, projection 2048 x 2048
    attention = 6 * (2048 * 6144 + 2048 * 2048 // 2 * 2 + 2048 * 2048) * 24   # 3,019,898,880
    logits = 6 * 2048 * 50304                                       # 618,135,552
    assert mlp + attention + logits == 8_469_872_640
    flops = num_floating_point_operations(GPT3_1_3B, 16, 2048, 50304)
    assert flops == pytest.approx(16 * 2048 * 8_469_872_640, rel=1e-15)


@pytest.mark.unit
def test_gqa_and_gated_mlp_by_hand():
    llama = ModelSpec("tiny-llama", num_layers=2, hidden_size=64, num_attention_heads=4,
                      ffn_hidden_size=256, vocab_size=500, seq_length=32, num_query_groups=2,
                      gated_linear_unit=True, position_embedding_type="rope",
                      tie_embeddings=False)
    mlp = 6 * 64 * 256 * 3 * 2                     # three GEMMs of h x f per gated MLP
    attention = 6 * (64 * (64 + 2 * 32) + 64 * 32 + 64 * 64) * 2    # k = v = 16 x 2 groups
    logits = 6 * 64 * 512
    assert num_floating_point_operations(llama, 4, 32, 512) == 4 * 32 * (mlp + attention + logits)


def _step_peaks(rank, world, plan):
    """One train step of the plan with this rank's device taken for a GPU whose allocator peak
    is 1000 * (rank + 1) bytes (the CPU mode maps the 'cuda' tensors to this CPU)."""
    import torch

    from megatron_autohet.runtime.optimizer import OptimizerSettings
    from megatron_autohet.runtime.trainer import HeteroTrainer

    trainer = HeteroTrainer(plan, plan.model, rank=rank, seed=1,
                            optimizer=OptimizerSettings(lr=1e-3))
    trainer.device = torch.device("cuda", 0)
    torch.cuda.max_memory_allocated = lambda device=None: 1000 * (rank + 1)
    return trainer.train_step(global_batches(plan, 1)[0]).max_allocated_bytes


@pytest.mark.integration
def test_every_ranks_peak_memory_rides_on_the_loss_all_reduce():
    from pathlib import Path

    from helpers.dist_utils import run_on_ranks
    from megatron_autohet.plan import load_plan
    from megatron_autohet.runtime.train_log import IterationRecord

    plan = load_plan(Path(__file__).resolve().parents[2] / "configs/plans/tiny-homogeneous.yaml")
    peaks = [1000 * (r + 1) for r in range(plan.world_size)]
    assert run_on_ranks(plan.world_size, _step_peaks, plan) == [peaks] * plan.world_size
    rec = IterationRecord.make(iteration=1, train_iters=1, global_batch_size=8, seq_length=64,
                               elapsed_s=1.0, learning_rate=1e-4, lm_loss=1.0, grad_norm=1.0,
                               flops_per_iteration=1e12, world_size=plan.world_size,
                               max_allocated_bytes=[2**30, 3 * 2**29])
    assert rec.mem_max_allocated_gigabytes == 1.5
    assert rec.mem_max_allocated_gigabytes_per_rank == [1.0, 1.5]
    assert rec.throughput_tflops_per_gpu == pytest.approx(1 / plan.world_size)
