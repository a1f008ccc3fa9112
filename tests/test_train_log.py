"""Megatron-LM's FLOP count of a GPT iteration (runtime/train_log.py), by hand."""

import pytest

from megatron_autohet.runtime.train_log import num_floating_point_operations
from megatron_autohet.spec.model import ModelSpec

GPT3_1_3B = ModelSpec("gpt3-1.3b", num_layers=24, hidden_size=2048, num_attention_heads=16,
                      ffn_hidden_size=8192, vocab_size=50257, seq_length=2048,
                      num_query_groups=16)


def test_gpt3_1_3b_by_hand():
    # per token, with 3 (forward + two backward GEMMs) x 2 (multiply-add) = 6 per weight:
    mlp = 6 * 2048 * 8192 * 2 * 24                                  # 4,831,838,208
    # QKV 2048 x 6144, core attention 2048 x 2048 / 2 (causal) twice, projection 2048 x 2048
    attention = 6 * (2048 * 6144 + 2048 * 2048 // 2 * 2 + 2048 * 2048) * 24   # 3,019,898,880
    logits = 6 * 2048 * 50304                                       # 618,135,552
    assert mlp + attention + logits == 8_469_872_640
    flops = num_floating_point_operations(GPT3_1_3B, 16, 2048, 50304)
    assert flops == pytest.approx(16 * 2048 * 8_469_872_640, rel=1e-15)


def test_gqa_and_gated_mlp_by_hand():
    llama = ModelSpec("tiny-llama", num_layers=2, hidden_size=64, num_attention_heads=4,
                      ffn_hidden_size=256, vocab_size=500, seq_length=32, num_query_groups=2,
                      gated_linear_unit=True, position_embedding_type="rope",
                      tie_embeddings=False)
    mlp = 6 * 64 * 256 * 3 * 2                     # three GEMMs of h x f per gated MLP
    attention = 6 * (64 * (64 + 2 * 32) + 64 * 32 + 64 * 64) * 2    # k = v = 16 x 2 groups
    logits = 6 * 64 * 512
    assert num_floating_point_operations(llama, 4, 32, 512) == 4 * 32 * (mlp + attention + logits)
