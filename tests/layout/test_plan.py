"""Plan validation (the contract with the runtime): each broken invariant gives its exact error.

Every case starts from the bundled hand-written plan (configs/plans/tiny-two-pipelines.yaml:
4 ranks, pipelines [TP2 | TP1] and [TP1], 6 layers, 3 + 1 micro-batches of 2) and breaks one thing.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from megatron_autohet.errors import ConfigError
from megatron_autohet.plan import Plan, load_plan, plan_from_dict

pytestmark = pytest.mark.unit

EXAMPLE = Path(__file__).resolve().parents[2] / "configs" / "plans" / "tiny-two-pipelines.yaml"


@pytest.fixture()
def raw() -> dict:
    return yaml.safe_load(EXAMPLE.read_text())


def expect_error(data: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        plan_from_dict(data, "plan.yaml")
    assert str(info.value) == f"plan.yaml: {message}"


def test_example_plan_loads():
    plan = load_plan(EXAMPLE)
    assert plan.world_size == 4
    assert [[s.tp for s in p.stages] for p in plan.pipelines] == [[2, 1], [1]]
    assert plan.num_microbatches_total == 4


@pytest.mark.parametrize("value, got", [(1.5, "got 1.5 (allowed: a fraction of GPU memory in "
                                                "[0, 1))"),
                                        (-0.1, "got -0.1 (allowed: a number >= 0.0)"),
                                        ("lots", "got 'lots' (str) (allowed: a number)")])
def test_bad_recorded_memory_headroom(raw, value, got):
    raw["predicted"] = {"memory_headroom": value}
    expect_error(raw, f"field 'predicted.memory_headroom': {got}")


def test_round_trip_save_load(tmp_path):
    plan = load_plan(EXAMPLE)
    assert "objective" not in plan.to_dict() and "min_tokens_per_s" not in plan.to_dict()
    plan.pipelines[0].stages[0].predicted_time_s = 0.0125
    plan.pipelines[0].stages[0].predicted_memory_gib = 3.5
    plan.pipelines[0].stages[1].warmup_microbatches = 0
    plan.predicted = {"iteration_time_s": 0.25, "tokens_per_s": 2048.0}
    plan.objective, plan.min_tokens_per_s = "cost", 1500.0
    out = tmp_path / "plan.yaml"
    plan.save(out)
    again = load_plan(out)
    assert again == plan
    assert again.to_dict() == plan.to_dict()
    assert (again.objective, again.min_tokens_per_s) == ("cost", 1500.0)
    assert not (tmp_path / "plan.yaml.tmp").exists()       # written atomically


@pytest.mark.parametrize("fields, error", [
    ({"objective": "fastest"}, "field 'objective': got 'fastest' (allowed: throughput, cost)"),
    ({"min_tokens_per_s": 100}, "field 'min_tokens_per_s': got 100.0 with objective throughput "
                                "(allowed: a number > 0, with objective cost)"),
    ({"objective": "cost", "min_tokens_per_s": 0}, "field 'min_tokens_per_s': got 0.0 with "
     "objective cost (allowed: a number > 0, with objective cost)")])
def test_bad_recorded_objective(raw, fields, error):
    raw.update(fields)
    expect_error(raw, error)


# ---- every rank used exactly once -----------------------------------------------------------

def test_rank_used_twice(raw):
    raw["pipelines"][1]["stages"][0]["ranks"] = [2]
    expect_error(raw, "field 'pipelines[1].stages[0].ranks': rank 2 is already used by "
                      "pipelines[0].stages[1] (allowed: each rank in exactly one stage)")


def test_rank_unused(raw):
    raw["pipelines"][0]["stages"][0]["ranks"] = [0]
    expect_error(raw, "field 'pipelines': ranks [1] have no stage "
                      "(allowed: every rank in exactly one stage)")


def test_rank_out_of_range(raw):
    raw["pipelines"][1]["stages"][0]["ranks"] = [4]
    expect_error(raw, "field 'pipelines[1].stages[0].ranks': rank 4 out of range (allowed: 0..3)")


def test_ranks_listed_out_of_order(raw):
    raw["ranks"][0]["rank"], raw["ranks"][1]["rank"] = 1, 0
    expect_error(raw, "field 'ranks[0].rank': got 1 (allowed: 0 (entries are listed in rank "
                      "order 0..3))")


def test_same_gpu_twice(raw):
    raw["ranks"][1]["local_rank"] = 0
    expect_error(raw, "field 'ranks[1]': node a100 GPU 0 is already rank 0 "
                      "(allowed: each physical GPU once)")


def test_stage_ranks_not_integers(raw):
    raw["pipelines"][0]["stages"][1]["ranks"] = ["2"]
    expect_error(raw, "field 'pipelines[0].stages[1].ranks': got ['2'] "
                      "(allowed: a non-empty list of global ranks)")


# ---- layer ranges cover the model in order in every pipeline --------------------------------

def test_layer_gap(raw):
    raw["pipelines"][0]["stages"][1]["layers"] = [5, 6]
    expect_error(raw, "field 'pipelines[0].stages[1].layers': got [5, 6) after layer 4 "
                      "(allowed: [4, e) with e > 4: stages cover the model's layers in order)")


def test_layer_overlap(raw):
    raw["pipelines"][0]["stages"][1]["layers"] = [3, 6]
    expect_error(raw, "field 'pipelines[0].stages[1].layers': got [3, 6) after layer 4 "
                      "(allowed: [4, e) with e > 4: stages cover the model's layers in order)")


def test_empty_stage(raw):
    raw["pipelines"][0]["stages"][0]["layers"] = [0, 0]
    expect_error(raw, "field 'pipelines[0].stages[0].layers': got [0, 0) after layer 0 "
                      "(allowed: [0, e) with e > 0: stages cover the model's layers in order)")


def test_layers_stop_short(raw):
    raw["pipelines"][1]["stages"][0]["layers"] = [0, 5]
    expect_error(raw, "field 'pipelines[1].stages': layers end at 5 "
                      "(allowed: the last stage ends at num_layers = 6)")


def test_layers_not_integers(raw):
    raw["pipelines"][1]["stages"][0]["layers"] = [False, 6]
    expect_error(raw, "field 'pipelines[1].stages[0].layers': got [False, 6] "
                      "(allowed: [start, end): two integers, end exclusive)")


def test_sequence_longer_than_learned_positions(raw):
    raw["seq_length"] = 128
    expect_error(raw, "field 'seq_length': 128 > the model's seq_length 64 (learned position "
                      "embeddings) (allowed: at most 64, or a model with rope positions)")
    raw["model"]["position_embedding_type"] = "rope"
    assert plan_from_dict(raw, "plan.yaml").seq_length == 128


def test_layers_malformed(raw):
    raw["pipelines"][1]["stages"][0]["layers"] = [0, 3, 6]
    expect_error(raw, "field 'pipelines[1].stages[0].layers': got [0, 3, 6] "
                      "(allowed: [start, end): two integers, end exclusive)")


# ---- micro-batches sum to the global batch --------------------------------------------------

def test_microbatches_do_not_sum_to_global_batch(raw):
    raw["pipelines"][1]["num_microbatches"] = 2
    expect_error(raw, "field 'global_batch_size': 8 != micro_batch_size 2 x 5 micro-batches "
                      "(allowed: 10)")


def test_zero_microbatches(raw):
    raw["pipelines"][1]["num_microbatches"] = 0
    expect_error(raw, "field 'pipelines[1].num_microbatches': got 0 (allowed: a number > 0)")


def test_warmup_deeper_than_microbatches(raw):
    raw["pipelines"][1]["stages"][0]["warmup_microbatches"] = 2
    expect_error(raw, "field 'pipelines[1].stages[0].warmup_microbatches': 2 > the pipeline's "
                      "1 micro-batches (allowed: 0..1)")


# ---- TP groups: inside one node, one GPU type, dividing the model ---------------------------

def test_tp_group_spans_nodes(raw):
    raw["pipelines"][0]["stages"] = [{"ranks": [0]}, {"ranks": [1, 2]}]
    raw["pipelines"][0]["stages"][0]["layers"] = [0, 4]
    raw["pipelines"][0]["stages"][1]["layers"] = [4, 6]
    expect_error(raw, "field 'pipelines[0].stages[1].ranks': TP group spans nodes "
                      "['a100', 'h800'] (allowed: ranks of one node)")


def test_tp_group_mixes_gpu_types(raw):
    raw["ranks"][1]["gpu"] = "H800"
    expect_error(raw, "field 'pipelines[0].stages[0].ranks': TP group mixes GPU types "
                      "['A100-80GB', 'H800'] (allowed: ranks of one GPU type)")


def test_tp_does_not_divide_heads(raw):
    # 3 GPUs on one node as one TP group: 3 does not divide the 4 attention heads.
    raw["ranks"][2] = {"rank": 2, "node": "a100", "local_rank": 2, "gpu": "A100-80GB"}
    raw["pipelines"] = [{"num_microbatches": 3, "stages": [{"ranks": [0, 1, 2], "layers": [0, 6]}]},
                        {"num_microbatches": 1, "stages": [{"ranks": [3], "layers": [0, 6]}]}]
    expect_error(raw, "field 'pipelines[0].stages[0].ranks': TP degree 3 does not divide the "
                      "model's num_attention_heads (4) (allowed: a TP degree in [1, 2, 4])")


# ---- the model and the file itself ----------------------------------------------------------

def test_bad_embedded_model(raw):
    raw["model"]["num_attention_heads"] = 5
    expect_error(raw, "field 'model.num_attention_heads': 5 does not divide hidden_size 64 "
                      "(allowed: a divisor of hidden_size)")


def test_wrong_format_version(raw):
    raw["format_version"] = 2
    expect_error(raw, "field 'format_version': got 2 (allowed: 1)")


def test_unknown_stage_field(raw):
    raw["pipelines"][0]["stages"][0]["tp"] = 2
    expect_error(raw, "field 'pipelines[0].stages[0].tp': unknown field (allowed: layers, "
                      "predicted_memory_gib, predicted_time_s, ranks, warmup_microbatches)")


def test_no_pipelines(raw):
    raw["pipelines"] = []
    expect_error(raw, "field 'pipelines': empty (allowed: at least one pipeline)")


def test_missing_plan_file(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_plan(tmp_path / "none.yaml")
    assert info.value.field == "<file>" and info.value.problem == "file not found"


def test_validate_catches_edits_in_memory(raw):
    plan: Plan = plan_from_dict(copy.deepcopy(raw), "plan.yaml")
    plan.pipelines[0].num_microbatches = 4
    with pytest.raises(ConfigError, match="global_batch_size"):
        plan.validate()


# ---- 1F1B warm-up depths the runtime can run ------------------------------------------------

def test_warmup_on_last_stage(raw):
    raw["pipelines"][0]["stages"][1]["warmup_microbatches"] = 1
    expect_error(raw, "field 'pipelines[0].stages[1].warmup_microbatches': 1 on the last stage "
                      "(allowed: 0: the last stage runs each backward right after its forward)")


def test_no_warmup_before_the_last_stage(raw):
    raw["pipelines"][0]["stages"][0]["warmup_microbatches"] = 0
    expect_error(raw, "field 'pipelines[0].stages[0].warmup_microbatches': 0 on a stage before "
                      "the last (allowed: 1..3)")


def test_warmup_increasing_along_the_pipeline(raw):
    raw["pipelines"][0] = {"num_microbatches": 3, "stages": [
        {"ranks": [0], "layers": [0, 2], "warmup_microbatches": 1},
        {"ranks": [1], "layers": [2, 4], "warmup_microbatches": 2},
        {"ranks": [2], "layers": [4, 6]}]}
    expect_error(raw, "field 'pipelines[0].stages[1].warmup_microbatches': 2 > 1 of stage 0 "
                      "(allowed: <= 1: warm-up depths must not increase along the pipeline "
                      "(a deeper stage after a shallower one deadlocks 1F1B))")


def test_deeper_warmup_ahead_of_a_slow_link_is_valid(raw):
    raw["pipelines"][0] = {"num_microbatches": 3, "stages": [
        {"ranks": [0], "layers": [0, 2], "warmup_microbatches": 3},
        {"ranks": [1], "layers": [2, 4], "warmup_microbatches": 1},
        {"ranks": [2], "layers": [4, 6]}]}
    plan = plan_from_dict(raw, "plan.yaml")
    assert plan.pipelines[0].warmup_depths() == [3, 1, 0]
