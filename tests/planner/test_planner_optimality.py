"""The planner is optimal on small fleets: within 1% of the exhaustive search on every one of
many seeded random fleets (testing/random_fleets.py). Both searches price plans with the same
cost model over the same TP degrees and pipeline depth, so any gap is a plan the planner's space
or pruning misses: a bug, not noise. scripts/bench_planner.py runs many more seeds and reports
the gap distribution.

* ``random_case``: 2-4 GPU types, <= 16 GPUs, nodes of 1-8 GPUs, per-node intra-node links and
  NICs over realistic ranges, memory that binds in about half of them;
* ``odd_case``: 2-4 types of 1 or 3 GPUs, one-GPU nodes with their own NICs among them, 7-13
  layers: the order of GPU types along a pipeline and the layer split decide;
* ``memory_bound_case``: fleets where memory decides every choice (which GPUs hold the output
  layer, how many layers a stage holds, how many micro-batches a pipeline may run). There the
  exhaustive search is also checked against the planner: a planner plan faster than the brute
  force's optimum is a memory plan the brute force wrongly refused.

The brute force holds one model chunk per stage, so the planner searches that space here
(``virtual_stages=False``); tests/planner/test_virtual_stages.py covers its chunks.
"""

from __future__ import annotations

import pytest

from megatron_autohet.cost_model import (GIB, evaluate_plan, stage_memory_bytes,
                                         usable_memory_gib)
from megatron_autohet.errors import ConfigError
from megatron_autohet.plan import Pipeline, Plan, RankInfo, Stage
from megatron_autohet.planner import search
from megatron_autohet.planner.space import resolve_profile
from megatron_autohet.planner.warmup import choose_warmups
from megatron_autohet.testing.exhaustive import exhaustive_optimum, exhaustive_search
from megatron_autohet.testing.random_fleets import memory_bound_case, odd_case, random_case
from megatron_autohet.profiling.estimate import estimate_entry
from megatron_autohet.spec.cluster import cluster_from_dict
from megatron_autohet.spec.gpus import GPUType
from megatron_autohet.spec.model import ModelSpec
from megatron_autohet.spec.precision import BF16

pytestmark = pytest.mark.integration

# As many fleets as the exhaustive search covers in about a minute on two cores, and the
# benchmark's seeds that once failed (251: a bound rounded up to the sync grid pruned the best).
SEEDS = [*range(60), 251]
MEMORY_SEEDS = range(80)
# The seeds below 40 whose exhaustive search takes under 5 CPU-seconds (about 40 s together);
# scripts/bench_planner.py --optimality-only 300 runs 300 of each kind.
ODD_SEEDS = [s for s in range(40) if s not in (0, 5, 7, 16, 24, 25, 36)]
MAX_GAP = 0.01


def _both(case):
    """(exhaustive optimum before and after the warm-up pass, planner's plan), or three Nones
    when no plan fits in memory (then both searches must say so)."""
    args = (case.cluster, case.model, None, case.global_batch_size, case.micro_batch_size)
    try:
        closed, best = exhaustive_optimum(*args, **case.space())
    except ConfigError as err:
        assert "fits in memory" in str(err)
        with pytest.raises(ConfigError, match="fits in memory"):
            search(*args, progress=False, virtual_stages=False, **case.space())
        return None, None, None
    ours = search(*args, progress=False, virtual_stages=False, **case.space())
    assert ours.cost.fits_memory
    return closed, best, ours


@pytest.mark.parametrize("seed", SEEDS)
def test_within_one_percent_of_the_exhaustive_optimum(seed):
    case = random_case(seed)
    _, best, ours = _both(case)
    if best is not None:
        gap = ours.cost.iteration_time_s / best.cost.iteration_time_s - 1
        assert gap <= MAX_GAP, f"{100 * gap:.2f}% off the optimum on {case.describe()}"


@pytest.mark.parametrize("seed", MEMORY_SEEDS)
def test_within_one_percent_where_memory_decides(seed):
    case = memory_bound_case(seed)
    _, best, ours = _both(case)
    if best is None:
        return
    # memory decides: no small GPU can hold the output layer, not even with one layer
    small = case.cluster.gpu_types["small"]
    entry = estimate_entry(case.model, small, 1, case.micro_batch_size, case.model.seq_length,
                           small.intra_node_bandwidth_gbs)
    assert stage_memory_bytes(entry, case.model, 1, False, True, False, 1, BF16) > \
        usable_memory_gib(small) * GIB
    assert all(best.plan.ranks[p.stages[-1].ranks[0]].gpu == "large" for p in best.plan.pipelines)
    gap = ours.cost.iteration_time_s / best.cost.iteration_time_s - 1
    assert gap <= MAX_GAP, f"{100 * gap:.2f}% off the optimum on {case.describe()}"
    assert gap >= -1e-9, f"the brute force missed a plan {-100 * gap:.2f}% faster on " \
                         f"{case.describe()}"


@pytest.mark.parametrize("seed", ODD_SEEDS)
def test_within_one_percent_with_odd_counts(seed):
    """After each search's warm-up pass, which tries the plans next to its best
    (planner/warmup.py); and the planner's plan at standard depths (Case.closed_form_s) never
    beats the brute force's optimum before the pass."""
    case = odd_case(seed)
    closed, best, ours = _both(case)
    if best is None:
        return
    gap = ours.cost.iteration_time_s / best.cost.iteration_time_s - 1
    assert gap <= MAX_GAP, f"{100 * gap:.2f}% off the optimum on {case.describe()}"
    below = case.closed_form_s(ours.plan) / closed.cost.iteration_time_s - 1
    assert below >= -1e-9, f"the brute force missed a plan {-100 * below:.2f}% faster on " \
                           f"{case.describe()}"


def test_the_warmup_pass_resplits_layers_for_deeper_warmups():
    """Odd-count seed 20 (planner/warmup.py, "Neighbours"): the search's split, 0.85% off the
    optimum at standard depths, gains nothing from deeper warm-ups, and another split of the
    same pipeline gains 7.7%. Without the re-split the planner's final plan was 6.9% slower than
    the exhaustive search's; with it both find the same plan."""
    case = odd_case(20)
    closed, best, ours = _both(case)
    gap = ours.cost.iteration_time_s / best.cost.iteration_time_s - 1
    assert gap <= MAX_GAP, f"{100 * gap:.2f}% off the optimum on {case.describe()}"
    assert ours.cost.iteration_time_s < closed.cost.iteration_time_s * (1 - 0.05)


def test_the_warmup_pass_tries_an_idle_gpu_as_one_stage_more():
    """Odd-count seed 73 (planner/warmup.py, "Neighbours"): the exhaustive search's optimum at
    standard depths is a 4-stage pipeline (G2, then the three one-GPU G0 nodes, the one behind a
    2.2 GB/s NIC second; layers 1/3/5/1), the planner's a 3-stage one without that GPU, equal to
    0.002%; warmed up the 4-stage one is 2.3% faster. (The brute force takes 40 CPU-s here, so
    its optimum is written out.)"""
    case = odd_case(73)
    nodes = [n.name for n in case.cluster.nodes]
    assert nodes == ["nG2-0", "nG0-0", "nG0-1", "nG0-2", "nG1-0"]
    optimum = Plan(cluster=case.cluster.name, model=case.model, micro_batch_size=1,
                   global_batch_size=case.global_batch_size, seq_length=case.model.seq_length,
                   ranks=[RankInfo(i, n, 0, n[1:3]) for i, n in enumerate(nodes[:4])],
                   pipelines=[Pipeline([Stage([0], (0, 1)), Stage([3], (1, 4)),
                                        Stage([2], (4, 9)), Stage([1], (9, 10))], 5)])
    profile = resolve_profile(case.cluster, case.model, None, 1, case.model.seq_length)
    closed = evaluate_plan(optimum, case.cluster, profile, with_timeline=False)
    _, best = choose_warmups(optimum, closed, case.cluster, profile, max_stages=4)
    ours = search(case.cluster, case.model, None, case.global_batch_size, 1, progress=False,
                  virtual_stages=False, **case.space())
    assert case.closed_form_s(ours.plan) >= closed.iteration_time_s * (1 - 1e-9)
    assert best.iteration_time_s < closed.iteration_time_s * (1 - 0.04)
    gap = ours.cost.iteration_time_s / best.iteration_time_s - 1
    assert gap <= MAX_GAP, f"{100 * gap:.2f}% off the optimum on {case.describe()}"


def test_a_pipeline_over_one_gpu_nodes_of_two_types_in_any_order():
    """One fast GPU and three slower one-GPU nodes, each node with its own NIC (so each its own
    pool), TP 1, 13 layers, 4 micro-batches: the optimum is one pipeline over all four nodes,
    slow-fast-slow-slow. When a pipeline could mix at most three pools the planner's best was
    slow-fast-slow, 5.3% slower."""
    types = {"A": GPUType("A", 180.19, 6.3275, 2635.8, 100),
             "B": GPUType("B", 86.902, 7.0305, 1512.1, 100)}
    cluster = cluster_from_dict({"name": "one-gpu-nodes", "inter_node_bandwidth_gbs": 25, "nodes": [
        {"name": name, "gpu": gpu, "gpus": 1, "inter_node_bandwidth_gbs": nic}
        for name, gpu, nic in (("a0", "A", 3.0119), ("b0", "B", 19.235), ("b1", "B", 11.235),
                               ("b2", "B", 2.6644))]}, catalog=types)
    model = ModelSpec(name="gpt-13", num_layers=13, hidden_size=1536, num_attention_heads=16,
                      ffn_hidden_size=6144, vocab_size=50257, seq_length=1024,
                      num_query_groups=16)
    space = {"tp_degrees": [1], "max_stages": 4, "activation_recompute": False}
    best = exhaustive_search(cluster, model, None, 4, 1, **space)
    assert [len(p.stages) for p in best.plan.pipelines] == [4]
    ours = search(cluster, model, None, 4, 1, progress=False, virtual_stages=False, **space)
    assert ours.cost.iteration_time_s <= best.cost.iteration_time_s * (1 + MAX_GAP)


def test_a_pipeline_over_five_one_gpu_nodes_in_any_order():
    """One fast GPU and four slower one-GPU nodes, each with its own NIC (five pools), TP 1, 5
    layers, 6 micro-batches: the optimum is one pipeline over all five nodes, the slower
    nodes first in the order of their links. When pipelines of more than four stages were
    contiguous runs of at most three pools the planner's best was a 4-stage pipeline, 9.5%
    slower."""
    types = {"A": GPUType("A", 163.0, 4.33, 2000, 100),
             "B": GPUType("B", 69.5, 4.35, 1500, 100)}
    cluster = cluster_from_dict({"name": "five-one-gpu-nodes", "inter_node_bandwidth_gbs": 25,
                                 "nodes": [
        {"name": name, "gpu": gpu, "gpus": 1, "inter_node_bandwidth_gbs": nic}
        for name, gpu, nic in (("a0", "A", 17.3), ("b0", "B", 19.7), ("b1", "B", 8.39),
                               ("b2", "B", 11.3), ("b3", "B", 6.17))]}, catalog=types)
    model = ModelSpec(name="gpt-5", num_layers=5, hidden_size=1536, num_attention_heads=16,
                      ffn_hidden_size=6144, vocab_size=50257, seq_length=1024,
                      num_query_groups=16)
    space = {"tp_degrees": [1], "max_stages": 5, "activation_recompute": False}
    best = exhaustive_search(cluster, model, None, 6, 1, **space)
    assert [len(p.stages) for p in best.plan.pipelines] == [5]
    ours = search(cluster, model, None, 6, 1, progress=False, virtual_stages=False, **space)
    assert ours.cost.iteration_time_s <= best.cost.iteration_time_s * (1 + MAX_GAP)
