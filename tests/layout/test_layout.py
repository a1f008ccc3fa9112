"""layout/: main replicas (owners) on the proof plans, and the package's torch-free import.

The owner checks do not trust owners.holders: which ranks hold a parameter is derived here from
each rank's role (its stage's layers, first/last stage), and every rank of the plan is asked
whether its copy is the main one.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_autohet.layout.owners import holders, is_main_replica, main_holder
from megatron_autohet.layout.params import ParamLayout, global_param_name
from megatron_autohet.layout.topology import rank_role
from megatron_autohet.plan import Plan, load_plan

PLANS = Path(__file__).resolve().parents[2] / "configs" / "plans"
WORD = "embedding.word_embeddings.weight"
POSITION = "embedding.position_embeddings.weight"
QKV = "decoder.layers.{}.self_attention.linear_qkv.weight"       # TP-sharded, dim 0
NORM = "decoder.layers.{}.input_layernorm.weight"                # TP-replicated


def untied_rope(plan: Plan) -> Plan:
    """The plan with an untied output layer and no position embedding parameter."""
    model = dataclasses.replace(plan.model, tie_embeddings=False, position_embedding_type="rope")
    return dataclasses.replace(plan, model=model)


def plan_cases() -> list:
    cases = [pytest.param(load_plan(PLANS / f"tiny-{name}.yaml"), id=name)
             for name in ("two-pipelines", "three-pipelines", "tp-change", "homogeneous")]
    cases.append(pytest.param(untied_rope(load_plan(PLANS / "tiny-tp-change.yaml")),
                              id="tp-change-untied-rope"))
    return cases


def model_params(plan: Plan) -> list[tuple[str, int | None]]:
    """(global name, partition dim) of the parameters checked: two per layer, plus the
    embedding, position embedding, final layernorm and output layer where the model has them."""
    params = []
    for layer in range(plan.model.num_layers):
        params += [(QKV.format(layer), 0), (NORM.format(layer), None)]
    params += [(WORD, 0), ("decoder.final_layernorm.weight", None)]
    if plan.model.position_embedding_type == "learned_absolute":
        params.append((POSITION, None))
    if not plan.model.tie_embeddings:
        params.append(("output_layer.weight", 0))
    return params


def rank_holds(plan: Plan, rank: int, global_name: str) -> bool:
    stage = rank_role(plan, rank).stage
    if global_name.startswith("decoder.layers."):
        return stage.layers[0] <= int(global_name.split(".")[2]) < stage.layers[1]
    if global_name == WORD:
        return stage.is_first or (plan.model.tie_embeddings and stage.is_last)
    if global_name == POSITION:
        return stage.is_first
    return stage.is_last                   # final layernorm, untied output layer


def rank_layout(plan: Plan, rank: int, global_name: str, partition_dim: int | None):
    role = rank_role(plan, rank)
    return ParamLayout(global_name, (8, 4), partition_dim, role.tp_rank, role.stage.tp_size)


@pytest.mark.unit
@pytest.mark.parametrize("plan", plan_cases())
def test_one_main_replica_per_chunk_on_a_holder(plan):
    for name, partition_dim in model_params(plan):
        main = [rank for rank in range(plan.world_size)
                if is_main_replica(plan, rank, rank_layout(plan, rank, name, partition_dim))]
        assert main, name
        assert all(rank_holds(plan, rank, name) for rank in main), (name, main)
        if partition_dim is None:
            assert len(main) == 1, (name, main)
        else:                              # one shard per TP rank of one holder TP group
            group = rank_role(plan, main[0]).stage.ranks
            assert sorted(main) == sorted(group), (name, main)
        assert rank_role(plan, main[0]).stage.ranks == main_holder(plan, name)


@pytest.mark.unit
def test_main_holders_of_tiny_tp_change():
    # pipeline 0: [0, 1] layers 0-2 | [2] layers 2-4 | [3, 4] layers 4-6; pipeline 1: [5] 0-6
    plan = load_plan(PLANS / "tiny-tp-change.yaml")
    assert holders(plan, QKV.format(1)) == ((0, 1), (5,))
    assert main_holder(plan, QKV.format(3)) == (2,)
    assert main_holder(plan, NORM.format(5)) == (3, 4)
    assert holders(plan, WORD) == ((0, 1), (5,), (3, 4))      # first stages, then last stages
    assert main_holder(plan, WORD) == (0, 1)
    assert holders(plan, POSITION) == ((0, 1), (5,))
    assert holders(plan, "decoder.final_layernorm.bias") == ((3, 4), (5,))
    assert [is_main_replica(plan, r, rank_layout(plan, r, NORM.format(5), None))
            for r in (3, 4, 5)] == [True, False, False]
    assert [is_main_replica(plan, r, rank_layout(plan, r, QKV.format(5), 0))
            for r in (3, 4, 5)] == [True, True, False]
    assert [is_main_replica(plan, r, rank_layout(plan, r, WORD, 0))
            for r in range(6)] == [True, True, False, False, False, False]


@pytest.mark.unit
def test_main_holders_of_tiny_three_pipelines():
    # pipelines: [0] 0-2 | [1] 2-6;  [2] 0-6;  [3] 0-4 | [4] 4-6
    plan = load_plan(PLANS / "tiny-three-pipelines.yaml")
    assert holders(plan, QKV.format(3)) == ((1,), (2,), (3,))
    assert holders(plan, QKV.format(5)) == ((1,), (2,), (4,))
    assert holders(plan, WORD) == ((0,), (2,), (3,), (1,), (4,))
    assert main_holder(plan, "decoder.final_layernorm.weight") == (1,)


@pytest.mark.unit
def test_untied_output_layer_is_owned_by_the_last_stage_of_pipeline_0():
    plan = untied_rope(load_plan(PLANS / "tiny-tp-change.yaml"))
    assert holders(plan, WORD) == ((0, 1), (5,))
    assert holders(plan, "output_layer.weight") == ((3, 4), (5,))


@pytest.mark.unit
@pytest.mark.parametrize("name", ["decoder.layers.6.input_layernorm.weight",
                                  "embedding.token_types.weight", "final_layernorm.weight"])
def test_unknown_parameter_name_is_a_value_error(name):
    plan = load_plan(PLANS / "tiny-two-pipelines.yaml")
    with pytest.raises(ValueError, match=f"'{name}'"):
        holders(plan, name)


@pytest.mark.unit
def test_position_embedding_of_a_rope_model_is_unknown():
    plan = untied_rope(load_plan(PLANS / "tiny-two-pipelines.yaml"))
    with pytest.raises(ValueError, match=f"'{POSITION}'"):
        main_holder(plan, POSITION)


@pytest.mark.unit
def test_global_param_name():
    assert global_param_name("decoder.layers.1.mlp.linear_fc1.weight", 4, tied=True) == \
        "decoder.layers.5.mlp.linear_fc1.weight"
    assert global_param_name("output_layer.weight", 4, tied=True) == WORD
    assert global_param_name("output_layer.weight", 4, tied=False) == "output_layer.weight"
    assert global_param_name("decoder.final_layernorm.weight", 4, tied=True) == \
        "decoder.final_layernorm.weight"


@pytest.mark.integration
def test_layout_and_cost_model_import_without_torch():
    code = ("import megatron_autohet.layout.topology, megatron_autohet.layout.params, "
            "megatron_autohet.layout.owners, megatron_autohet.cost_model, "
            "megatron_autohet.data.batches; import sys; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
