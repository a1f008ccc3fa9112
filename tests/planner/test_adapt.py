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
from megatron_autohet.planner.adapt import (DEFAULT_SWITCH_OVERHEAD_S, Adapter, Replan,
                                            amortised_gain, plan_fleet, switch_cost)
from megatron_autohet.planner.search import make_plan
from megatron_autohet.profiling.from_run import (find_stragglers, measured_speeds,
                                                 priced_entries, profile_from_window)
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


def _judge(adapter, window, current=1.0, new=0.8, switch=10.0, remaining=1000):
    return adapter.judge((window, window), current, new, switch, switch, 1, remaining)


def test_a_gain_that_does_not_pay_back_in_the_iterations_left_is_declined():
    # 20% faster per iteration, a 100 s switch: 1000 iterations of 1 s pay it back, 400 do not
    assert amortised_gain(1.0, 0.8, 100.0, 1000) == pytest.approx(0.1)
    assert amortised_gain(1.0, 0.8, 100.0, 400) == pytest.approx(-0.05)
    assert amortised_gain(1.0, 0.8, 100.0, 0) == 0.0
    short, long = Adapter(), Adapter()
    for w in (1, 2, 3):
        declined = short.judge((w, w), 1.0, 0.8, 100.0, 100.0, 1, 400)
        assert not declined.switch and declined.why.startswith("declined")
        assert declined.predicted_gain == pytest.approx(0.2)
        assert declined.amortised_gain == pytest.approx(-0.05)
    assert [long.judge((w, w), 1.0, 0.8, 100.0, 100.0, 1, 1000).switch
            for w in (1, 2)] == [False, True]


def test_a_gain_must_hold_two_windows_and_no_switch_within_k_windows_of_the_last():
    adapter = Adapter(hold_windows=3)
    first = _judge(adapter, 1)
    assert not first.switch and "second window" in first.why
    # a window without the gain resets the confirmation
    assert not _judge(adapter, 2, new=1.0).switch
    assert not _judge(adapter, 3).switch
    assert _judge(adapter, 4).switch
    # windows 5-7 are held, whatever the gain; window 8 switches (the gain held in 7 and 8)
    held = [_judge(adapter, w) for w in (5, 6, 7)]
    assert [d.switch for d in held] == [False] * 3
    assert all(d.why.startswith("hold") for d in held)
    assert _judge(adapter, 8).switch
    # below the threshold is never a switch
    small = Adapter(threshold=0.05)
    assert not any(_judge(small, w, new=0.97, switch=0.0).switch for w in range(1, 5))


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
        decision = adapter.consider(current, fleet, profile, 1000, (1 + 20 * w, 20 + 20 * w),
                                    stragglers)
        decisions.append(decision)
        if w == 0:
            assert [(s.node, s.local_rank) for s in stragglers] == [SLOW]
            assert stragglers[0].ratio == pytest.approx(2.0)
            assert decision.predicted_gain > 0.2
        if decision.switch:
            current = decision.plan
    assert [d.switch for d in decisions] == [False, True] + [False] * 6
    assert decisions[1].switch_cost_s > 0 and decisions[1].moved_bytes > 0
    # the switch moved work off the slowed GPU
    assert _work_on(current, *SLOW) < 0.6 * _work_on(plan, *SLOW)
    # and then the same windows again and again: the re-plan finds the plan it runs
    for d in decisions[2:]:
        assert d.why == "no faster plan" and d.predicted_gain == pytest.approx(0, abs=1e-9)
    assert "SWITCH" in decisions[1].line() and "re-plan search" in decisions[1].line()
    message, fields = decisions[1].event()
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
    back = [adapter.consider(current, plan_fleet(current, CATALOG, FLEET, speeds), profile, 1000,
                             (w, w)) for w in (9, 10)]
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
    assert "gain seen once" in measured.why
    assert "the switch after iteration 6 measured 3.5 s" in measured.line()
    fields = measured.event()[1]
    assert (fields["switch_overhead_s"], fields["switch_overhead_measured_at"],
            fields["window"], fields["decided_at"]) == (3.5, 6, [1, 2], 8)

    # a switch faster than its priced moves: no negative fixed part
    adapter.switch_measured(10, seconds=1.0, move_s=4.0)
    assert adapter.fixed_switch_s == 0.0
    assert adapter.decide(replace(found, same_layout=True), 100).switch_cost_s == 0.0
