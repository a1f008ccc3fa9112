"""The cost model on a fleet in two zones, by hand: four one-GPU nodes, n0 and n1 in zone a,
n2 and n3 in zone b (cost_model.py, "Zones"). The zone link is half a NIC's bandwidth, so a
transfer between zones runs at it (or at its share of it), waits its latency per message and
is billed per GB; the same plans on the same nodes without zones price as they always did."""

import dataclasses

import pytest

from megatron_autohet.cost_model import evaluate_plan
from megatron_autohet.plan import Pipeline, Plan, RankInfo, Stage
from megatron_autohet.planner.objective import Cost
from megatron_autohet.profiling.estimate import LINK_EFFICIENCY, layer_param_count
from megatron_autohet.profiling.profile import OpCost, Profile, ProfileEntry
from megatron_autohet.spec.cluster import cluster_from_dict
from megatron_autohet.spec.model import ModelSpec

pytestmark = pytest.mark.unit

MODEL = ModelSpec("hand", num_layers=4, hidden_size=64, num_attention_heads=4,
                  ffn_hidden_size=256, vocab_size=512, seq_length=32, num_query_groups=4)
ACTIVATION = 1 * 32 * 64 * 2           # bytes: micro-batch 1 x seq 32 x hidden 64, bf16
NIC, ZONE = 0.016384, 0.008192         # GB/s: a P2P (2 x 4096 B) takes 0.5 ms / 1 ms
LATENCY_S, PRICE = 0.002, 0.01         # per message; USD per GB
GPU_PRICE = 2.0                        # USD per GPU-hour
WORD, POS, NORM = 512 * 64, 32 * 64, 2 * 64
LAYER = layer_param_count(MODEL, 1)
NODES = [{"name": f"n{i}", "gpu": "A100-80GB", "gpus": 1, "spot_price": GPU_PRICE,
          "zone": "a" if i < 2 else "b"} for i in range(4)]


def _cluster(zones: bool = True, links: dict | None = None):
    data = {"name": "two-zones", "inter_node_bandwidth_gbs": NIC, "nodes": [
        dict(n) if zones else {k: v for k, v in n.items() if k != "zone"} for n in NODES]}
    if zones:
        data["zones"] = {"a": "r", "b": "r"}
        data["links"] = links or {"inter_zone": {"bandwidth_gbs": ZONE,
                                                 "latency_ms": LATENCY_S * 1e3,
                                                 "egress_usd_per_gb": PRICE}}
    return cluster_from_dict(data)


def _profile() -> Profile:
    profile = Profile("hand")
    profile.add(ProfileEntry("A100-80GB", 1, 1, 32, layer=OpCost(1.0, 2.0, 10, 1, LAYER),
                             embedding=OpCost(0.5, 0.5, 5, 5, WORD + POS),
                             output=OpCost(1.0, 1.0, 7, 7, WORD + NORM)))
    return profile


def _plan(*pipelines: list[int], microbatches: int) -> Plan:
    """Pipelines of two stages of two layers each, on these nodes."""
    ranks = [RankInfo(i, f"n{i}", 0, "A100-80GB") for i in range(4)]
    used = sorted(n for p in pipelines for n in p)
    rank_of = {n: i for i, n in enumerate(used)}
    return Plan("two-zones", MODEL, 1, microbatches * len(pipelines), 32,
                [dataclasses.replace(ranks[n], rank=rank_of[n]) for n in used],
                [Pipeline([Stage([rank_of[a]], (0, 2)), Stage([rank_of[b]], (2, 4))],
                          microbatches) for a, b in pipelines]).validate()


def _ring_s(params: float, holders: int, bw_gbs: float) -> float:
    """A ring all-reduce of fp32 gradients, and its 2 (D - 1) steps' latency."""
    return (2 * (holders - 1) / holders * params * 4 / (bw_gbs * 1e9 * LINK_EFFICIENCY)
            + 2 * (holders - 1) * LATENCY_S)


def test_p2p_between_zones_at_the_zone_link_with_latency_and_egress():
    # one pipeline, n0 (zone a) -> n2 (zone b), 3 micro-batches
    cost = evaluate_plan(_plan([0, 2], microbatches=3), _cluster(), _profile())
    first = cost.stages[0]
    # 8192 B at the zone link (half the NIC): 1 ms, plus 2 messages x 2 ms
    assert first.p2p_bandwidth_gbs == ZONE
    assert first.p2p_s == pytest.approx(0.001 + 0.004)
    # stages of 7 s and 8 s (test_cost_model's profile): fill + 2 x the slowest
    assert cost.pipelines[0].time_s == pytest.approx(7.005 + 8.0 + 2 * 8.0)
    # the tied embedding syncs between the two ends, across the zone link: 2 holders
    assert cost.grad_sync_s == pytest.approx(_ring_s(WORD, 2, ZONE))
    # egress: per micro-batch an activation forward and its gradient back (one TP rank each
    # side); the tied embedding's ring has two edges between zones, each carrying the
    # gradients once (2 (D - 1) / D = 1)
    p2p_bytes = 3 * 2 * ACTIVATION
    sync_bytes = 2 * WORD * 4
    assert cost.egress_usd_per_iteration == pytest.approx((p2p_bytes + sync_bytes) / 1e9 * PRICE)
    # the same pipeline inside zone a: the NIC, no latency, nothing billed
    inside = evaluate_plan(_plan([0, 1], microbatches=3), _cluster(), _profile())
    assert inside.stages[0].p2p_s == pytest.approx(0.0005)
    assert inside.egress_usd_per_iteration == 0.0


def test_sync_groups_crossing_one_zone_pair_share_it():
    # two pipelines, one per zone: every sync group has a member in each zone - the layers of
    # stage 0 (n0, n2) and of stage 1 (n1, n3), the tied word embedding (all four), the
    # position embedding (n0, n2), the final norm (n1, n3) - so the five share the zone link
    cost = evaluate_plan(_plan([0, 1], [2, 3], microbatches=2), _cluster(), _profile())
    share = ZONE / 5
    assert share < NIC
    first = _ring_s(2 * LAYER, 2, share) + _ring_s(WORD, 4, share) + _ring_s(POS, 2, share)
    last = _ring_s(2 * LAYER, 2, share) + _ring_s(WORD, 4, share) + _ring_s(NORM, 2, share)
    assert [s.sync_s for s in cost.stages] == pytest.approx([first, last, first, last])
    assert cost.grad_sync_s == pytest.approx(max(first, last))
    # the P2P stays inside each zone
    assert [s.p2p_s for s in cost.stages] == pytest.approx([0.0005, 0.0, 0.0005, 0.0])
    # each ring's two edges between zones carry 2 (D - 1) / D of its fp32 gradients
    sent = sum(2 * (d - 1) / d * params * 4 for params, d in
               [(2 * LAYER, 2), (2 * LAYER, 2), (WORD, 4), (POS, 2), (NORM, 2)])
    assert cost.egress_usd_per_iteration == pytest.approx(2 * sent / 1e9 * PRICE)
    # a pipeline per zone pair of nodes instead (n0 -> n2, n1 -> n3): only the word embedding's
    # ring crosses zones among the sync groups, alone on the zone link
    across = evaluate_plan(_plan([0, 2], [1, 3], microbatches=2), _cluster(), _profile())
    assert across.stages[0].sync_s == pytest.approx(
        2 * (1 / 2) * 2 * LAYER * 4 / (NIC * 1e9 * LINK_EFFICIENCY)      # inside zone a
        + _ring_s(WORD, 4, ZONE)
        + 2 * (1 / 2) * POS * 4 / (NIC * 1e9 * LINK_EFFICIENCY))


def test_egress_is_in_the_price_per_token_and_the_cost_objective():
    cost = evaluate_plan(_plan([0, 1], [2, 3], microbatches=2), _cluster(), _profile())
    tokens = 4 * 32
    gpus = 4 * GPU_PRICE / 3600 * cost.iteration_time_s
    assert cost.usd_per_hour == pytest.approx(4 * GPU_PRICE)     # the GPUs' rate alone
    assert cost.usd_per_million_tokens == pytest.approx(
        (gpus + cost.egress_usd_per_iteration) / tokens * 1e6)
    assert Cost().score(cost) == cost.usd_per_million_tokens
    assert cost.predicted()["egress_usd_per_iteration"] == pytest.approx(
        cost.egress_usd_per_iteration)


def test_regions_cost_more_and_pay_the_slowest_latency():
    links = {"inter_zone": {"bandwidth_gbs": ZONE, "latency_ms": 2, "egress_usd_per_gb": 0.01},
             "inter_region": {"bandwidth_gbs": ZONE, "latency_ms": 30,
                              "egress_usd_per_gb": 0.02}}
    data = {"name": "three", "inter_node_bandwidth_gbs": NIC,
            "zones": {"a": "r", "b": "r", "c": "s"}, "links": links, "nodes": [
                {"name": f"n{i}", "gpu": "A100-80GB", "gpus": 1, "zone": z}
                for i, z in enumerate("abcc")]}
    cluster = cluster_from_dict(data)
    # the tied embedding's ring over zones a, b (region r) and c (region s): edges a-b
    # (inter-zone), b-c and c-a (inter-region); each step waits the slowest, 30 ms
    cost = evaluate_plan(_plan([0, 2], [1, 3], microbatches=2), cluster, _profile())
    word = 2 * (3 / 4) * WORD * 4
    assert cost.egress_usd_per_iteration == pytest.approx(
        (word * (0.01 + 0.02 + 0.02)                         # the word embedding's ring
         + 2 * ACTIVATION * 2 * 0.02 * 2                     # both pipelines' P2P, a/b -> c
         + 2 * (1 / 2) * 2 * LAYER * 4 * 0.01 * 2            # stage 0's layers: a-b, b-a
         + 2 * (1 / 2) * POS * 4 * 0.01 * 2) / 1e9)          # the position embedding: a-b
    assert cost.stages[0].p2p_s == pytest.approx(0.001 + 2 * 0.030)


def test_a_cluster_without_zones_prices_as_before():
    plans = [_plan([0, 2], microbatches=3), _plan([0, 1], [2, 3], microbatches=2),
             _plan([0, 2], [1, 3], microbatches=2)]
    for plan in plans:
        plain = evaluate_plan(plan, _cluster(zones=False), _profile())
        assert plain.egress_usd_per_iteration == 0.0
        assert "egress_usd_per_iteration" not in plain.predicted()
        # zones whose link no share of slows below a NIC, that wait and cost nothing, price
        # exactly alike: the zone terms add nothing, bit for bit
        neutral = evaluate_plan(plan, _cluster(links={"inter_zone": {
            "bandwidth_gbs": 100 * NIC, "latency_ms": 0, "egress_usd_per_gb": 0}}), _profile())
        assert neutral == plain
        assert neutral.predicted() == plain.predicted()
    # and the NIC alone sets the plain figures, as before zones: 8192 B at the NIC
    assert evaluate_plan(plans[0], _cluster(zones=False), _profile()).stages[0].p2p_s == (
        2 * ACTIVATION / (NIC * 1e9))
