"""The planner's virtual stages (planner/interleave.py): the pipelines setting the iteration
time get 2 or 4 model chunks per stage where the cost model prices a gain, and keep one where it
does not; ``--no-virtual-stages`` turns the pass off; re-plans choose again."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest

from megatron_autohet.cli.main import main
from megatron_autohet.cost_model import evaluate_plan
from megatron_autohet.plan import Pipeline, Stage, load_plan
from megatron_autohet.planner.interleave import choose_virtual_stages, interleaved
from megatron_autohet.planner.replan import replan
from megatron_autohet.planner.search import search
from megatron_autohet.planner.space import resolve_profile
from megatron_autohet.spec import load_cluster, load_model
from megatron_autohet.spec.cluster import cluster_from_dict

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
GPT_6_7B = load_model(ROOT / "configs" / "models" / "gpt3-6.7b.yaml")
# Four one-GPU nodes on 100 GB/s NICs: GPT-3 6.7B needs a pipeline over them, and with a batch
# of 4 its fill and drain are most of the iteration while a transfer costs 0.4 ms.
BUBBLE = cluster_from_dict({"name": "bubble", "inter_node_bandwidth_gbs": 100, "nodes": [
    {"name": f"n{i}", "gpu": "A100-80GB", "gpus": 1} for i in range(4)]})
SAFETY_NET_S = 3600.0     # the work budget ends every search here (no load reaches it)


def _search(cluster, model, batch, **options):
    return search(cluster, model, None, batch, 1, progress=False, time_limit_s=SAFETY_NET_S,
                  **options)


def test_chunks_cover_the_model_in_megatrons_order_and_keep_each_stages_layers():
    pipe = Pipeline([Stage([0], (0, 3)), Stage([1], (3, 5))], 4)
    two = interleaved(pipe, 2)
    # virtual stage c * n + s is chunk c of stage s; the larger chunk first
    assert [s.chunks for s in two.stages] == [((0, 2), (3, 4)), ((2, 3), (4, 5))]
    assert two.virtual_stage_layers() == [(0, 2), (2, 3), (3, 4), (4, 5)]
    assert [s.num_layers for s in two.stages] == [3, 2] and two.virtual_stages == 2
    assert [s.chunks for s in interleaved(two, 1).stages] == [((0, 3),), ((3, 5),)]


@pytest.mark.parametrize("batch", [4, 8])
def test_where_the_bubble_dominates_the_plan_interleaves_and_is_faster(batch, tmp_path):
    chosen = _search(BUBBLE, GPT_6_7B, batch)
    plain = _search(BUBBLE, GPT_6_7B, batch, virtual_stages=False)
    assert all(p.virtual_stages == 1 for p in plain.plan.pipelines)
    assert max(p.virtual_stages for p in chosen.plan.pipelines) > 1
    # measured on this fleet: 0.703 s against 0.979 s at batch 4, 1.267 s against 1.537 at 8
    assert chosen.cost.iteration_time_s < 0.95 * plain.cost.iteration_time_s
    assert chosen.cost.fits_memory
    # a valid plan file, priced as the search says
    chosen.plan.save(tmp_path / "plan.yaml")
    again = load_plan(tmp_path / "plan.yaml")
    profile = resolve_profile(BUBBLE, GPT_6_7B, None, 1, GPT_6_7B.seq_length)
    assert evaluate_plan(again, BUBBLE, profile, with_timeline=False).iteration_time_s == \
        pytest.approx(chosen.cost.iteration_time_s)


def test_where_it_does_not_pay_the_plan_is_the_same_byte_for_byte():
    """The quick start (a100-h800-h20, GPT-3 1.3B, global batch 64): 16 micro-batches over 5
    stages, 0.2411 s of pipeline, 0.2481 s with 2 chunks (the transfers win)."""
    cluster = load_cluster(ROOT / "configs" / "clusters" / "a100-h800-h20.yaml")
    model = load_model(ROOT / "configs" / "models" / "gpt3-1.3b.yaml")
    on, off = (_search(cluster, model, 64, virtual_stages=v) for v in (True, False))
    assert on.plan.to_dict() == off.plan.to_dict()
    assert on.cost.iteration_time_s == off.cost.iteration_time_s


def test_a_plan_overlapping_its_gradient_reduce_keeps_one_chunk():
    plain = _search(BUBBLE, GPT_6_7B, 4, virtual_stages=False)
    plan = dataclasses.replace(copy.deepcopy(plain.plan), overlap_grad_reduce=True)
    profile = resolve_profile(BUBBLE, GPT_6_7B, None, 1, GPT_6_7B.seq_length)
    cost = evaluate_plan(plan, BUBBLE, profile, with_timeline=False)
    assert choose_virtual_stages(plan, cost, BUBBLE, profile, 0.1) == (plan, cost)
    # without the overlap the same plan interleaves
    assert choose_virtual_stages(plain.plan, plain.cost, BUBBLE, profile, 0.1)[0] is not \
        plain.plan


def test_a_replan_of_an_interleaved_plan_after_losing_a_node_is_the_fresh_plan():
    """Its surviving pipelines seed the re-plan with one chunk per stage (and their layer
    counts): on 3 nodes GPT-3 6.7B's 4 micro-batches no longer split in whole groups of
    stages, and the re-plan is as fast as a fresh plan."""
    chosen = _search(BUBBLE, GPT_6_7B, 4)
    assert chosen.plan.pipelines[0].interleaved
    fleet = BUBBLE.subset(["n0", "n1", "n2"])
    found = replan(chosen.plan, fleet, GPT_6_7B, time_limit_s=SAFETY_NET_S)
    fresh = _search(fleet, GPT_6_7B, 4)
    assert found.cost.iteration_time_s <= fresh.cost.iteration_time_s * 1.02


def test_a_replan_chooses_chunks_where_they_pay():
    plain = _search(BUBBLE, GPT_6_7B, 4, virtual_stages=False)
    found = replan(plain.plan, BUBBLE, GPT_6_7B, time_limit_s=SAFETY_NET_S,
                   search_unchanged=True)
    assert max(p.virtual_stages for p in found.plan.pipelines) > 1
    assert found.cost.iteration_time_s < 0.95 * plain.cost.iteration_time_s


def test_autohet_plan_no_virtual_stages(tmp_path, capsys):
    cluster = tmp_path / "bubble.yaml"
    cluster.write_text("name: bubble\ninter_node_bandwidth_gbs: 100\nnodes:\n" + "".join(
        f"  - {{name: n{i}, gpu: A100-80GB, gpus: 1}}\n" for i in range(4)))
    common = ["plan", "--cluster", str(cluster), "--model",
              str(ROOT / "configs" / "models" / "gpt3-6.7b.yaml"), "--global-batch-size", "4"]
    assert main([*common, "-o", str(tmp_path / "on.yaml")]) == 0
    assert main([*common, "--no-virtual-stages", "-o", str(tmp_path / "off.yaml")]) == 0
    on, off = load_plan(tmp_path / "on.yaml"), load_plan(tmp_path / "off.yaml")
    assert on.pipelines[0].virtual_stages > 1 and off.pipelines[0].virtual_stages == 1
    assert on.predicted["iteration_time_s"] < off.predicted["iteration_time_s"]


def test_a_replan_keeps_one_chunk_when_asked_or_when_the_plan_overlaps_its_gradient_reduce():
    plain = _search(BUBBLE, GPT_6_7B, 4, virtual_stages=False)
    overlapped = dataclasses.replace(copy.deepcopy(plain.plan), overlap_grad_reduce=True)
    for previous, options in [(plain.plan, {"virtual_stages": False}), (overlapped, {})]:
        found = replan(previous, BUBBLE, GPT_6_7B, time_limit_s=SAFETY_NET_S,
                       search_unchanged=True, **options)
        assert all(p.virtual_stages == 1 for p in found.plan.pipelines)
