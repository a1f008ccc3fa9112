"""Stragglers (profiling/from_run.py ``find_stragglers``, ``measured_speeds``): a GPU slower
than the others of its GPU type and TP degree over a window, normalised per micro-batch and
per the stage's priced time; and the cost model and the planner's pools pricing such a GPU at
its speed (spec/cluster.py ``Cluster.speeds``). Synthetic windows from the cost model's stage
times (tests/helpers/windows.py), never the wall clock."""

from __future__ import annotations

import pytest

from helpers.windows import synthetic_window
from megatron_autohet.cost_model import evaluate_plan
from megatron_autohet.errors import ConfigError
from megatron_autohet.plan import Pipeline, Plan, RankInfo, Stage
from megatron_autohet.planner.space import make_pools, resolve_profile
from megatron_autohet.runtime.stage_drift import window_report
from megatron_autohet.profiling.from_run import (STRAGGLER_THRESHOLD, find_stragglers,
                                                 measured_speeds, priced_entries,
                                                 profile_from_window)
from megatron_autohet.spec.cluster import cluster_from_dict
from megatron_autohet.spec.gpus import load_gpu_catalog
from megatron_autohet.spec.model import load_model
from megatron_autohet.spec.precision import PRECISIONS

pytestmark = pytest.mark.unit

CATALOG = load_gpu_catalog()
MODEL = load_model("configs/models/gpt3-350m.yaml")


def _cluster(**extra):
    return cluster_from_dict({"name": "eight", "inter_node_bandwidth_gbs": 25, "nodes": [
        {"name": "a", "gpu": "A100-80GB", "gpus": 2, "count": 2},
        {"name": "h", "gpu": "H800", "gpus": 2}], **extra})


def _plan():
    """Pipelines of unlike stages: A100 TP1 stages of 10 and 14 layers (embedding, output),
    A100 TP1 stages of 12 and 12, an H800 TP2 stage of the whole model."""
    ranks = [RankInfo(0, "a-0", 0, "A100-80GB"), RankInfo(1, "a-0", 1, "A100-80GB"),
             RankInfo(2, "a-1", 0, "A100-80GB"), RankInfo(3, "a-1", 1, "A100-80GB"),
             RankInfo(4, "h", 0, "H800"), RankInfo(5, "h", 1, "H800")]
    return Plan("eight", MODEL, 1, 12, 2048, ranks, [
        Pipeline([Stage([0], (0, 10)), Stage([1], (10, 24))], 4),
        Pipeline([Stage([2], (0, 12)), Stage([3], (12, 24))], 4),
        Pipeline([Stage([4, 5], (0, 24))], 4)]).validate()


def test_a_slowed_gpu_is_found_at_its_slowness_and_only_it():
    plan, cluster = _plan(), _cluster()
    priors = priced_entries(plan, CATALOG)
    # nobody slow: stages of 10, 12 and 14 layers, first or last, all normalised alike
    steady = synthetic_window(plan, cluster, 1, 20)
    assert find_stragglers(plan, steady.stages, priors) == []
    # a-1 GPU 1 (rank 3: 12 layers and the output layer) at 0.6x its type
    slowed = synthetic_window(plan, cluster.with_speeds({("a-1", 1): 0.6}), 1, 20)
    [found] = find_stragglers(plan, slowed.stages, priors)
    assert (found.rank, found.node, found.local_rank, found.gpu, found.tp) == (
        3, "a-1", 1, "A100-80GB", 1)
    assert found.ratio == pytest.approx(1 / 0.6) and found.speed == pytest.approx(0.6)
    speeds = measured_speeds(plan, slowed.stages, priors)
    assert speeds == {("a-0", 0): 1.0, ("a-0", 1): 1.0, ("a-1", 0): 1.0,
                      ("a-1", 1): pytest.approx(0.6), ("h", 0): 1.0, ("h", 1): 1.0}
    # recovered: priced back at its type's speed
    assert measured_speeds(plan, steady.stages, priors)[("a-1", 1)] == 1.0


def test_the_threshold_and_a_type_slow_as_a_whole():
    plan, cluster = _plan(), _cluster()
    priors = priced_entries(plan, CATALOG)
    just_under = 1 / (1 + STRAGGLER_THRESHOLD) + 0.01
    window = synthetic_window(plan, cluster.with_speeds({("a-0", 0): just_under}), 1, 20)
    assert find_stragglers(plan, window.stages, priors) == []
    assert len(find_stragglers(plan, window.stages, priors, threshold=0.05)) == 1
    # every A100 slow alike: the type drifted (the measured profile's business), no straggler
    every = {(n, g): 0.5 for n in ("a-0", "a-1") for g in (0, 1)}
    window = synthetic_window(plan, cluster.with_speeds(every), 1, 20)
    assert find_stragglers(plan, window.stages, priors) == []


def test_a_tp_group_is_as_slow_as_its_slowest_member():
    """The H800 TP2 stage with one member slowed: the cost model prices the group at 0.5x;
    the window (its members in lock step) cannot tell which, and its only group has nothing of
    its kind to compare with."""
    plan, cluster = _plan(), _cluster()
    profile = resolve_profile(cluster, MODEL, None, 1, 2048)
    base = evaluate_plan(plan, cluster, profile, with_timeline=False)
    slow = evaluate_plan(plan, cluster.with_speeds({("h", 1): 0.5}), profile,
                         with_timeline=False)
    h800 = [s for s in slow.stages if s.gpu == "H800"][0]
    h800_base = [s for s in base.stages if s.gpu == "H800"][0]
    assert h800.time_s == pytest.approx(2 * h800_base.time_s)
    assert h800.memory_gib == h800_base.memory_gib
    others = [(s.forward_s, s.backward_s) for s in slow.stages if s.gpu != "H800"]
    assert others == [(s.forward_s, s.backward_s) for s in base.stages if s.gpu != "H800"]
    window = synthetic_window(plan, cluster.with_speeds({("h", 1): 0.5}), 1, 20)
    [stage] = [s for s in window.stages if s.gpu == "H800"]
    assert stage.rank_compute_s == (stage.compute_s, stage.compute_s)
    assert find_stragglers(plan, window.stages, priced_entries(plan, CATALOG)) == []
    # a member's own compute above the other's (it waits less for them) names no straggler:
    # groups are compared, and this one has none of its kind
    medians = [[s.compute_s, 0.0, 0.0, 0.0] for s in window.stages for _ in s.ranks]
    medians[5][0] *= 1.3
    uneven = window_report(plan, 1, 20, medians)
    assert find_stragglers(plan, uneven.stages, priced_entries(plan, CATALOG)) == []


def test_the_measured_profile_keeps_a_stragglers_slowness_out_of_its_type():
    plan, cluster = _plan(), _cluster()
    priors = priced_entries(plan, CATALOG)
    window = synthetic_window(plan, cluster.with_speeds({("a-1", 1): 0.6}), 1, 20)
    kwargs = dict(precision=PRECISIONS["bf16"], attention="flash", fusions=None)
    speeds = measured_speeds(plan, window.stages, priors)
    kept = profile_from_window(plan, window.stages, priors, speeds=speeds, **kwargs)
    assert kept.get("A100-80GB", 1, 1, 2048).layer.forward_s == pytest.approx(
        priors["A100-80GB", 1].layer.forward_s)
    # without the speeds the type's entry takes the straggler's slowness in
    mixed = profile_from_window(plan, window.stages, priors, **kwargs)
    assert mixed.get("A100-80GB", 1, 1, 2048).layer.forward_s > 1.05 * priors[
        "A100-80GB", 1].layer.forward_s


def test_the_planners_pools_keep_slowed_groups_apart():
    cluster = _cluster().with_speeds({("a-1", 1): 0.6})
    pools = sorted(make_pools(cluster, {"A100-80GB": 1, "H800": 2}),
                   key=lambda p: (p.gpu, -p.speed, p.count))
    assert [(p.gpu, p.tp, p.count, p.groups_per_node, p.speed) for p in pools] == [
        ("A100-80GB", 1, 1, 1, 1.0), ("A100-80GB", 1, 2, 2, 1.0),
        ("A100-80GB", 1, 1, 1, 0.6), ("H800", 2, 1, 1, 1.0)]
    # at TP2 the slowed GPU slows its whole group
    pools = make_pools(cluster, {"A100-80GB": 2})
    assert sorted((p.count, p.speed) for p in pools) == [(1, 0.6), (1, 1.0)]


def test_a_cluster_file_states_slow_gpus():
    cluster = _cluster(slow_gpus=[{"node": "a-1", "local_rank": 1, "speed": 0.6}])
    assert cluster.speed("a-1", 1) == 0.6 and cluster.speed("a-1", 0) == 1.0
    assert cluster.subset(["a-0", "h"]).speeds == {}
    for bad, field in (({"node": "z", "local_rank": 0, "speed": 0.5}, "slow_gpus[0].node"),
                       ({"node": "h", "local_rank": 2, "speed": 0.5},
                        "slow_gpus[0].local_rank"),
                       ({"node": "h", "local_rank": 0, "speed": 1.5}, "slow_gpus[0].speed")):
        with pytest.raises(ConfigError) as err:
            _cluster(slow_gpus=[bad])
        assert err.value.field == field
