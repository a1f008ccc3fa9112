"""The planner's deterministic work budget, the cost objective, calibrated estimates and the
baselines' pruning bound."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from pathlib import Path

import pytest

from megatron_autohet.cli.main import main
from megatron_autohet.cost_model import CHARGES, evaluate_plan
from megatron_autohet.errors import ConfigError
from megatron_autohet.planner.baselines import (_best, _grid_bound_s, _grids, _proportional,
                                                grid_plan)
from megatron_autohet.testing.exhaustive import exhaustive_search
from megatron_autohet.planner.scip_model import SOLVE_TIME_SAFETY_S
from megatron_autohet.planner import candidate  # the safety net's clock
from megatron_autohet.planner.candidate import STOP_TIME, STOP_WORK
from megatron_autohet.planner.search import search
from megatron_autohet.planner.space import Problem, evaluate, resolve_profile
from megatron_autohet.profiling.estimate import estimate_profile
from megatron_autohet.profiling.profile import Profile
from megatron_autohet.spec import load_model
from megatron_autohet.spec.cluster import cluster_from_dict

pytestmark = pytest.mark.integration


ROOT = Path(__file__).resolve().parents[2]
GPT = load_model(ROOT / "configs/models/gpt3-1.3b.yaml")
GPT4 = dataclasses.replace(GPT, num_layers=4)


def fleet(nodes, name="c"):
    return cluster_from_dict({"name": name, "inter_node_bandwidth_gbs": 25, "nodes": [
        dict(name=f"n{i}", gpu=g, gpus=n, **({} if p is None else {"spot_price": p}))
        for i, (g, n, p) in enumerate(nodes)]})


THREE_TYPES = fleet([("A100-80GB", 8, 1.6), ("H800", 8, 2.9), ("H20", 8, 1.2)], "three")


# ---- deterministic budget ------------------------------------------------------------------------

def test_work_budget_binds_before_any_wall_clock_limit(monkeypatch):
    """The same input with a short and a huge wall-clock limit gives the same plan when the work
    budget binds first. The clock stands still (no wall-clock limit can cut), so what could
    still differ is anything in the search that reads its time limit otherwise. (A SCIP solve
    gets at most the time the search has left, which is only less than its own safety net
    within SOLVE_TIME_SAFETY_S of the limit, when the search is being cut anyway.)"""
    monkeypatch.setattr(candidate, "clock", lambda: 0.0)
    plans = []
    for limit in (SOLVE_TIME_SAFETY_S, 1e9):
        cand = search(THREE_TYPES, GPT, None, 64, 1, progress=False, time_limit_s=limit,
                      work_budget=5)
        assert cand.stopped_by == STOP_WORK
        plans.append(cand.plan.to_dict())
    assert plans[0] == plans[1]
    full = search(THREE_TYPES, GPT, None, 64, 1, progress=False)
    assert full.work > 5            # the budget did bind


def test_time_limit_is_a_safety_net_that_says_when_it_cuts(monkeypatch, capsys, tmp_path):
    """A machine so loaded that each clock reading is a second later: the 5-second safety net
    cuts the search, and `autohet plan` says the plan may differ on a faster machine."""
    ticks = itertools.count()
    monkeypatch.setattr(candidate, "clock", lambda: float(next(ticks)))
    cand = search(THREE_TYPES, GPT, None, 64, 1, progress=False, time_limit_s=5)
    assert cand.stopped_by == STOP_TIME
    rc = main(["plan", "--cluster", str(ROOT / "configs/clusters/a100-h800-h20.yaml"),
               "--model", str(ROOT / "configs/models/gpt3-1.3b.yaml"), "--global-batch-size",
               "64", "--time-limit", "5", "-o", str(tmp_path / "plan.yaml")])
    assert rc == 0
    assert "cut by --time-limit before its work budget" in capsys.readouterr().out


# ---- baselines -----------------------------------------------------------------------------------

@pytest.mark.parametrize("proportional", [False, True])
def test_baseline_bound_prunes_no_winner(proportional):
    """The baselines evaluate only grids whose closed-form bound beats the best so far: the
    bound is below every grid's iteration time, and the result equals evaluating every grid."""
    cluster = fleet([("A100-80GB", 8, None), ("V100-32GB", 8, None), ("T4", 4, None)])
    profile = resolve_profile(cluster, GPT, None, 1, GPT.seq_length)
    problem = Problem(cluster, GPT, profile, 96, 1, GPT.seq_length)
    M = problem.num_microbatches
    best = math.inf
    for tp, pp, dp in _grids(problem, None, None):
        if dp > M or (not proportional and M % dp):
            continue
        for recompute in (False, True):
            plan = grid_plan(problem, tp, pp, dp, _proportional([1.0] * dp, M), recompute)
            cost = evaluate(problem, plan)
            if proportional:
                speeds = [1 / max(s.time_s + s.p2p_s for s in p.stages) for p in cost.pipelines]
                cost = evaluate(problem, grid_plan(problem, tp, pp, dp,
                                                   _proportional(speeds, M), recompute))
            assert _grid_bound_s(problem, tp, pp, dp, recompute, proportional) <= \
                cost.iteration_time_s
            if cost.fits_memory:
                best = min(best, cost.iteration_time_s)
    found = _best(problem, "b", proportional, [False, True])
    assert found.cost.iteration_time_s == pytest.approx(best, rel=1e-12)


# ---- cost objective ------------------------------------------------------------------------------

@pytest.mark.parametrize("nodes", [
    [("A100-80GB", 2, 1.0), ("V100-32GB", 2, 3.0)],
    [("H800", 2, 2.9), ("A100-80GB", 2, 1.6), ("T4", 2, 0.9)],
    [("A100-80GB", 4, 1.6), ("H20", 2, 1.2)],
])
def test_cost_objective_matches_exhaustive_and_leaves_nodes_out(nodes):
    """Per node and per GPU, without a floor and at 90% of the fastest plan's throughput: the
    search's cheapest plan costs what the brute force's does (per node the node-set enumeration,
    per GPU the thinned throughput plans, planner/cost_search.py)."""
    cluster = fleet(nodes)
    space = dict(tp_degrees=[1, 2], max_stages=4)
    fastest = search(cluster, GPT4, None, 16, 1, progress=False, **space)
    for charge, floor in itertools.product(CHARGES, (None, 0.9 * fastest.cost.tokens_per_s)):
        objective = dict(objective="cost", charge=charge, min_tokens_per_s=floor)
        ours = search(cluster, GPT4, None, 16, 1, progress=False, virtual_stages=False,
                      **objective, **space)
        best = exhaustive_search(cluster, GPT4, None, 16, 1, **objective, **space)
        assert ours.cost.usd_per_million_tokens == pytest.approx(
            best.cost.usd_per_million_tokens, rel=1e-9), (charge, floor)
        assert ours.cost.tokens_per_s >= (floor or 0)
        if charge == "per-gpu" and floor is None:
            fast = evaluate_plan(fastest.plan, cluster, resolve_profile(cluster, GPT4, None, 1,
                                                                        GPT4.seq_length),
                                 charge=charge)
            assert ours.cost.usd_per_million_tokens < fast.usd_per_million_tokens
            assert ours.cost.idle_gpus       # some GPUs left out for their price


def test_cost_objective_needs_every_price(capsys):
    # (an L4 node: a V100 node is left out of a bf16 plan, priced or not)
    cluster = fleet([("A100-80GB", 2, 1.0), ("L4", 2, None)])
    with pytest.raises(ConfigError, match=r"nodes\[1\]\.spot_price"):
        search(cluster, GPT4, None, 16, 1, progress=False, objective="cost")


def test_compare_prints_price_per_million_tokens(capsys):
    args = ["compare", "--cluster", str(ROOT / "configs/clusters/a100-h800-h20.yaml"),
            "--model", str(ROOT / "configs/models/tiny.yaml"), "--global-batch-size", "8"]
    assert main(args) == 0
    assert "$/1M tokens" in capsys.readouterr().out
    assert main(args + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    prices = [data["autohet"]["usd_per_million_tokens"]] + [
        b["usd_per_million_tokens"] for b in data["baselines"]]
    assert all(p is not None and p > 0 for p in prices)


# ---- calibration ---------------------------------------------------------------------------------

def test_estimates_are_calibrated_by_measured_types():
    """A100 measured 2x slower forward and 3x slower backward than its datasheet estimate: the
    unmeasured H20 estimate is scaled the same way per part, and the plan says which figures
    were measured and which calibrated."""
    cluster = fleet([("A100-80GB", 2, None), ("H20", 2, None)])
    seq = GPT4.seq_length
    estimate = estimate_profile(GPT4, cluster, 1, seq)
    measured = Profile(GPT4.name)
    for key, entry in estimate.entries.items():
        if entry.gpu == "A100-80GB" and entry.tp == 1:
            measured.add(dataclasses.replace(entry, **{
                part: dataclasses.replace(getattr(entry, part),
                                          forward_s=2 * getattr(entry, part).forward_s,
                                          backward_s=3 * getattr(entry, part).backward_s,
                                          source="measured")
                for part in ("layer", "embedding", "output")}))
    resolved = resolve_profile(cluster, GPT4, measured, 1, seq)
    for tp in (1, 2):
        h20, raw = resolved.get("H20", tp, 1, seq), estimate.get("H20", tp, 1, seq)
        assert h20.layer.source == "calibrated"
        assert h20.layer.forward_s == pytest.approx(2 * raw.layer.forward_s)
        assert h20.output.backward_s == pytest.approx(3 * raw.output.backward_s)
        assert h20.layer.activation_bytes == raw.layer.activation_bytes
    a100 = resolved.get("A100-80GB", 2, 1, seq)      # the measured type, another TP degree
    assert a100.layer.source == "calibrated"
    assert a100.embedding.forward_s == pytest.approx(
        2 * estimate.get("A100-80GB", 2, 1, seq).embedding.forward_s)
    cand = search(cluster, GPT4, measured, 16, 1, progress=False, tp_degrees=[1])
    sources = cand.plan.predicted["profile_sources"]
    assert {parts["layer"] for parts in sources.values()} <= {"measured", "calibrated"}
    if "A100-80GB tp1" in sources:
        assert sources["A100-80GB tp1"]["layer"] == "measured"
    # Without measurements nothing is calibrated.
    plain = resolve_profile(cluster, GPT4, Profile(GPT4.name), 1, seq)
    assert {e.layer.source for e in plain.entries.values()} == {"estimated"}
