"""`autohet compare` on a fleet across zones: beside ours and the baselines, the zone-oblivious
plan (the planner on the same nodes with the zones ignored, then priced with them) and the best
single-zone plan (the planner on each zone's nodes alone, the best by the objective). Each is
checked against what it says it is: the search on that fleet, priced by the cost model on the
fleet with its zones; on a fleet without zones both are absent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_autohet.cli.main import main
from megatron_autohet.cost_model import evaluate_plan
from megatron_autohet.planner.compare import compare
from megatron_autohet.planner.objective import objective_named
from megatron_autohet.planner.search import search
from megatron_autohet.planner.space import resolve_profile
from megatron_autohet.spec.cluster import cluster_from_dict
from megatron_autohet.spec.model import load_model

pytestmark = pytest.mark.unit

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TINY = load_model(CONFIGS / "models" / "tiny.yaml")
BATCH, MICRO = 16, 2
# zone a: two H800 nodes; zone b: two A100 nodes, cheaper per GPU-hour; a slow, billed link
NODES = [{"name": "h800", "gpu": "H800", "gpus": 2, "count": 2, "spot_price": 2.9, "zone": "a"},
         {"name": "a100", "gpu": "A100-80GB", "gpus": 2, "count": 2, "spot_price": 1.0,
          "zone": "b"}]
# the work budget decides every search, not the wall-clock safety net (a loaded machine would
# cut one search and not its twin)
NET_S = 3600.0
LINKS = {"inter_zone": {"bandwidth_gbs": 0.05, "latency_ms": 5, "egress_usd_per_gb": 0.02}}


# the same GPUs in both zones: a planner blind to the zones uses all of them
TWINS = [{"name": f"a100-{z}", "gpu": "A100-80GB", "gpus": 2, "count": 2, "zone": z}
         for z in "ab"]


def _cluster(zones: bool = True, nodes=NODES):
    data = {"name": "zoned", "inter_node_bandwidth_gbs": 25,
            "nodes": [dict(n) if zones else {k: v for k, v in n.items() if k != "zone"}
                      for n in nodes]}
    if zones:
        data.update(zones={"a": "r", "b": "r"}, links=LINKS)
    return cluster_from_dict(data)


def _search(cluster, objective):
    return search(cluster, TINY, None, BATCH, MICRO, progress=False, objective=objective,
                  time_limit_s=NET_S)


def _price(plan, cluster):
    profile = resolve_profile(cluster, TINY, None, MICRO, TINY.seq_length)
    return evaluate_plan(plan, cluster, profile, with_timeline=False)


@pytest.mark.parametrize("objective", ["throughput", "cost"])
def test_the_zone_plans_are_the_searches_they_name_priced_with_the_zones(objective):
    cluster = _cluster()
    result = compare(cluster, TINY, None, BATCH, MICRO, progress=False, objective=objective,
                     time_limit_s=NET_S)
    oblivious, single = result.zone_plans
    assert oblivious.name == "zone-oblivious"

    # the planner on the same nodes without zones ...
    blind = _search(cluster.without_zones(), objective)
    assert oblivious.plan.pipelines == blind.plan.pipelines
    assert [r.node for r in oblivious.plan.ranks] == [r.node for r in blind.plan.ranks]
    # ... priced with them: what the cost model says of that plan on the zoned fleet
    assert oblivious.cost.iteration_time_s == _price(blind.plan, cluster).iteration_time_s
    assert (oblivious.cost.usd_per_million_tokens
            == _price(blind.plan, cluster).usd_per_million_tokens)
    assert oblivious.speedup == oblivious.cost.iteration_time_s / result.cost.iteration_time_s

    # each zone alone, the best of them by the objective's score
    goal = objective_named(objective)()
    by_zone = {z: _search(cluster.subset(cluster.zone_nodes(z)), objective) for z in "ab"}
    best = min(by_zone, key=lambda z: goal.rank(_price(by_zone[z].plan, cluster)))
    assert single.name == f"single zone ({best})" and single.zone == best
    assert {r.node for r in single.plan.ranks} <= set(cluster.zone_nodes(best))
    assert single.plan.pipelines == by_zone[best].plan.pipelines
    assert goal.score(single.cost) == goal.score(_price(by_zone[best].plan, cluster))
    # the other zone's GPUs are idle on the whole fleet
    other = {"a": "A100-80GB", "b": "H800"}[best]
    assert single.cost.idle_gpus.get(other) == 4

    data = result.to_dict()["zone_plans"]
    assert [z["name"] for z in data] == ["zone-oblivious", f"single zone ({best})"]
    assert data[1]["zone"] == best and "zone" not in data[0]


def test_the_zone_oblivious_plan_crossing_the_zones_pays_for_it():
    """Blind to the zone link (500x slower than the NICs) the planner spreads over both zones'
    A100s; the zones make that plan slower and billed, and ours (which judges every plan with
    the zones) faster."""
    cluster = _cluster(nodes=TWINS)
    result = compare(cluster, TINY, None, BATCH, MICRO, progress=False, time_limit_s=NET_S)
    oblivious = result.zone_plans[0]
    zones_used = {cluster.node(r.node).zone for r in oblivious.plan.ranks}
    assert zones_used == {"a", "b"}
    blind = _price(oblivious.plan, cluster.without_zones())
    assert oblivious.cost.iteration_time_s > blind.iteration_time_s
    assert oblivious.cost.egress_usd_per_iteration > 0 == blind.egress_usd_per_iteration
    assert result.cost.iteration_time_s < oblivious.cost.iteration_time_s


def test_a_fleet_without_zones_has_no_zone_plans():
    result = compare(_cluster(zones=False), TINY, None, BATCH, MICRO, progress=False,
                     time_limit_s=NET_S)
    assert result.zone_plans == []
    assert "zone_plans" not in result.to_dict()


def test_the_cli_prints_the_zone_rows(capsys):
    args = ["compare", "--cluster", str(CONFIGS / "clusters" / "two-zones.yaml"), "--model",
            str(CONFIGS / "models" / "tiny.yaml"), "--global-batch-size", "16",
            "--micro-batch-size", "2", "--time-limit", "3600"]
    assert main(args) == 0
    out = capsys.readouterr().out.splitlines()
    rows = {line.split("  ")[0]: line for line in out}
    assert "zone-oblivious" in rows and "planned without zones:" in rows["zone-oblivious"]
    single = next(name for name in rows if name.startswith("single zone ("))
    assert "alone:" in rows[single]
    assert "; zone-oblivious complete, " in out[-1] and f"; {single} complete, " in out[-1]
    assert main(args + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [z["name"] for z in data["zone_plans"]] == ["zone-oblivious", single]
    assert all(z["iteration_time_s"] > 0 for z in data["zone_plans"])
