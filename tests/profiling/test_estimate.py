"""Analytic estimates: the formulas on hand-computed cases."""

import pytest

from megatron_autohet.profiling.estimate import (estimate_entry, estimate_profile,
                                                 layer_activation_bytes, layer_forward_flops,
                                                 layer_param_count, ring_allreduce_s)
from megatron_autohet.spec import load_cluster, load_model
from megatron_autohet.spec.model import ModelSpec

pytestmark = pytest.mark.unit

GPT = ModelSpec("m", num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
                vocab_size=512, seq_length=32, num_query_groups=4)


def test_flops_match_the_24bsh2_plus_4bs2h_rule():
    b, s, h = 2, 32, 64
    full = 24 * b * s * h * h + 4 * b * s * s * h
    assert layer_forward_flops(GPT, 1, b, s) == full
    assert layer_forward_flops(GPT, 4, b, s) == pytest.approx(full / 4)


def test_korthikanti_activation_formula_without_flash():
    b, s, h, a, t = 2, 32, 64, 4, 2
    expected = s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    assert layer_activation_bytes(GPT, t, b, s, attention="unfused") == pytest.approx(expected)


def test_param_count_per_shard():
    h = 64
    full = layer_param_count(GPT, 1)
    assert full == 12 * h * h + 13 * h   # 4h^2 + 8h^2 weights, biases and norms
    assert layer_param_count(GPT, 2) == (full - 6 * h) // 2 + 6 * h


def test_ring_allreduce():
    assert ring_allreduce_s(1e9, 1, 100) == 0
    assert ring_allreduce_s(1e9, 4, 100) == pytest.approx(2 * 3 / 4 * 1e9 / (100e9 * 0.8))


def test_gqa_and_gated_mlp_change_counts():
    llama = load_model("configs/models/llama2-7b.yaml")
    gqa = ModelSpec(**{**llama.to_dict(), "num_query_groups": 8})
    assert layer_param_count(gqa, 1) < layer_param_count(llama, 1)
    assert layer_forward_flops(gqa, 1, 1, 128) < layer_forward_flops(llama, 1, 1, 128)


def test_estimates_are_marked_and_faster_gpus_are_faster():
    cluster = load_cluster("configs/clusters/a100-h800-h20.yaml")
    model = load_model("configs/models/gpt3-1.3b.yaml")
    profile = estimate_profile(model, cluster, 1, 2048, [1, 2])
    assert len(profile.entries) == 6
    for e in profile.entries.values():
        assert {e.layer.source, e.embedding.source, e.output.source} == {"estimated"}
    a100, h800 = (profile.get(g, 1, 1, 2048) for g in ("A100-80GB", "H800"))
    assert h800.layer.forward_s < a100.layer.forward_s
    assert a100.layer.backward_s >= 2 * a100.layer.forward_s * 0.99
    tp2 = estimate_entry(model, cluster.gpu_types["A100-80GB"], 2, 1, 2048, 300)
    assert tp2.layer.forward_s < a100.layer.forward_s
    assert tp2.layer.activation_bytes_recompute == 1 * 2048 * 2048 * 2


def test_attention_kind_sets_the_score_terms_and_is_recorded():
    b, s, a, t = 2, 32, 4, 2
    flash = layer_activation_bytes(GPT, t, b, s, attention="flash")
    unfused = layer_activation_bytes(GPT, t, b, s, attention="unfused")
    # unfused keeps softmax output (2 B), dropout mask (1 B) and dropout output (2 B) per score;
    # flash keeps one fp32 log-sum-exp per query row and head
    assert unfused - flash == pytest.approx((5 * a * s * s * b - 4 * a * s * b) / t)
    with pytest.raises(ValueError, match="attention 'fused' is not one of"):
        layer_activation_bytes(GPT, t, b, s, attention="fused")
    cluster = load_cluster("configs/clusters/a100-h800-h20.yaml")
    for attention, per_layer in (("flash", flash), ("unfused", unfused)):
        profile = estimate_profile(GPT, cluster, b, s, [t], attention=attention)
        assert profile.attention == attention
        assert {e.layer.activation_bytes for e in profile.entries.values()} == {per_layer}
    assert estimate_profile(GPT, cluster, b, s, [t]).attention == "flash"   # the runtime's
