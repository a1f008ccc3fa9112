"""A whole zone lost at once, re-planned onto the zones left (pure: the fleet the elastic path
rebuilds from the members left, and the re-plan on it). The fleet keeps the cluster file's
zones and links, so the re-plan prices the link between the zones left: here a slow, billed
link between an H800 zone and an A100 zone, which a fleet rebuilt without zones would plan
across."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_autohet.cost_model import evaluate_plan
from megatron_autohet.elastic.fleet import Member, fleet_cluster
from megatron_autohet.planner.replan import replan
from megatron_autohet.planner.search import make_plan
from megatron_autohet.planner.space import resolve_profile
from megatron_autohet.spec.cluster import cluster_from_dict, load_cluster
from megatron_autohet.spec.model import load_model

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
TINY = load_model(ROOT / "configs/models/tiny.yaml")
BATCH, MICRO = 16, 2
NET_S = 3600.0      # the work budget decides each search, not the safety net (a loaded machine)
# zone a and b: two H800 nodes each; zone c: two A100 nodes; a slow, billed link between zones
TEMPLATE = cluster_from_dict({
    "name": "three-zones", "inter_node_bandwidth_gbs": 25,
    "zones": {"a": "r", "b": "r", "c": "r"},
    "links": {"inter_zone": {"bandwidth_gbs": 0.05, "latency_ms": 5, "egress_usd_per_gb": 0.02}},
    "nodes": [{"name": "h800-a", "gpu": "H800", "gpus": 2, "count": 2, "zone": "a"},
              {"name": "h800-b", "gpu": "H800", "gpus": 2, "count": 2, "zone": "b"},
              {"name": "a100-c", "gpu": "A100-80GB", "gpus": 2, "count": 2, "zone": "c"}]})


def _members(cluster, zones: set[str]) -> list[Member]:
    return [Member(n.name, n.gpu, g) for n in cluster.nodes if n.zone in zones
            for g in range(n.num_gpus)]


def test_the_fleet_keeps_the_zones_of_the_cluster_file():
    template = load_cluster(ROOT / "configs/clusters/two-zones.yaml")
    members = [Member("a100-0", "A100-80GB", 0), Member("h800-1", "H800", 0),
               Member("spare", "H800", 0)]
    cluster = fleet_cluster(members, template)
    # a known node its own zone; a new node the zone of the entry it is priced from
    assert [(n.name, n.zone) for n in cluster.nodes] == [
        ("a100-0", "us-east-1a"), ("h800-1", "us-east-1b"), ("spare", "us-east-1b")]
    assert cluster.regions == template.regions and cluster.links == template.links
    assert cluster.link("a100-0", "h800-1").egress_usd_per_gb == 0.02


@pytest.mark.parametrize("lost", ["a", "c"])
def test_a_lost_zone_is_replanned_onto_the_zones_left_priced_with_their_link(lost):
    previous = make_plan(TEMPLATE, TINY, None, BATCH, MICRO, progress=False, time_limit_s=NET_S)
    left = {"a", "b", "c"} - {lost}
    # one reclaim takes every node of the zone: the members left are the other zones'
    fleet = fleet_cluster(_members(TEMPLATE, left), TEMPLATE)
    assert {n.zone for n in fleet.nodes} == left
    found = replan(previous, fleet, TINY, time_limit_s=NET_S)
    assert {fleet.node(r.node).zone for r in found.plan.ranks} <= left
    # priced on the links between the zones left, as the cost model prices it on them
    on_left = TEMPLATE.subset([n.name for n in TEMPLATE.nodes if n.zone in left])
    profile = resolve_profile(on_left, TINY, None, MICRO, TINY.seq_length)
    priced = evaluate_plan(found.plan, on_left, profile, with_timeline=False)
    assert found.cost.iteration_time_s == priced.iteration_time_s
    assert found.cost.egress_usd_per_iteration == priced.egress_usd_per_iteration
    # and no slower than the plan a fleet without zones would have chosen, priced with them
    blind = replan(previous, fleet.without_zones(), TINY, time_limit_s=NET_S)
    blind_priced = evaluate_plan(blind.plan, on_left, profile, with_timeline=False)
    assert found.cost.iteration_time_s <= blind_priced.iteration_time_s


def test_the_zone_trace_takes_a_whole_zone_at_each_removal():
    """configs/traces/zone-loss-4node.csv on spot-4-zones.yaml: every removal step takes every
    node of one zone of the fleet up (the zones as the elastic job sees them, fleet_cluster's),
    once with notice and once without; the fleet left keeps a zone."""
    from megatron_autohet.testing.trace import fleet_over_time, load_trace, steps

    template = load_cluster(ROOT / "configs/clusters/spot-4-zones.yaml")
    events = load_trace(ROOT / "configs/traces/zone-loss-4node.csv")
    gpus = {"node4": "A100-80GB", "node5": "H20"}          # the replacements' GPU types
    up: list[str] = []
    notices = []
    for step in steps(events):
        gone = [e.node for e in step.events if e.action == "remove"]
        if gone:
            fleet = fleet_cluster([Member(n, gpus.get(n) or template.node(n).gpu, 0)
                                   for n in up], template)
            zone = {fleet.node(n).zone for n in gone}
            assert len(zone) == 1 and set(gone) == set(fleet.zone_nodes(zone.pop()))
            notices.append({e.notice for e in step.events})
        up = [n for n in up if n not in gone] + [e.node for e in step.events if e.action == "add"]
    assert notices == [{True}, {False}]
    assert fleet_over_time(events)[-1][1] == ("node0", "node2", "node4")
