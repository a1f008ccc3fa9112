"""Process groups from a plan: roles, megatron globals, working sync groups, bad input first."""

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from helpers.dist_utils import run_on_ranks
from megatron_autohet.plan import RankInfo, Stage, load_plan

pytestmark = pytest.mark.integration

PLAN_FILE = Path(__file__).resolve().parents[2] / "configs" / "plans" / "tiny-two-pipelines.yaml"


def _inspect_state(rank, world):
    import torch.distributed as dist
    from megatron.core import parallel_state as mps
    from megatron_autohet.runtime.parallel_state import build_parallel_state

    plan = load_plan(PLAN_FILE)
    state = build_parallel_state(plan, rank, model=plan.model, plan_file=PLAN_FILE)

    def group_sum(group):                 # proves the group exists and has these members
        value = torch.tensor([float(rank + 1)])
        dist.all_reduce(value, group=group)
        return value.item()

    syncs = [(g.spec.kind, g.spec.layers, g.ranks, group_sum(g.group) if g.group else None)
             for g in state.sync_groups]
    pgc = state.pg_collection
    return {
        "tp": (state.tp_size, state.tp_rank, state.tp_group.size(), group_sum(state.tp_group)),
        "stage": (state.stage.pipeline, state.stage.stage, state.stage.layers,
                  state.is_first_stage, state.is_last_stage),
        "pp": (pgc.pp.rank(), pgc.pp.size(), pgc.pp.ranks),
        "pipeline_sum": group_sum(state.pipeline_group),
        "pgc": (pgc.tp is state.tp_group, pgc.embd, pgc.pos_embd, pgc.cp.size(),
                pgc.dp is state.dp_group, pgc.mp is state.pipeline_group),
        "megatron": (mps.get_tensor_model_parallel_world_size(),
                     mps.get_tensor_model_parallel_rank(),
                     mps.get_pipeline_model_parallel_world_size(),
                     mps.get_pipeline_model_parallel_rank(),
                     mps.is_pipeline_first_stage(), mps.is_pipeline_last_stage(),
                     mps.get_data_parallel_world_size(), mps.get_data_parallel_rank(),
                     mps.get_context_parallel_world_size(), mps.model_parallel_is_initialized(),
                     mps.get_tensor_model_parallel_group() is state.tp_group,
                     mps.get_pipeline_model_parallel_next_rank(),
                     mps.is_rank_in_embedding_group()),
        "sync": syncs,
    }


def test_tiny_two_pipelines_roles_groups_and_megatron_globals():
    out = run_on_ranks(4, _inspect_state, timeout=90)
    # pipeline 0: [ranks 0,1 TP2 layers 0-4 | rank 2 TP1 layers 4-6]; pipeline 1: [rank 3, 0-6]
    assert [o["tp"] for o in out] == [(2, 0, 2, 3.0), (2, 1, 2, 3.0), (1, 0, 1, 3.0),
                                      (1, 0, 1, 4.0)]
    assert [o["stage"] for o in out] == [(0, 0, (0, 4), True, False), (0, 0, (0, 4), True, False),
                                         (0, 1, (4, 6), False, True), (1, 0, (0, 6), True, True)]
    assert [o["pp"] for o in out] == [(0, 2, (0, 2)), (0, 2, (1, 2)), (1, 2, (0, 2)),
                                      (0, 1, (3,))]
    assert [o["pipeline_sum"] for o in out] == [6.0, 6.0, 6.0, 4.0]        # {0,1,2}, {3}
    for o in out:
        assert o["pgc"] == (True, None, None, 1, True, True)
    #        tp  tp_rank pp pp_rank first  last  dp dp_rank cp init  tp_is  next  in_embd
    assert [o["megatron"] for o in out] == [
        (2, 0, 2, 0, True, False, 2, 0, 1, True, True, 2, True),
        (2, 1, 2, 0, True, False, 2, 0, 1, True, True, 2, True),
        (1, 0, 2, 1, False, True, 2, 0, 1, True, True, 0, True),
        (1, 0, 1, 0, True, True, 2, 1, 1, True, True, 3, True)]
    # layers 0-4 held by TP2 {0,1} and TP1 {3}: asymmetric, one group of all holders (sum 1+2+4);
    # layers 4-6 held by {2} and {3}: symmetric, one group per TP rank (3+4); tied word
    # embeddings on every first and last stage; position embeddings on the first stages; final
    # norm on the last stages.
    expected = {
        0: [("layers", (0, 4), (0, 1, 3), 7.0), ("layers", (4, 6), None, None),
            ("word_embeddings", None, (0, 1, 2, 3), 10.0),
            ("position_embeddings", None, (0, 1, 3), 7.0), ("post_process", None, None, None)],
        2: [("layers", (0, 4), None, None), ("layers", (4, 6), (2, 3), 7.0),
            ("word_embeddings", None, (0, 1, 2, 3), 10.0),
            ("position_embeddings", None, None, None), ("post_process", None, (2, 3), 7.0)],
        3: [("layers", (0, 4), (0, 1, 3), 7.0), ("layers", (4, 6), (2, 3), 7.0),
            ("word_embeddings", None, (0, 1, 2, 3), 10.0),
            ("position_embeddings", None, (0, 1, 3), 7.0), ("post_process", None, (2, 3), 7.0)],
    }
    expected[1] = expected[0]
    for rank, o in enumerate(out):
        assert o["sync"] == expected[rank], rank


def _symmetric_sync(rank, world):
    """Two TP2 pipelines of different depth: one group per TP shard, as Megatron's DP groups."""
    from megatron_autohet.runtime.parallel_state import build_parallel_state
    plan = load_plan(PLAN_FILE)
    plan.ranks = [RankInfo(r, "a100", r, "A100-80GB") for r in range(4)]
    plan.pipelines[0].stages = [Stage([0, 1], (0, 6))]
    plan.pipelines[1].stages = [Stage([2, 3], (0, 6))]
    state = build_parallel_state(plan, rank)
    return [(g.spec.kind, g.ranks) for g in state.sync_groups]


def test_symmetric_plan_has_one_sync_group_per_tp_shard():
    out = run_on_ranks(4, _symmetric_sync, timeout=90)
    assert out[0] == out[2] == [("layers", (0, 2)), ("word_embeddings", (0, 2)),
                                ("position_embeddings", (0, 2)), ("post_process", (0, 2))]
    assert out[1] == out[3] == [("layers", (1, 3)), ("word_embeddings", (1, 3)),
                                ("position_embeddings", (1, 3)), ("post_process", (1, 3))]


def _bad_input(rank, world, case):
    import torch.distributed.distributed_c10d as c10d
    from megatron_autohet.errors import ConfigError
    from megatron_autohet.runtime.parallel_state import build_parallel_state
    plan = load_plan(PLAN_FILE)
    model = None
    if case == "tp":
        plan.ranks = [RankInfo(r, "a100", r, "A100-80GB") for r in range(4)]
        plan.pipelines[0].stages = [Stage([0, 1, 2], (0, 4)), Stage([3], (4, 6))]
        plan.pipelines[0].num_microbatches = 4
        plan.pipelines = plan.pipelines[:1]
    elif case == "model":
        model = replace(plan.model, hidden_size=128)
    elif case == "no_role":
        plan.pipelines = plan.pipelines[:1]
        plan.global_batch_size = 6
    groups_before = len(c10d._world.pg_map)
    try:
        build_parallel_state(plan, rank, model=model, plan_file="plan.yaml")
    except ConfigError as exc:
        return str(exc), len(c10d._world.pg_map) - groups_before
    return None, len(c10d._world.pg_map) - groups_before


@pytest.mark.parametrize("case, message", [
    ("world", "field 'ranks': the plan has 4 ranks but the job has world size 1"),
    ("tp", "TP degree 3 does not divide the model's num_attention_heads (4)"),
    ("model", "field 'model.hidden_size': the plan was made for hidden_size=64"),
    ("no_role", "field 'pipelines': ranks [3] have no stage"),
])
def test_bad_input_is_a_config_error_before_any_group(case, message):
    error, new_groups = run_on_ranks(1, _bad_input, case, timeout=60)[0]
    assert error is not None and error.startswith("plan.yaml: ")
    assert message in error
    assert new_groups == 0
