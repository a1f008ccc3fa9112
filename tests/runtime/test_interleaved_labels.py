"""What the job and the re-planner say and count of an interleaved plan's stages: every model
chunk, not its first alone (plan_switch.describe_plan, stage_drift's lines and records, the state
a stage holds, the layout the adapt loop compares)."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest

from megatron_autohet.plan import Pipeline, Plan, RankInfo, Stage
from megatron_autohet.plan_switch import describe_plan
from megatron_autohet.planner.adapt import _same_layout
from megatron_autohet.planner.state_moves import _stage_pieces
from megatron_autohet.runtime.stage_drift import window_report
from megatron_autohet.spec.model import ModelSpec

pytestmark = pytest.mark.unit

MODEL = ModelSpec("hand", num_layers=8, hidden_size=64, num_attention_heads=4,
                  ffn_hidden_size=256, vocab_size=512, seq_length=32, num_query_groups=4)


def _plan() -> Plan:
    ranks = [RankInfo(r, "a", r, "A100-80GB") for r in range(2)]
    stages = [Stage([0], (0, 2), virtual_layers=((4, 6),), predicted_time_s=0.010),
              Stage([1], (2, 4), virtual_layers=((6, 8),), predicted_time_s=0.010)]
    return Plan("hand", MODEL, 1, 4, 32, ranks,
                [Pipeline(stages, num_microbatches=4, virtual_stages=2)]).validate()


def test_the_switch_line_names_every_chunk():
    assert describe_plan(_plan()) == ("1 pipeline on 2 GPUs [A100-80GB layers 0-2+4-6 | "
                                      "A100-80GB layers 2-4+6-8] x4")


def test_a_drift_line_and_record_name_every_chunk():
    report = window_report(_plan(), 1, 20, [[0.060, 0, 0, 0], [0.040, 0, 0, 0]])
    assert report.lines() == [
        "iterations 1-20: pipeline 0 stage 0 (A100-80GB x1, layers 0-1+4-5): forward+backward "
        "0.015 s per micro-batch measured, 0.01 s predicted (1.50x)"]
    stages = report.to_dict()["stages"]
    assert [s["chunks"] for s in stages] == [[[0, 2], [4, 6]], [[2, 4], [6, 8]]]
    assert stages[0]["layers"] == [0, 2]


def test_a_stage_holds_the_state_of_every_chunk():
    plan = _plan()
    assert _stage_pieces(plan, 0, 0) == [0, 1, 4, 5, "word_embeddings", "position_embeddings"]
    assert _stage_pieces(plan, 0, 1) == [2, 3, 6, 7, "word_embeddings", "post_process"]


def test_plans_that_differ_in_their_later_chunks_are_different_layouts():
    plan = _plan()
    other = copy.deepcopy(plan)
    other.pipelines[0].stages[0] = replace(other.pipelines[0].stages[0], layers=(0, 2),
                                           virtual_layers=((4, 5),))
    other.pipelines[0].stages[1] = replace(other.pipelines[0].stages[1], layers=(2, 4),
                                           virtual_layers=((5, 8),))
    assert _same_layout(plan, copy.deepcopy(plan))
    assert not _same_layout(plan, other)
