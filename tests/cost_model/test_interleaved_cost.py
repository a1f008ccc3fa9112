"""The cost model's price of an interleaved pipeline (a pipeline's ``virtual_stages``).

A hand plan on one node of three A100s (8 KB/s links, so a transfer's seconds show next to the
profile's 3 s layer): pipeline 0 is two stages of 4 layers each, plain or with 2 chunks per
stage, pipeline 1 one stage of all 8 layers.
"""

from __future__ import annotations

import math

import pytest

from megatron_autohet.cost_model import evaluate_plan, p2p_s
from megatron_autohet.plan import Pipeline, Plan, RankInfo, Stage
from megatron_autohet.profiling.estimate import layer_param_count
from megatron_autohet.profiling.profile import OpCost, Profile, ProfileEntry
from megatron_autohet.spec.cluster import cluster_from_dict
from megatron_autohet.spec.model import ModelSpec

pytestmark = pytest.mark.unit

MODEL = ModelSpec("hand", num_layers=8, hidden_size=64, num_attention_heads=4,
                  ffn_hidden_size=256, vocab_size=512, seq_length=32, num_query_groups=4)
LINK = 0.008192
CLUSTER = cluster_from_dict({"name": "hand", "inter_node_bandwidth_gbs": LINK, "nodes": [
    {"name": "a", "gpu": "A100-80GB", "gpus": 3, "intra_node_bandwidth_gbs": LINK}]})
M = 4


def _profile() -> Profile:
    profile = Profile("hand")
    profile.add(ProfileEntry("A100-80GB", 1, 1, 32,
                             layer=OpCost(1.0, 2.0, 10, 1, layer_param_count(MODEL, 1)),
                             embedding=OpCost(0.0, 0.0, 5, 5, 0), output=OpCost(0.0, 0.0, 7, 7, 0)))
    return profile


def _plan(interleaved: bool) -> Plan:
    ranks = [RankInfo(r, "a", r, "A100-80GB") for r in range(3)]
    stages = ([Stage([0], (0, 2), virtual_layers=((4, 6),)),
               Stage([1], (2, 4), virtual_layers=((6, 8),))] if interleaved
              else [Stage([0], (0, 4)), Stage([1], (4, 8))])
    return Plan("hand", MODEL, 1, M + 1, 32, ranks, [
        Pipeline(stages, num_microbatches=M, virtual_stages=2 if interleaved else 1),
        Pipeline([Stage([2], (0, 8))], num_microbatches=1)]).validate()


def test_interleaving_shortens_the_fill_and_multiplies_the_transfers():
    plain, interleaved = (evaluate_plan(_plan(i), CLUSTER, _profile()) for i in (False, True))
    t = 4 * 3.0                                    # a stage's 4 layers, forward + backward
    c = p2p_s(MODEL, 1, 32, LINK, _profile().precision)
    # compute counts every chunk's layers
    assert [s.time_s for s in interleaved.pipelines[0].stages] == [t, t]
    assert plain.pipelines[0].time_s == pytest.approx(2 * t + c + (M - 1) * (t + c))
    # per pass t / 2 and a transfer, the last stage's round to the first: 2 M passes
    assert interleaved.pipelines[0].time_s == pytest.approx(
        2 * (t / 2 + c) + (2 * M - 1) * (t / 2 + c))
    assert interleaved.pipelines[0].stages[1].p2p_s == pytest.approx(c)   # the ring closes
    assert interleaved.pipelines[0].time_s < plain.pipelines[0].time_s


def test_interleaved_stages_hold_megatrons_warmup_of_activations():
    """Stage s holds ceil((2 (S - s - 1) + (v - 1) S + 1) / v) micro-batches of its layers:
    S = 2, v = 2: 5/2 -> 3 on the first stage, 3/2 -> 2 on the last (plain: 2 and 1)."""
    plain, interleaved = (evaluate_plan(_plan(i), CLUSTER, _profile()) for i in (False, True))
    assert [s.in_flight_microbatches for s in plain.pipelines[0].stages] == [2, 1]
    assert [s.in_flight_microbatches for s in interleaved.pipelines[0].stages] == [
        math.ceil(5 / 2), math.ceil(3 / 2)]
    assert all(s.memory_gib > p.memory_gib for s, p in zip(interleaved.pipelines[0].stages,
                                                           plain.pipelines[0].stages))


def test_a_pass_of_unequal_chunks_is_priced_at_the_stages_largest():
    """Chunks of 3 and 1 layers on each stage: every pass is priced at 3/4 of the stage's
    compute, not at half of it."""
    plan = _plan(True)
    plan.pipelines[0].stages[0] = Stage([0], (0, 3), virtual_layers=((4, 5),))
    plan.pipelines[0].stages[1] = Stage([1], (3, 4), virtual_layers=((5, 8),))
    cost = evaluate_plan(plan.validate(), CLUSTER, _profile())
    t, c = 4 * 3.0, p2p_s(MODEL, 1, 32, LINK, _profile().precision)
    assert cost.pipelines[0].time_s == pytest.approx(
        2 * (t * 3 / 4 + c) + (2 * M - 1) * (t * 3 / 4 + c))
