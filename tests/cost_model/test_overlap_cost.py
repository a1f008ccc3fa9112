"""The cost model's price of an overlapped gradient sync (a plan's ``overlap_grad_reduce``).

The hand plan of test_cost_model.py: pipeline 0 is [layers 0-2 on A100 0 | layers 2-4 on A100 1],
pipeline 1 one H800 with all four layers; every sync group crosses the 1.6 MB/s NIC, so each
collective's seconds are visible next to the profile's 2 s layer backward.
"""

from __future__ import annotations

import pytest

from megatron_autohet.cost_model import evaluate_plan, overlapped_sync_s
from megatron_autohet.plan import Pipeline, Plan, RankInfo, Stage, plan_from_dict
from megatron_autohet.profiling.estimate import ring_allreduce_s
from megatron_autohet.profiling.profile import OpCost, Profile, ProfileEntry
from megatron_autohet.spec.cluster import cluster_from_dict
from megatron_autohet.spec.model import ModelSpec
from megatron_autohet.profiling.estimate import layer_param_count

pytestmark = pytest.mark.unit

MODEL = ModelSpec("hand", num_layers=4, hidden_size=64, num_attention_heads=4,
                  ffn_hidden_size=256, vocab_size=512, seq_length=32, num_query_groups=4)
NIC = 0.0016
CLUSTER = cluster_from_dict({"name": "hand", "inter_node_bandwidth_gbs": NIC, "nodes": [
    {"name": "a", "gpu": "A100-80GB", "gpus": 2, "intra_node_bandwidth_gbs": 0.008192},
    {"name": "b", "gpu": "H800", "gpus": 1, "intra_node_bandwidth_gbs": 0.008192}]})
WORD, POS, NORM = 512 * 64, 32 * 64, 2 * 64
LAYER = layer_param_count(MODEL, 1)


def _profile() -> Profile:
    profile = Profile("hand")
    for gpu in ("A100-80GB", "H800"):
        profile.add(ProfileEntry(gpu, 1, 1, 32, layer=OpCost(1.0, 2.0, 10, 1, LAYER),
                                 embedding=OpCost(0.5, 0.5, 5, 5, WORD + POS),
                                 output=OpCost(1.0, 1.0, 7, 7, WORD + NORM)))
    return profile


def _plan(**options) -> Plan:
    ranks = [RankInfo(0, "a", 0, "A100-80GB"), RankInfo(1, "a", 1, "A100-80GB"),
             RankInfo(2, "b", 0, "H800")]
    return Plan("hand", MODEL, 1, 4, 32, ranks, [
        Pipeline([Stage([0], (0, 2)), Stage([1], (2, 4))], num_microbatches=3),
        Pipeline([Stage([2], (0, 4))], num_microbatches=1)], **options).validate()


def _all_reduce(params, holders):
    return ring_allreduce_s(params * 4, holders, NIC)


def test_a_collective_is_charged_what_the_backward_after_it_cannot_hide():
    # ready at 0.2 s and 0.5 s of a 1 s backward, 0.5 s each: the second starts when the first
    # ends (0.7 s) and ends 0.2 s after the backward; the after-step part is always charged
    assert overlapped_sync_s(1.0, [(0.2, 0.5, 0.0), (0.5, 0.5, 0.0)]) == pytest.approx(0.2)
    assert overlapped_sync_s(1.0, [(0.0, 0.3, 0.1), (0.5, 0.2, 0.1)]) == pytest.approx(0.2)
    assert overlapped_sync_s(1.0, [(1.0, 0.4, 0.0)]) == pytest.approx(0.4)   # at the end
    assert overlapped_sync_s(1.0, []) == 0.0


def test_overlap_by_hand():
    """The H800 (backward 4 x 2 + 0.5 + 1 = 9.5 s) launches the final norm at once and layers
    2-4 after 4.75 s (both hidden), then layers 0-2, the position and the word embeddings at the
    backward's end; A100 0's groups are all ready at its end (its first layer is layer 0), A100
    1 hides only the final norm (layers 2-4 start at its first layer). The busiest GPU is A100 0,
    with what the H800 leaves too."""
    plain = evaluate_plan(_plan(), CLUSTER, _profile())
    cost = evaluate_plan(_plan(overlap_grad_reduce=True), CLUSTER, _profile())
    layers, pos, word, norm = (_all_reduce(2 * LAYER, 2), _all_reduce(POS, 2),
                               _all_reduce(WORD, 3), _all_reduce(NORM, 2))
    s0, s1 = cost.pipelines[0].stages
    only = cost.pipelines[1].stages[0]
    assert only.backward_s == 9.5 and layers + norm < 4.75
    assert s0.sync_s == pytest.approx(layers + pos + word)
    assert s1.sync_s == pytest.approx(layers + word)
    assert only.sync_s == pytest.approx(layers + pos + word)
    assert plain.grad_sync_s == pytest.approx(2 * layers + pos + word + norm)
    assert cost.grad_sync_s == pytest.approx(layers + pos + word)
    assert cost.iteration_time_s == pytest.approx(plain.iteration_time_s - layers - norm)


def test_distributed_optimizer_hides_only_the_reduce_scatter():
    """The weights' all-gather after the step is charged whole: the H800 hides the
    reduce-scatters of the final norm and layers 2-4 and pays all five all-gathers."""
    cost = evaluate_plan(_plan(use_distributed_optimizer=True, overlap_grad_reduce=True),
                         CLUSTER, _profile())
    bf16 = 2            # the hand profile's precision (the estimates' default) prices bf16 weights

    def gather(params, holders):
        return ring_allreduce_s(params * bf16, holders, NIC) / 2

    def scatter(params, holders):
        return _all_reduce(params, holders) / 2

    only = cost.pipelines[1].stages[0]
    assert only.sync_s == pytest.approx(
        scatter(2 * LAYER, 2) + scatter(POS, 2) + scatter(WORD, 3)
        + 2 * gather(2 * LAYER, 2) + gather(POS, 2) + gather(WORD, 3) + gather(NORM, 2))


def test_plan_file_keeps_the_option_and_old_plans_their_form():
    plan = _plan(overlap_grad_reduce=True)
    data = plan.to_dict()
    assert data["overlap_grad_reduce"] is True
    assert plan_from_dict(data).overlap_grad_reduce
    assert "overlap_grad_reduce" not in _plan().to_dict()
