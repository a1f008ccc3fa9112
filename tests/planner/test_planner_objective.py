"""The planner's objectives (planner/objective.py): what each ranks plans by, whether a plan
meets it, which arguments it takes, how a plan file records it and how the prediction says it.
The searches they run are tested with the searches (test_planner*.py, test_cost_objective.py)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from megatron_autohet import plan as plan_file
from megatron_autohet.errors import ConfigError
from megatron_autohet.plan import plan_from_dict
from megatron_autohet.planner.objective import (OBJECTIVES, THROUGHPUT, Cost, ObjectiveNotKept,
                                                Throughput, floor_objectives, objective_named,
                                                objective_of)
from megatron_autohet.spec import load_cluster

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "configs" / "plans" / "tiny-two-pipelines.yaml"


def cost(iteration_time_s: float, usd_per_million_tokens: float, tokens_per_s: float):
    """The fields of a PlanCost the objectives read."""
    return SimpleNamespace(iteration_time_s=iteration_time_s, tokens_per_s=tokens_per_s,
                           usd_per_million_tokens=usd_per_million_tokens)


def test_the_registry_is_the_plan_files_vocabulary():
    """plan.py validates the names (and which take a floor) without importing the planner, and
    the CLI offers them from there: one class per name, the default first."""
    assert tuple(OBJECTIVES) == plan_file.OBJECTIVES
    assert tuple(floor_objectives()) == plan_file.FLOOR_OBJECTIVES
    assert OBJECTIVES[plan_file.DEFAULT_OBJECTIVE] is Throughput
    assert all(OBJECTIVES[name].name == name for name in OBJECTIVES)
    with pytest.raises(ConfigError, match="field 'objective': got 'speed' .allowed: "
                                          "throughput, cost."):
        objective_named("speed")


def test_throughput_ranks_by_iteration_time_and_takes_no_floor():
    fast, slow = cost(1.0, 9.0, 100.0), cost(2.0, 1.0, 50.0)
    assert THROUGHPUT.score(fast) < THROUGHPUT.score(slow)
    assert THROUGHPUT.rank(fast) < THROUGHPUT.rank(slow)
    assert THROUGHPUT.meets(slow) and not Throughput.priced
    with pytest.raises(ConfigError, match="field 'min_tokens_per_s': got 10.0 with objective "
                                          "'throughput'"):
        Throughput.from_arguments(min_tokens_per_s=10.0)
    with pytest.raises(ConfigError, match="field 'max_searches': got 2 with objective"):
        Throughput.from_arguments(max_searches=2)


def test_cost_ranks_by_price_then_speed_above_its_floor():
    floor = Cost.from_arguments(min_tokens_per_s=80.0)
    cheap_slow, dear_fast = cost(2.0, 1.0, 50.0), cost(1.0, 9.0, 100.0)
    assert floor.score(cheap_slow) < floor.score(dear_fast)
    assert floor.rank(cost(2.0, 1.0, 90.0)) > floor.rank(cost(1.0, 1.0, 90.0))  # tie: faster
    assert not floor.meets(cheap_slow) and floor.meets(dear_fast)
    assert Cost().meets(cheap_slow)                     # no floor: every plan
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ConfigError, match="field 'min_tokens_per_s'"):
            Cost.from_arguments(min_tokens_per_s=bad)
    with pytest.raises(ConfigError, match="field 'max_searches': got 0"):
        Cost.from_arguments(max_searches=0)
    assert Cost.from_arguments(80.0, 3).arguments() == {
        "objective": "cost", "min_tokens_per_s": 80.0, "max_searches": 3}


def test_the_plan_file_records_the_objective_and_reads_it_back():
    data = yaml.safe_load(EXAMPLE.read_text())
    plan = plan_from_dict(data)
    assert objective_of(plan) == THROUGHPUT and "objective" not in plan.to_dict()
    Cost(1500.0).record(plan)
    again = plan_from_dict(plan.to_dict())
    assert objective_of(again) == Cost(1500.0)
    THROUGHPUT.record(again)
    assert "objective" not in again.to_dict() and "min_tokens_per_s" not in again.to_dict()


def test_the_prediction_says_the_cost_objective_and_whether_it_is_reached():
    assert THROUGHPUT.describe({"tokens_per_s": 10.0}) is None
    assert Cost().describe({"tokens_per_s": 10.0}) == "the fewest USD per million tokens"
    assert Cost(1000.0).describe({"tokens_per_s": 999.96}) == (
        "the fewest USD per million tokens at 1,000 tokens/s or more")
    assert Cost(1000.0).describe({"tokens_per_s": 990.0}).endswith(" (NOT REACHED by this plan)")


def test_a_fleet_without_prices_cannot_keep_the_cost_objective():
    """The re-plan's search (replan.py) is the objective's; without a price on every node the
    cost objective is not kept, before any search runs."""
    unpriced = load_cluster(ROOT / "configs/clusters/local-4.yaml")

    def search(**arguments):
        raise AssertionError("no search without prices")

    with pytest.raises(ObjectiveNotKept, match="has no price; the plan's objective cost needs "
                                               "one.*: the fastest plan instead of the cheapest"):
        Cost(1000.0).replan_search(unpriced, "local-4.yaml", search)
    assert THROUGHPUT.replan_search(unpriced, "local-4.yaml", lambda **a: a) == {
        "objective": "throughput"}
