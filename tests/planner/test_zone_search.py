"""The search on fleets across zones: a pool of TP groups keeps to one zone, an option's boundary
between zones is priced at the zone link with its latency (as the cost model prices it), and the
plans are the exhaustive search's optimum on seeded random fleets over two or three zones
(testing/random_fleets.py ``zoned_case``). A fleet without zones has the pools it always had."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from megatron_autohet.cost_model import p2p_s
from megatron_autohet.errors import ConfigError
from megatron_autohet.planner import search
from megatron_autohet.planner.space import (MAX_ZONE_SPLIT_POOLS, TERMS, Problem, make_pools,
                                            place_pipelines, resolve_profile,
                                            sequence_terms)
from megatron_autohet.spec.cluster import cluster_from_dict, load_cluster
from megatron_autohet.spec.model import load_model
from megatron_autohet.testing.exhaustive import exhaustive_optimum
from megatron_autohet.testing.random_fleets import zoned_case

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TINY = load_model(CONFIGS / "models" / "tiny.yaml")
ZONED = load_cluster(CONFIGS / "clusters" / "spot-4-zones.yaml")
TP1 = {"A100-80GB": 1, "H800": 1, "H20": 1}
# The zoned seeds whose exhaustive search takes a few seconds at most, among them the three that
# the search missed while its pools were blind to zones (20: 16.6%, 49: 31.1%, 61: 7.4% off;
# of 127 seeds also 71 and 81).
SEEDS = [s for s in range(64) if s not in (0, 8, 14)]
MAX_GAP = 0.01


def _problem(cluster, batch=8, micro=1):
    profile = resolve_profile(cluster, TINY, None, micro, TINY.seq_length)
    return Problem(cluster, TINY, profile, batch, micro, TINY.seq_length)


@pytest.mark.unit
def test_a_pool_holds_the_nodes_of_one_zone():
    pools = make_pools(ZONED, TP1)
    a100 = sorted((p.zone, p.count) for p in pools if p.gpu == "A100-80GB")
    assert a100 == [("zone-a", 1), ("zone-b", 1)]
    assert {p.gpu: p.zone for p in pools if p.gpu != "A100-80GB"} == {"H800": "zone-a",
                                                                      "H20": "zone-b"}
    blind = make_pools(ZONED.without_zones(), TP1)
    assert [(p.zone, p.count) for p in blind if p.gpu == "A100-80GB"] == [(None, 2)]


@pytest.mark.unit
def test_a_boundary_between_zones_is_priced_at_the_zone_link_with_its_latency():
    problem = _problem(ZONED)
    pools = make_pools(ZONED, TP1)
    k = {(p.gpu, p.zone): i for i, p in enumerate(pools)}
    h20 = k["H20", "zone-b"]
    rows = np.array([[k["A100-80GB", "zone-a"], h20], [k["A100-80GB", "zone-b"], h20]])
    terms, holds = sequence_terms(problem, pools, rows, recompute=False)
    assert holds.all()
    fixed = TERMS.index("time_fixed")
    crossing, inside = terms[0, 0, fixed], terms[1, 0, fixed]
    link = ZONED.link("node0", "node3")
    assert link.zones == ("zone-a", "zone-b") and link.latency_s > 0
    nic = min(n.inter_node_bandwidth_gbs for n in ZONED.nodes)
    precision = problem.profile.precision
    assert crossing - inside == pytest.approx(
        p2p_s(TINY, 1, TINY.seq_length, link.bandwidth_gbs, precision, link.latency_s)
        - p2p_s(TINY, 1, TINY.seq_length, nic, precision), rel=1e-9)
    # the stage after the boundary is priced alike, but for its tied-embedding sync with the
    # first stage, which crosses the zones too
    tied = TERMS.index("sync_tied_own_s")
    same = [i for i in range(len(TERMS)) if i != tied]
    assert terms[0, 1, same].tolist() == terms[1, 1, same].tolist()
    assert terms[0, 1, tied] > terms[1, 1, tied]


@pytest.mark.unit
def test_the_search_keeps_a_pipeline_inside_a_zone_where_that_is_faster():
    """spot-4-zones: an A100 in each zone, the H800 in zone-a, the H20 in zone-b; for the tiny
    model the H20 + A100 pipeline of zone-b is the fastest plan, found only where the search
    knows which A100 is in which zone (with blind pools it placed the A100 of zone-a and judged
    the crossing too slow: 2.106e-05 s against 1.758e-05)."""
    ours = search(ZONED, TINY, None, 8, 1, progress=False, time_limit_s=3600)
    zone_b = search(ZONED.subset(ZONED.zone_nodes("zone-b")), TINY, None, 8, 1,
                    progress=False, time_limit_s=3600)
    assert {ZONED.node(r.node).zone for r in ours.plan.ranks} == {"zone-b"}
    assert ours.cost.iteration_time_s == pytest.approx(zone_b.cost.iteration_time_s, rel=1e-12)
    assert ours.cost.egress_usd_per_iteration == 0


@pytest.mark.integration
@pytest.mark.parametrize("seed", SEEDS)
def test_within_one_percent_of_the_exhaustive_optimum_across_zones(seed):
    case = zoned_case(seed)
    args = (case.cluster, case.model, None, case.global_batch_size, case.micro_batch_size)
    try:
        _, best = exhaustive_optimum(*args, **case.space())
    except ConfigError as err:
        assert "fits in memory" in str(err)
        return
    ours = search(*args, progress=False, time_limit_s=3600, virtual_stages=False,
                  **case.space())
    gap = ours.cost.iteration_time_s / best.cost.iteration_time_s - 1
    assert gap <= MAX_GAP, f"{100 * gap:.2f}% off the optimum on {case.describe()}"


def _spread_fleet(types):
    """Two 2-GPU nodes of each type, one in each of two zones of one region."""
    nodes = [{"name": f"{t.lower()}-{z}", "gpu": t, "gpus": 2, "zone": z}
             for t in types for z in ("za", "zb")]
    return cluster_from_dict({"name": "spread", "inter_node_bandwidth_gbs": 25, "nodes": nodes,
                              "zones": {"za": "r1", "zb": "r1"}})


@pytest.mark.unit
def test_kinds_across_zones_share_a_pool_where_a_pool_per_zone_would_add_too_many():
    """A pool per zone where that adds at most MAX_ZONE_SPLIT_POOLS pools; above it a kind's
    pool spans its zones (the search's work grows steeply with its pools), and placement puts
    every node of such a kind in it."""
    two = make_pools(_spread_fleet(["A100-80GB", "H800"]), TP1)
    assert sorted((p.gpu, p.zone) for p in two) == [
        ("A100-80GB", "za"), ("A100-80GB", "zb"), ("H800", "za"), ("H800", "zb")]
    assert len(two) - 2 <= MAX_ZONE_SPLIT_POOLS
    spread = _spread_fleet(["A100-80GB", "H800", "H20"])
    three = make_pools(spread, TP1)
    assert sorted((p.gpu, p.zone, p.count) for p in three) == [
        ("A100-80GB", None, 4), ("H20", None, 4), ("H800", None, 4)]
    a100 = next(k for k, p in enumerate(three) if p.gpu == "A100-80GB")
    (stages,) = place_pipelines(spread, three, [(a100,) * 4])
    assert sorted({group[0].node for group in stages}) == ["a100-80gb-za", "a100-80gb-zb"]
