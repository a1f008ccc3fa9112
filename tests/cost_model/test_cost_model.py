"""Cost-model formulas on a hand-built profile with round numbers."""

import random

import pytest

from megatron_autohet.cost_model import (GIB, MEMORY_RESERVED_GIB, StageCost, evaluate_plan,
                                         fleet_ideal_tokens_per_s,
                                         pipeline_time_s, simulate_1f1b)
from megatron_autohet.plan import Pipeline, Plan, RankInfo, Stage
from megatron_autohet.profiling.estimate import (LINK_EFFICIENCY, MEMORY_EFFICIENCY,
                                                 layer_param_count)
from megatron_autohet.profiling.profile import OpCost, Profile, ProfileEntry
from megatron_autohet.spec.cluster import cluster_from_dict
from megatron_autohet.spec.model import ModelSpec
from megatron_autohet.spec.precision import FP32

pytestmark = pytest.mark.unit

MODEL = ModelSpec("hand", num_layers=4, hidden_size=64, num_attention_heads=4,
                  ffn_hidden_size=256, vocab_size=512, seq_length=32, num_query_groups=4)
INTRA, NIC = 0.008192, 0.0016          # GB/s: one P2P (2 x 4096 B) takes exactly 1 ms intra-node
CLUSTER = cluster_from_dict({"name": "hand", "inter_node_bandwidth_gbs": NIC, "nodes": [
    {"name": "a", "gpu": "A100-80GB", "gpus": 2, "intra_node_bandwidth_gbs": INTRA},
    {"name": "b", "gpu": "H800", "gpus": 1, "intra_node_bandwidth_gbs": INTRA}]})
WORD, POS, NORM = 512 * 64, 32 * 64, 2 * 64
LAYER = layer_param_count(MODEL, 1)     # the sync groups count the model's own tensors


def _profile() -> Profile:
    profile = Profile("hand")
    for gpu in ("A100-80GB", "H800"):
        profile.add(ProfileEntry(
            gpu, 1, 1, 32,
            layer=OpCost(1.0, 2.0, 10, 1, LAYER),
            embedding=OpCost(0.5, 0.5, 5, 5, WORD + POS),
            output=OpCost(1.0, 1.0, 7, 7, WORD + NORM)))
    return profile


def _plan(recompute=False) -> Plan:
    ranks = [RankInfo(0, "a", 0, "A100-80GB"), RankInfo(1, "a", 1, "A100-80GB"),
             RankInfo(2, "b", 0, "H800")]
    return Plan("hand", MODEL, 1, 4, 32, ranks, [
        Pipeline([Stage([0], (0, 2)), Stage([1], (2, 4))], num_microbatches=3),
        Pipeline([Stage([2], (0, 4))], num_microbatches=1)],
        activation_recompute=recompute).validate()


def _allreduce(params, holders, bw):
    return 2 * (holders - 1) / holders * params * 4 / (bw * 1e9 * LINK_EFFICIENCY)


def test_iteration_time_by_hand():
    cost = evaluate_plan(_plan(), CLUSTER, _profile())
    p0, p1 = cost.pipelines
    # stage 0: 2 layers + embedding = 2.5 fwd + 4.5 bwd, 1 ms P2P; stage 1: 3 + 5, last.
    assert [s.time_s for s in p0.stages] == [7.0, 8.0]
    assert p0.stages[0].p2p_s == pytest.approx(0.001)
    assert p0.time_s == pytest.approx(7.001 + 8.0 + 2 * 8.0)
    assert p1.time_s == pytest.approx(4 * 3.0 + 1.0 + 2.0)        # one micro-batch, one stage
    # Sync: pipeline 1's single GPU is in every group; the slowest link is the NIC.
    sync = (_allreduce(2 * LAYER, 2, NIC) * 2 + _allreduce(WORD, 3, NIC)
            + _allreduce(POS, 2, NIC)
            + _allreduce(NORM, 2, NIC))
    assert cost.grad_sync_s == pytest.approx(sync)
    # Optimizer: the max over GPUs, of the A100 of stage 0 and the H800 (faster memory, twice
    # the layers: 4 * LAYER + WORD + POS + NORM params, the tied word matrix counted once).
    opt = max((2 * LAYER + WORD + POS) / 2039, (4 * LAYER + WORD + POS + NORM) / 3350) * 30 / (
        1e9 * MEMORY_EFFICIENCY)
    assert cost.pipelines[1].stages[0].param_count == 4 * LAYER + WORD + POS + NORM
    assert cost.optimizer_s == pytest.approx(opt)
    assert cost.iteration_time_s == pytest.approx(31.001 + sync + opt)
    assert cost.tokens_per_s == pytest.approx(4 * 32 / cost.iteration_time_s)


def test_profile_without_an_entry_for_a_stage_is_a_clear_error():
    from megatron_autohet.errors import ConfigError
    profile = _profile()
    del profile.entries[("H800", 1, 1, 32)]
    with pytest.raises(ConfigError) as err:
        evaluate_plan(_plan(), CLUSTER, profile)
    assert str(err.value) == (
        "<profile>: field 'entries': no entry for gpu=H800 tp=1 micro_batch_size=1 seq_length=32 "
        "(model hand) (allowed: a profile covering every GPU type and TP degree used (see "
        "`autohet profile`, or the analytic estimate))")


def test_position_table_synced_at_the_models_length_when_training_shorter_sequences():
    # GPTModel sizes the learned position table by the model's seq_length (32), whatever length
    # the plan trains (16): its gradient all-reduce moves all 32 rows.
    profile = Profile("hand")
    for gpu in ("A100-80GB", "H800"):
        profile.add(ProfileEntry(gpu, 1, 1, 16, layer=OpCost(1.0, 2.0, 10, 1, LAYER),
                                 embedding=OpCost(0.5, 0.5, 5, 5, WORD + POS),
                                 output=OpCost(1.0, 1.0, 7, 7, WORD + NORM)))
    plan = _plan()
    plan.seq_length = 16
    cost = evaluate_plan(plan.validate(), CLUSTER, profile)
    sync = (_allreduce(2 * LAYER, 2, NIC) * 2 + _allreduce(WORD, 3, NIC)
            + _allreduce(POS, 2, NIC)
            + _allreduce(NORM, 2, NIC))
    assert cost.grad_sync_s == pytest.approx(sync)


def test_memory_by_hand_with_and_without_recompute():
    cost = evaluate_plan(_plan(), CLUSTER, _profile())
    s0 = cost.pipelines[0].stages[0]
    assert s0.in_flight_microbatches == 2
    reserved = MEMORY_RESERVED_GIB * GIB
    assert s0.memory_gib * GIB == pytest.approx(
        (2 * LAYER + WORD + POS) * 18 + 2 * (2 * 10 + 5) + reserved)
    # the last stage: the output layer's kept 7 B, and its bf16 logits (1 x 32 tokens x 512
    # vocabulary x 2 B) beside the fp32 copy while the loss runs
    logits = 32 * 512 * 2
    last = cost.pipelines[1].stages[0]
    assert last.memory_gib * GIB == pytest.approx(
        (4 * LAYER + WORD + POS + NORM) * 18 + (4 * 10 + 5 + 7) + logits + reserved)
    s1 = cost.pipelines[0].stages[1]
    assert s1.memory_gib * GIB == pytest.approx(
        (2 * LAYER + WORD + NORM) * 18 + (2 * 10 + 7) + logits + reserved)
    rc = evaluate_plan(_plan(recompute=True), CLUSTER, _profile())
    s0 = rc.pipelines[0].stages[0]
    assert s0.memory_gib * GIB == pytest.approx(
        (2 * LAYER + WORD + POS) * 18 + 2 * (2 * 1 + 5) + 10 + reserved)
    # recompute's one-layer working set (10 B) and the logits never coincide: the larger counts
    s1 = rc.pipelines[0].stages[1]
    assert s1.memory_gib * GIB == pytest.approx(
        (2 * LAYER + WORD + NORM) * 18 + (2 * 1 + 7) + logits + reserved)
    assert s0.backward_s == pytest.approx(4.5 + 2 * 1.0)   # recompute adds the layers' forward


def test_timeline_is_1f1b_and_fits_in_the_closed_form():
    cost = evaluate_plan(_plan(), CLUSTER, _profile())
    first, last = cost.pipelines[0].stages
    assert [(e.kind, e.microbatch) for e in first.timeline] == [
        ("fwd", 0), ("fwd", 1), ("bwd", 0), ("fwd", 2), ("bwd", 1), ("bwd", 2)]
    assert [(e.kind, e.microbatch) for e in last.timeline] == [
        ("fwd", 0), ("bwd", 0), ("fwd", 1), ("bwd", 1), ("fwd", 2), ("bwd", 2)]
    assert last.timeline[0].start_s == pytest.approx(2.5 + 0.0005)   # after one transfer
    makespan = max(e.end_s for s in cost.pipelines[0].stages for e in s.timeline)
    assert makespan <= cost.pipelines[0].time_s + 1e-9


def test_pipeline_formula():
    assert pipeline_time_s([1.0, 2.0, 1.5], 4) == 4.5 + 3 * 2.0


def _stage(fwd, bwd, p2p):
    return StageCost(0, 0, "x", 1, (0, 1), fwd, bwd, p2p, None, 1, 1, 1.0, 1.0, 0.0, 0.0)


def test_deeper_warmup_overlaps_a_slow_link_in_the_simulation():
    # Two stages, f = 1, b = 2, a boundary whose transfer takes 2 each way (c = 4), m = 6.
    # Standard depth 1: stage 0's backwards end at 10, 13, 20, 23, 30, 33 (a round trip of
    # 1 + 2 + 3 + 2 + 2 = 10 covers two micro-batches). Depth 5: stage 0 sends all six
    # activations by 6; stage 1 then computes back to back from 3 (activation k is there at
    # k + 3 <= 3 + 3k), gradient k leaves it at 6 + 3k and arrives at 8 + 3k, so stage 0's
    # backwards end at 10, 13, ..., 25.
    stages = [_stage(1.0, 2.0, 4.0), _stage(1.0, 2.0, 0.0)]
    assert simulate_1f1b(stages, 6, [1, 0]) == pytest.approx(33.0)
    assert [e.end_s for e in stages[0].timeline if e.kind == "bwd"] == pytest.approx(
        [10, 13, 20, 23, 30, 33])
    assert simulate_1f1b(stages, 6, [5, 0]) == pytest.approx(25.0)
    assert [e.end_s for e in stages[0].timeline if e.kind == "bwd"] == pytest.approx(
        [10, 13, 16, 19, 22, 25])
    assert pipeline_time_s([7.0, 3.0], 6) == pytest.approx(45.0)   # the blocking form


def test_simulation_at_standard_depths_within_the_blocking_form():
    rng = random.Random(3)
    for _ in range(200):
        n, m = rng.randint(2, 5), rng.randint(1, 12)
        stages = [_stage(rng.uniform(0.5, 2), rng.uniform(1, 4),
                         rng.choice([0.0, 0.1, 1.0, 4.0, 10.0]) if s < n - 1 else 0.0)
                  for s in range(n)]
        makespan = simulate_1f1b(stages, m)
        assert makespan <= pipeline_time_s([s.time_s + s.p2p_s for s in stages], m) + 1e-9


def test_plan_warmup_depth_keeps_more_activations():
    plan = _plan()
    plan.pipelines[0].stages[0].warmup_microbatches = 2
    deep = evaluate_plan(plan.validate(), CLUSTER, _profile()).pipelines[0].stages[0]
    std = evaluate_plan(_plan(), CLUSTER, _profile()).pipelines[0].stages[0]
    assert (deep.in_flight_microbatches, std.in_flight_microbatches) == (3, 2)
    assert (deep.memory_gib - std.memory_gib) * GIB == pytest.approx(2 * 10 + 5)
    assert [(e.kind, e.microbatch) for e in deep.timeline] == [
        ("fwd", 0), ("fwd", 1), ("fwd", 2), ("bwd", 0), ("bwd", 1), ("bwd", 2)]


def test_hapt_depths_charge_the_closed_form_minus_the_simulated_saving():
    plan = _plan()
    plan.pipelines[0].stages[0].warmup_microbatches = 2
    deep = evaluate_plan(plan.validate(), CLUSTER, _profile())
    std = evaluate_plan(_plan(), CLUSTER, _profile())
    stages, m = std.pipelines[0].stages, 3
    saving = simulate_1f1b(stages, m) - simulate_1f1b(stages, m, [2, 0])
    assert deep.pipelines[0].time_s == pytest.approx(std.pipelines[0].time_s - saving)
    assert deep.pipelines[1].time_s == std.pipelines[1].time_s       # one stage: unchanged


def _reduce_scatter_all_gather(params, holders, bw):
    """fp32 gradients reduce-scattered, bf16 weights all-gathered: (D-1)/D of 4 + 2 bytes."""
    return (holders - 1) / holders * params * (4 + 2) / (bw * 1e9 * LINK_EFFICIENCY)


def test_distributed_optimizer_by_hand():
    """Layers 0-2 and 2-4, the position table and the final norm have two holders, the tied
    word matrix three (both ends of pipeline 0 and pipeline 1): each GPU keeps the fp32 master
    weights and Adam moments (12 B) of 1/D of each, the bf16 weight and fp32 gradient (6 B) of
    everything; the sync is a reduce-scatter + all-gather; Adam steps the shards only."""
    plan = _plan()
    plan.use_distributed_optimizer = True
    cost = evaluate_plan(plan.validate(), CLUSTER, _profile())
    reserved = MEMORY_RESERVED_GIB * GIB
    s0, s1 = cost.pipelines[0].stages
    only = cost.pipelines[1].stages[0]
    kept = {0: LAYER + WORD / 3 + POS / 2, 1: LAYER + WORD / 3 + NORM / 2,
            2: 2 * LAYER + WORD / 3 + POS / 2 + NORM / 2}
    assert s0.memory_gib * GIB == pytest.approx(
        (2 * LAYER + WORD + POS) * 6 + kept[0] * 12 + 2 * (2 * 10 + 5) + reserved)
    assert only.memory_gib * GIB == pytest.approx(
        (4 * LAYER + WORD + POS + NORM) * 6 + kept[2] * 12 + (4 * 10 + 5 + 7) + 32 * 512 * 2
        + reserved)                                         # + the last stage's bf16 logits
    sync = (_reduce_scatter_all_gather(2 * LAYER, 2, NIC) * 2
            + _reduce_scatter_all_gather(WORD, 3, NIC) + _reduce_scatter_all_gather(POS, 2, NIC)
            + _reduce_scatter_all_gather(NORM, 2, NIC))
    assert cost.grad_sync_s == pytest.approx(sync)
    bandwidth = {r: CLUSTER.gpu_types[plan.ranks[r].gpu].memory_bandwidth_gbs for r in kept}
    assert cost.optimizer_s == pytest.approx(max(
        kept[r] * 30 / (bandwidth[r] * 1e9 * MEMORY_EFFICIENCY) for r in kept))
    # against the same plan without it: less memory on every GPU, a shorter sync and step
    plain = evaluate_plan(_plan(), CLUSTER, _profile())
    for sharded, whole in zip(cost.stages, plain.stages):
        assert sharded.memory_gib < whole.memory_gib
    assert cost.grad_sync_s == pytest.approx(0.75 * plain.grad_sync_s)
    assert cost.optimizer_s < plain.optimizer_s


def test_fleet_ideal_is_every_gpus_lone_rate_for_the_whole_model():
    # per micro-batch of 32 tokens: 4 layers x (1 + 2) s + embedding 1 s + output 2 s = 15 s,
    # on each of the 3 GPUs (the hand profile has the same figures for both types)
    ideal = fleet_ideal_tokens_per_s(CLUSTER, _profile(), MODEL, 1, 32)
    assert ideal == pytest.approx(3 * 32 / 15)
    cost = evaluate_plan(_plan(), CLUSTER, _profile())
    assert 0 < cost.tokens_per_s < ideal        # bubbles, links, sync and optimizer cost time


def test_a_profile_in_fp32_prices_fp32_bytes():
    """The same plan and times with a profile in fp32 (a CPU-measured one: the job trains fp32):
    P2P messages of 4-byte elements, 16 bytes of state per parameter (weights are their own
    master), a 28-byte Adam step; gradient sync is fp32 in both."""
    bf16 = evaluate_plan(_plan(), CLUSTER, _profile())
    profile = _profile()
    profile.precision = FP32
    fp32 = evaluate_plan(_plan(), CLUSTER, profile)
    s0, t0 = bf16.pipelines[0].stages[0], fp32.pipelines[0].stages[0]
    assert t0.p2p_s == pytest.approx(2 * s0.p2p_s)
    assert (s0.memory_gib - t0.memory_gib) * GIB == pytest.approx(2 * s0.param_count)
    assert t0.optimizer_s == pytest.approx(s0.optimizer_s * 28 / 30)
    assert fp32.grad_sync_s == pytest.approx(bf16.grad_sync_s)


def test_stage_memory_follows_the_profiles_attention(tmp_path):
    """The attention a profile was made for decides the layers' activation bytes the cost model
    charges, survives a profile file, and estimates for another attention cannot fill it."""
    from megatron_autohet.errors import ConfigError
    from megatron_autohet.profiling.estimate import estimate_profile

    b, s, a = 1, 32, MODEL.num_attention_heads
    flash, unfused = (estimate_profile(MODEL, CLUSTER, b, s, [1], attention=kind)
                      for kind in ("flash", "unfused"))
    memory = {p.attention: evaluate_plan(_plan(), CLUSTER, p).pipelines[0].stages[0].memory_gib
              for p in (flash, unfused)}
    # stage 0 of pipeline 0: 2 layers x 2 micro-batches in flight
    assert (memory["unfused"] - memory["flash"]) * GIB == pytest.approx(
        2 * 2 * (5 * a * s * s * b - 4 * a * s * b))
    path = tmp_path / "profile.yaml"
    unfused.save(path)
    assert "attention: unfused" in path.read_text()
    assert Profile.load(path).attention == "unfused"
    with pytest.raises(ValueError, match="a profile of unfused attention cannot take entries "
                                         "estimated for flash attention"):
        unfused.merged_over(flash)
    path.write_text(path.read_text().replace("attention: unfused", "attention: fused"))
    with pytest.raises(ConfigError, match="field 'attention': got 'fused' "
                                          r"\(allowed: flash, unfused\)"):
        Profile.load(path)
