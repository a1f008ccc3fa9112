"""Plan format of interleaved pipelines (``virtual_stages``): what loads, what is refused, in one
line naming the field.

Cases start from the bundled hand-written plan (configs/plans/tiny-two-pipelines.yaml: pipelines
[TP2 | TP1] over 6 layers with 3 micro-batches, and [TP1] with 1) with its first pipeline made
interleaved: 2 chunks per stage, 4 micro-batches.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from megatron_autohet.errors import ConfigError
from megatron_autohet.plan import load_plan, plan_from_dict

pytestmark = pytest.mark.unit

EXAMPLE = Path(__file__).resolve().parents[2] / "configs" / "plans" / "tiny-two-pipelines.yaml"


@pytest.fixture()
def raw() -> dict:
    data = yaml.safe_load(EXAMPLE.read_text())
    first = data["pipelines"][0]
    first["virtual_stages"] = 2
    first["num_microbatches"] = 4
    first["stages"][0]["layers"] = [[0, 2], [3, 5]]
    first["stages"][1]["layers"] = [[2, 3], [5, 6]]
    data["global_batch_size"] = 10
    return data


def expect_error(data: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        plan_from_dict(data, "plan.yaml")
    assert str(info.value) == f"plan.yaml: {message}"


def test_interleaved_pipeline_loads_beside_a_plain_one(raw, tmp_path):
    plan = plan_from_dict(raw, "plan.yaml")
    first, second = plan.pipelines
    assert (first.virtual_stages, second.virtual_stages) == (2, 1)
    assert [s.chunks for s in first.stages] == [((0, 2), (3, 5)), ((2, 3), (5, 6))]
    assert first.virtual_stage_layers() == [(0, 2), (2, 3), (3, 5), (5, 6)]
    assert [s.num_layers for s in first.stages] == [4, 2]
    assert second.stages[0].chunks == ((0, 6),)
    plan.save(tmp_path / "plan.yaml")
    again = load_plan(tmp_path / "plan.yaml")
    assert again == plan
    assert again.to_dict()["pipelines"][0]["stages"][0]["layers"] == [[0, 2], [3, 5]]
    assert "virtual_stages" not in again.to_dict()["pipelines"][1]    # old form for plain ones


def test_plain_plan_file_form_unchanged():
    plan = load_plan(EXAMPLE)
    assert all(p.virtual_stages == 1 and not p.interleaved for p in plan.pipelines)
    assert plan.to_dict()["pipelines"][0] == yaml.safe_load(EXAMPLE.read_text())["pipelines"][0]


def test_chunk_count_must_match(raw):
    raw["pipelines"][0]["stages"][1]["layers"] = [2, 3]
    expect_error(raw, "field 'pipelines[0].stages[1].layers': got [2, 3] in a pipeline of "
                 "virtual_stages 2 (allowed: 2 [start, end) pairs, one per model chunk: "
                 "[[s0, e0], [s1, e1], ...])")


def test_chunks_in_a_plain_pipeline(raw):
    del raw["pipelines"][0]["virtual_stages"]
    expect_error(raw, "field 'pipelines[0].stages[0].layers': got [[0, 2], [3, 5]] (allowed: "
                 "[start, end): two integers, end exclusive)")


def test_chunks_out_of_model_order(raw):
    # stage-major order (the first stage's chunks contiguous) is not megatron's layout order
    raw["pipelines"][0]["stages"][0]["layers"] = [[0, 2], [2, 4]]
    raw["pipelines"][0]["stages"][1]["layers"] = [[4, 5], [5, 6]]
    expect_error(raw, "field 'pipelines[0].stages[1].layers[0]': got [4, 5) after layer 2 "
                 "(allowed: [2, e) with e > 2: virtual stages (chunk c of stage s is c * stages "
                 "+ s) cover the model's layers in order)")


def test_empty_chunk(raw):
    raw["pipelines"][0]["stages"][1]["layers"] = [[2, 3], [5, 5]]
    expect_error(raw, "field 'pipelines[0].stages[1].layers[1]': got [5, 5) after layer 5 "
                 "(allowed: [5, e) with e > 5: virtual stages (chunk c of stage s is c * stages "
                 "+ s) cover the model's layers in order)")


def test_microbatches_not_in_whole_groups(raw):
    raw["pipelines"][0]["num_microbatches"] = 3
    raw["global_batch_size"] = 8
    expect_error(raw, "field 'pipelines[0].num_microbatches': 3 with virtual_stages 2 over 2 "
                 "stages (allowed: a multiple of 2: megatron's interleaved schedule runs "
                 "micro-batches in groups of the pipeline's 2 stages)")


def test_one_stage_pipeline(raw):
    raw["pipelines"][1]["virtual_stages"] = 2
    raw["pipelines"][1]["stages"][0]["layers"] = [[0, 3], [3, 6]]
    expect_error(raw, "field 'pipelines[1].virtual_stages': 2 on a pipeline of 1 stage "
                 "(allowed: 1: megatron's interleaved schedule needs at least 2 stages)")


def test_own_warmup_refused(raw):
    raw["pipelines"][0]["stages"][0]["warmup_microbatches"] = 1
    expect_error(raw, "field 'pipelines[0].stages[0].warmup_microbatches': 1 in a pipeline of "
                 "virtual_stages 2 (allowed: none: megatron's interleaved schedule derives its "
                 "warm-up from the stage's position, which also orders its chunks)")


def test_overlap_grad_reduce_refused(raw):
    raw["overlap_grad_reduce"] = True
    expect_error(raw, "field 'overlap_grad_reduce': overlapped gradient sync (the plan's field "
                 "or --overlap-grad-reduce) with pipelines[0].virtual_stages 2 (allowed: no "
                 "overlap on a plan with interleaved pipelines: megatron's interleaved schedule "
                 "re-enables the sync before each chunk's last backward, the runtime has one "
                 "no-sync switch per stage)")


@pytest.mark.parametrize("value, got", [(0, "got 0 (allowed: a number > 0)"),
                                        ("two", "got 'two' (str) (allowed: an integer)")])
def test_bad_virtual_stages(raw, value, got):
    raw["pipelines"][0]["virtual_stages"] = value
    expect_error(raw, f"field 'pipelines[0].virtual_stages': {got}")
