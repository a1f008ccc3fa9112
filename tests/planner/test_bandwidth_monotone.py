"""A faster link never gives a slower plan: the throughput search's predicted iteration time
does not grow as the NICs get faster. The warm-up post-pass once broke it by warming up the
search's best plan alone (planner/warmup.py, "The best few"). On the fleet where it did, the
plan found on the slower links, priced on the faster ones, is also not faster than the plan
found there by more than the search's stopping tolerance (branch_and_bound.PRUNE_TOLERANCE);
that does not hold on every small fleet (random_case seed 3: 2.1% at twice its NICs' speed,
a gap of the search, not of the warm-up pass)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from megatron_autohet.cost_model import evaluate_plan
from megatron_autohet.planner.branch_and_bound import PRUNE_TOLERANCE
from megatron_autohet.planner.search import search
from megatron_autohet.planner.space import resolve_profile
from megatron_autohet.spec import load_model
from megatron_autohet.spec.cluster import Cluster, cluster_from_dict
from megatron_autohet.testing.random_fleets import odd_case, random_case

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
# Rounding of the cost model's sums, far below any plan difference.
SLACK = 1e-9


def four_types(nic_gbs: float) -> Cluster:
    return cluster_from_dict({"name": "four-types", "inter_node_bandwidth_gbs": nic_gbs,
                              "nodes": [{"name": gpu.lower(), "gpu": gpu, "gpus": 8}
                                        for gpu in ("A100-80GB", "H800", "H20", "L40S")]})


def faster_nics(cluster: Cluster, factor: float) -> Cluster:
    """The cluster with every node's NIC ``factor`` times as fast."""
    return dataclasses.replace(cluster, nodes=tuple(
        dataclasses.replace(n, inter_node_bandwidth_gbs=n.inter_node_bandwidth_gbs * factor)
        for n in cluster.nodes))


def assert_monotone(fleets: list[Cluster], model, global_batch_size: int,
                    micro_batch_size: int, repriced: bool = False, **space) -> list[float]:
    """Search each fleet (slowest links first); the predicted times, checked (``repriced``:
    against the previous fleet's plan priced here too)."""
    times, previous = [], None
    for cluster in fleets:
        # (the work budget alone ends the search, whatever the machine's load)
        found = search(cluster, model, None, global_batch_size, micro_batch_size,
                       progress=False, time_limit_s=3600, **space)
        now = found.cost.iteration_time_s
        if previous is not None:
            assert now <= times[-1] * (1 + SLACK), f"{cluster.name}: {times[-1]} -> {now}"
        if previous is not None and repriced:
            profile = resolve_profile(cluster, model, None, micro_batch_size, model.seq_length)
            slower_plan = evaluate_plan(previous.plan, cluster, profile,
                                        with_timeline=False).iteration_time_s
            assert now <= slower_plan * (1 + PRUNE_TOLERANCE), \
                f"{cluster.name}: the slower links' plan runs {slower_plan} here, ours {now}"
        times.append(now)
        previous = found
    return times


def test_four_types_of_8_gpu_nodes():
    """The case found: warming up the search's best alone planned 0.3049 s at 25 GB/s and
    0.3121 s at 50 GB/s (the 25 GB/s plan runs 0.2996 s there)."""
    model = dataclasses.replace(load_model(ROOT / "configs/models/gpt3-1.3b.yaml"),
                                num_layers=30)
    times = assert_monotone([four_types(nic) for nic in (12.5, 25, 50)], model, 64, 1,
                            repriced=True)
    assert times[2] < 0.3


@pytest.mark.parametrize("make_case, seed", [(random_case, s) for s in range(4)]
                         + [(odd_case, s) for s in range(4)])
def test_random_small_fleets(make_case, seed):
    case = make_case(seed)
    assert_monotone([faster_nics(case.cluster, f) for f in (1, 2, 4)], case.model,
                    case.global_batch_size, case.micro_batch_size, **case.space())
