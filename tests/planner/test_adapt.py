"""Adaptive re-planning's decision (planner/adapt.py): the amortisation of a switch's cost over
the iterations left, the switch's fixed part priced at the last switch measured, the hysteresis
(no switch within K windows of the last, a gain held for two windows), a steady fleet corrected
once, and a straggler's work moved off it. Windows are
synthetic (the cost model's stage times on a fleet with a slowed GPU, tests/helpers/windows.py),
never the wall clock."""

from __future__ import annotations

from dataclasses import asdict, replace

import pytest

from helpers.windows import synthetic_window
from megatron_autohet.cost_model import evaluate_plan
from megatron_autohet.planner.adapt import (DEFAULT_SWITCH_OVERHEAD_S, Adapter, Replan,
                                            amortised_gain, plan_fleet, replan_window,
                                            switch_cost)
from megatron_autohet.planner.search import make_plan
from megatron_autohet.planner.space import resolve_profile
from megatron_autohet.profiling.from_run import (find_stragglers, measured_speeds,
                                                 priced_entries, profile_from_window)
from megatron_autohet.profiling.profile import Profile
from megatron_autohet.spec.cluster import cluster_from_dict
from megatron_autohet.spec.gpus import load_gpu_catalog
from megatron_autohet.spec.model import load_model
from megatron_autohet.spec.precision import PRECISIONS

pytestmark = pytest.mark.unit

CATALOG = load_gpu_catalog()
MODEL = load_model("configs/models/gpt3-350m.yaml")
FLEET = cluster_from_dict({"name": "four", "inter_node_bandwidth_gbs": 25, "nodes": [
    {"name": "a", "gpu": "A100-80GB", "gpus": 1, "count": 4}]})
SLOW = ("a-1", 0)


def _judge(adapter, window, current=1.0, new=0.8, switch=10.0, remaining=1000, held=0.8):
    """One window's figures, the same re-plan priced at ``held`` on the next window (None:
    none measured); records whether the decision asked for the confirmation."""
    asked = []

    def confirm():
        asked.append(window)
        return (window + 1, window + 1), (current - held) / current - switch / (
            remaining * current)
    decision = adapter.judge((window, window), current, new, switch, switch, 1, remaining,
                             held=None if held is None else confirm)
    return decision, bool(asked)


def test_a_gain_that_does_not_pay_back_in_the_iterations_left_is_declined():
    # 20% faster per iteration, a 100 s switch: 1000 iterations of 1 s pay it back, 400 do not
    assert amortised_gain(1.0, 0.8, 100.0, 1000) == pytest.approx(0.1)
    assert amortised_gain(1.0, 0.8, 100.0, 400) == pytest.approx(-0.05)
    assert amortised_gain(1.0, 0.8, 100.0, 0) == 0.0
    short, long = Adapter(), Adapter()
    for w in (1, 2, 3):
        declined, asked = _judge(short, w, switch=100.0, remaining=400)
        assert not declined.switch and declined.why.startswith("declined") and not asked
        assert declined.predicted_gain == pytest.approx(0.2)
        assert declined.amortised_gain == pytest.approx(-0.05)
    assert _judge(long, 1, switch=100.0)[0].switch


def test_a_gain_must_hold_two_windows_and_no_switch_within_k_windows_of_the_last():
    adapter = Adapter(hold_windows=3)
    # the gain of window 1 that the next window does not confirm (its re-plan priced there is
    # no faster): kept, and the next window's own search starts afresh
    first, asked = _judge(adapter, 1, held=1.0)
    assert not first.switch and asked and first.why.startswith("gain did not hold: +19.0% "
                                                               "amortised, -1.0% on iterations 2-2")
    # no next window measured: nothing switches on one window's gain
    alone, asked = _judge(adapter, 2, held=None)
    assert not alone.switch and "must hold for a second" in alone.why
    # a window without the gain asks for no confirmation
    assert _judge(adapter, 3, new=1.0) == (_judge(Adapter(), 3, new=1.0)[0], False)
    switched, asked = _judge(adapter, 4)
    assert switched.switch and asked and switched.why == (
        "+19.0% amortised gain held two windows, +19.0% on iterations 5-5")
    # windows 5-7 are held, whatever the gain, and price no confirmation; window 8 switches
    held = [_judge(adapter, w) for w in (5, 6, 7)]
    assert [(d.switch, asked) for d, asked in held] == [(False, False)] * 3
    assert all(d.why.startswith("hold") for d, _ in held)
    assert _judge(adapter, 8)[0].switch
    # below the threshold is never a switch
    small = Adapter(threshold=0.05)
    assert not any(_judge(small, w, new=0.97, switch=0.0, held=0.97)[0].switch
                   for w in range(1, 5))


def _measure(plan, first):
    """The window ``plan`` measures on the fleet with a-1 at half speed, and what the decision
    takes from it: the fleet with the measured speeds, the measured profile, the stragglers."""
    window = synthetic_window(plan, FLEET.with_speeds({SLOW: 0.5}), first, first + 19)
    priors = priced_entries(plan, CATALOG)
    speeds = measured_speeds(plan, window.stages, priors)
    profile = profile_from_window(plan, window.stages, priors, precision=PRECISIONS["bf16"],
                                  attention="flash", fusions=None, speeds=speeds)
    return (plan_fleet(plan, CATALOG, FLEET, speeds), profile,
            tuple(find_stragglers(plan, window.stages, priors)))


def _work_on(plan, node, local_rank):
    """Layer passes per iteration of the stage holding this GPU (0: idle)."""
    for info in plan.ranks:
        if (info.node, info.local_rank) == (node, local_rank):
            for pipe in plan.pipelines:
                for stage in pipe.stages:
                    if info.rank in stage.ranks:
                        return stage.num_layers * pipe.num_microbatches
    return 0


def test_a_straggler_has_work_moved_off_it_and_a_steady_fleet_switches_once():
    plan = make_plan(FLEET, MODEL, None, 64, 1, 2048, progress=False)
    adapter = Adapter(overhead_s=0.0)
    current, decisions = plan, []
    for w in range(8):
        fleet, profile, stragglers = _measure(current, 1 + 20 * w)
        # the next window measures the same plan on the same fleet: it confirms the gain
        confirm_on = _measure(current, 21 + 20 * w)[:2] + ((21 + 20 * w, 40 + 20 * w),)
        decision = adapter.consider(current, fleet, profile, 1000, (1 + 20 * w, 20 + 20 * w),
                                    stragglers, confirm_on=confirm_on)
        decisions.append(decision)
        if w == 0:
            assert [(s.node, s.local_rank) for s in stragglers] == [SLOW]
            assert stragglers[0].ratio == pytest.approx(2.0)
            assert decision.predicted_gain > 0.2
        if decision.switch:
            current = decision.plan
    assert [d.switch for d in decisions] == [True] + [False] * 7
    assert decisions[0].why.endswith("on iterations 21-40")
    assert decisions[0].switch_cost_s > 0 and decisions[0].moved_bytes > 0
    # the switch moved work off the slowed GPU
    assert _work_on(current, *SLOW) < 0.6 * _work_on(plan, *SLOW)
    # and then the same windows again and again: the re-plan finds the plan it runs
    for d in decisions[1:]:
        assert d.why == "no faster plan" and d.predicted_gain == pytest.approx(0, abs=1e-9)
    assert "SWITCH" in decisions[0].line() and "re-plan search" in decisions[0].line()
    message, fields = decisions[0].event()
    assert fields["switch"] and fields["stragglers"][0]["node"] == "a-1"
    assert switch_cost(current, current, FLEET) == (0.0, 0)
    # the GPU recovers: the next window prices it back at its type's speed, and the re-plan
    # gives it its share of the work again (after the hold and a second window)
    healthy = synthetic_window(current, FLEET, 161, 180)
    priors = priced_entries(current, CATALOG)
    speeds = measured_speeds(current, healthy.stages, priors)
    assert speeds[SLOW] == 1.0 and plan_fleet(current, CATALOG, FLEET, speeds).speeds == {}
    profile = profile_from_window(current, healthy.stages, priors, precision=PRECISIONS["bf16"],
                                  attention="flash", fusions=None, speeds=speeds)
    healed = plan_fleet(current, CATALOG, FLEET, speeds)
    back = [adapter.consider(current, healed, profile, 1000, (161, 180), confirm_on=confirm)
            for confirm in (None, (healed, profile, (181, 200)))]
    assert [d.switch for d in back] == [False, True]
    assert _work_on(back[1].plan, *SLOW) > _work_on(current, *SLOW)


def test_a_measured_switch_prices_the_later_ones():
    """Before any switch the fixed part is the guess (30 s); after one, what it measured beyond
    its own priced state moves (injected here as plan_switch.py reports it), carried to the
    next generation's deciding rank as plain fields, and a re-plan that is the running plan
    costs nothing."""
    found = Replan(window=(1, 2), plan=None, same_layout=False, current=1.0, new=0.8,
                   move_s=2.0, moved_bytes=10, usd_per_second=None, search_s=0.0)
    adapter = Adapter()
    guessed = adapter.decide(found, 100, decided_at=4)
    assert guessed.switch_cost_s == pytest.approx(DEFAULT_SWITCH_OVERHEAD_S + 2.0)
    assert guessed.why.startswith("declined") and guessed.overhead_measured_at is None
    assert "(decided after iteration 4)" in guessed.line()
    assert "30 s fixed, no switch measured yet" in guessed.line()

    adapter.switch_measured(6, seconds=5.0, move_s=1.5)
    handed_over = Adapter(**asdict(adapter))
    for a in (adapter, handed_over):
        assert a.fixed_switch_s == pytest.approx(3.5)
    measured = handed_over.decide(found, 100, decided_at=8)
    assert measured.switch_cost_s == pytest.approx(3.5 + 2.0)
    # (100 * 0.2 - 5.5) / 100: the measured switch pays back where the guess did not
    assert measured.amortised_gain == pytest.approx(0.145)
    assert "must hold for a second" in measured.why
    assert "the switch after iteration 6 measured 3.5 s" in measured.line()
    fields = measured.event()[1]
    assert (fields["switch_overhead_s"], fields["switch_overhead_measured_at"],
            fields["window"], fields["decided_at"]) == (3.5, 6, [1, 2], 8)

    # a switch faster than its priced moves: no negative fixed part
    adapter.switch_measured(10, seconds=1.0, move_s=4.0)
    assert adapter.fixed_switch_s == 0.0
    assert adapter.decide(replace(found, same_layout=True), 100).switch_cost_s == 0.0


def test_the_fleet_of_a_re_plan_keeps_the_cluster_files_zones():
    """An elastic job's cluster file with zones: the fleet a re-plan prices is in the same
    zones, with the same links and regions, so a plan across zones costs what it was planned
    at (its egress and the slower link between zones); a node the file does not know leaves
    the fleet one zone."""
    zoned = cluster_from_dict({
        "name": "two-zones", "inter_node_bandwidth_gbs": 25,
        "zones": {"us-east-1a": "us-east-1", "us-east-1b": "us-east-1"},
        "links": {"inter_zone": {"egress_usd_per_gb": 0.02}},
        "nodes": [{"name": "a", "gpu": "A100-80GB", "gpus": 1, "count": 2, "spot_price": 1.6,
                   "zone": "us-east-1a"},
                  {"name": "b", "gpu": "A100-80GB", "gpus": 1, "count": 2, "spot_price": 1.6,
                   "zone": "us-east-1b"}]})
    # planned as if one zone, so the plan crosses between the two
    plan = make_plan(zoned.without_zones(), MODEL, None, 64, 1, 2048, progress=False)
    assert len({zoned.node(r.node).zone for r in plan.ranks}) == 2
    fleet = plan_fleet(plan, CATALOG, zoned)
    assert [(n.name, n.zone) for n in fleet.nodes] == [(n.name, n.zone) for n in zoned.nodes]
    assert (fleet.regions, fleet.links) == (zoned.regions, zoned.links)
    profile = resolve_profile(zoned, MODEL, None, plan.micro_batch_size, plan.seq_length)
    there = evaluate_plan(plan, zoned, profile, with_timeline=False)
    here = evaluate_plan(plan, fleet, profile, with_timeline=False)
    assert here.egress_usd_per_iteration == there.egress_usd_per_iteration > 0
    assert here.iteration_time_s == there.iteration_time_s
    # the template lacks a node of the plan (another name, another type): no zones at all
    other = cluster_from_dict({"name": "one", "inter_node_bandwidth_gbs": 25, "zones": {
        "us-east-1a": "us-east-1"}, "nodes": [{"name": "h", "gpu": "H800", "gpus": 1,
                                               "zone": "us-east-1a"}]})
    lone = plan_fleet(plan, CATALOG, other)
    assert lone.regions == {} and all(n.zone is None for n in lone.nodes)


def test_what_an_idle_gpu_measured_of_itself_prices_its_type_in_the_re_plan():
    """A plan on two A100s of a cluster that also holds an H20 (``--cluster``): a window
    measures only the GPUs that train, so without the H20's own measurement the re-plan prices
    it on the estimate, however wrong. Measured 4x faster than that (plan_switch.py
    ``measure_idle_gpu``, injected here as its profile), the re-plan gives it more work."""
    a100s = cluster_from_dict({"name": "two", "inter_node_bandwidth_gbs": 25, "nodes": [
        {"name": "a", "gpu": "A100-80GB", "gpus": 1, "count": 2}]})
    cluster = cluster_from_dict({"name": "three", "inter_node_bandwidth_gbs": 25, "nodes": [
        {"name": "a", "gpu": "A100-80GB", "gpus": 1, "count": 2},
        {"name": "h", "gpu": "H20", "gpus": 1}]})
    plan = make_plan(a100s, MODEL, None, 64, 1, 2048, progress=False)
    window = synthetic_window(plan, a100s, 1, 20)
    priors = priced_entries(plan, CATALOG)
    estimate = resolve_profile(cluster, MODEL, None, 1, 2048).get("H20", 1, 1, 2048)
    idle = Profile(MODEL.name, precision=PRECISIONS["bf16"], attention="flash")
    idle.add(estimate.scaled(0.25, source="measured"))
    inputs = dict(catalog=CATALOG, precision=PRECISIONS["bf16"], attention="flash",
                  fusions=None, template=cluster, with_idle=True)
    blind = replan_window(plan, window.stages, (1, 20), priors, **inputs)
    seen = replan_window(plan, window.stages, (1, 20), priors, **inputs, idle_measured=idle)
    assert _work_on(seen.plan, "h", 0) > _work_on(blind.plan, "h", 0)
    assert seen.new < blind.new
    # another precision's measurement is left out, not merged into the window's
    fp32 = Profile(MODEL.name, precision=PRECISIONS["fp32"], attention="flash",
                   entries=dict(idle.entries))
    assert replan_window(plan, window.stages, (1, 20), priors, **inputs,
                         idle_measured=fp32).plan.to_dict() == blind.plan.to_dict()
