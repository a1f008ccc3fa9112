"""A plan made with the cost objective keeps it across re-plans (planner/replan.py, "The cost
objective"): the re-plan is the cheapest plan reaching the plan's floor, compared in USD per
million tokens, and where the fleet now present cannot keep the objective it is the fastest plan
with the reason said; the new plan records the objective either way. The planner's re-plan,
`autohet replan` and the elastic worker's re-plan, which have none of `autohet plan`'s flags.

The fleet: two 8-GPU nodes each of A100 and H800 and one of H20, with prices; GPT-3 1.3B,
global batch 512. Every figure is the cost model's (no training)."""

import dataclasses
import json

import pytest

from megatron_autohet.cli.main import main
from megatron_autohet.plan import load_plan
from megatron_autohet.planner import objective as objective_module
from megatron_autohet.planner.replan import least_moving, replan
from megatron_autohet.planner.candidate import STOP_SETS, Candidate
from megatron_autohet.planner.cost_search import usd_per_million_tokens
from megatron_autohet.planner.search import search
from megatron_autohet.planner.state_moves import StateMap
from megatron_autohet.spec import load_cluster, load_model
from megatron_autohet.spec.gpus import CONFIG_DIR

pytestmark = pytest.mark.integration      # searches of about a second

GPT_FILE = CONFIG_DIR / "models/gpt3-1.3b.yaml"
GPT = load_model(GPT_FILE)
GBS = 512
NODES = {"a100-1": ("A100-80GB", 1.6), "a100-2": ("A100-80GB", 1.6), "h800-1": ("H800", 2.9),
         "h800-2": ("H800", 2.9), "h20": ("H20", 1.2)}


def fleet_file(path, names, unpriced=()):
    lines = ["name: priced-5", "inter_node_bandwidth_gbs: 25", "nodes:"]
    for name in names:
        gpu, price = NODES[name]
        lines.append(f"  - {{name: {name}, gpu: {gpu}, gpus: 8"
                     + ("}" if name in unpriced else f", spot_price: {price}}}"))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    return load_cluster(fleet_file(tmp_path_factory.mktemp("fleet") / "fleet.yaml", NODES))


@pytest.fixture(scope="module")
def fastest(fleet):
    return search(fleet, GPT, None, GBS, 1, progress=False)


@pytest.fixture(scope="module")
def cost_plans(fleet, fastest):
    """By fraction: the cheapest plan reaching that fraction of the whole fleet's fastest
    throughput."""
    plans = {}
    for fraction in (0.6, 0.9):
        floor = fraction * fastest.cost.tokens_per_s
        plans[fraction] = search(fleet, GPT, None, GBS, 1, progress=False, objective="cost",
                                 min_tokens_per_s=floor).plan
        assert (plans[fraction].objective, plans[fraction].min_tokens_per_s) == ("cost", floor)
    return plans


def without(fleet, node):
    return fleet.subset([n.name for n in fleet.nodes if n.name != node])


def nodes_of(plan):
    return sorted({r.node for r in plan.ranks})


def as_throughput_plan(plan):
    return dataclasses.replace(plan, objective="throughput", min_tokens_per_s=None)


def test_a_cost_plan_replans_to_the_cheapest_plan_reaching_its_floor(fleet, cost_plans):
    previous = cost_plans[0.6]
    assert nodes_of(previous) == ["h800-1", "h800-2"]       # the two fastest nodes: cheapest
    survivors = without(fleet, "h800-1")
    kept = replan(previous, survivors, GPT)
    assert kept.objective_note is None
    assert (kept.plan.objective, kept.plan.min_tokens_per_s) == ("cost",
                                                                  previous.min_tokens_per_s)
    assert kept.cost.tokens_per_s >= previous.min_tokens_per_s
    # The same plan without its objective re-plans to the fastest plan, which takes the
    # expensive H20 node too: the cost re-plan leaves it idle and pays less per token.
    fastest_now = replan(as_throughput_plan(previous), survivors, GPT)
    assert fastest_now.cheapest_usd_per_million_tokens is None
    assert fastest_now.plan.objective == "throughput"
    assert "h20" in nodes_of(fastest_now.plan) and "h20" not in nodes_of(kept.plan)
    assert kept.cost.usd_per_million_tokens < 0.95 * fastest_now.cost.usd_per_million_tokens
    assert kept.cost.iteration_time_s > 1.02 * fastest_now.cost.iteration_time_s
    # the choice among plans within the tolerance compares what the objective does
    both = [Candidate(r.plan, r.cost, {}, False) for r in (fastest_now, kept)]
    state = StateMap(previous, GPT)
    assert least_moving(both, state, 0.02)[0] is both[0]
    assert least_moving(both, state, 0.02, score=usd_per_million_tokens)[0] is both[1]


def test_a_floor_the_fleet_cannot_reach_gives_the_fastest_plan_and_says_why(
        fleet, cost_plans, tmp_path, capsys):
    previous = cost_plans[0.9]
    survivors = without(fleet, "h800-1")
    fallen_back = replan(previous, survivors, GPT)
    fastest_now = replan(as_throughput_plan(previous), survivors, GPT)
    assert fallen_back.objective_note.startswith(
        f"no plan on the fleet present reaches the plan's floor of "
        f"{previous.min_tokens_per_s:,.0f} tokens/s (the fastest: ")
    assert fallen_back.objective_note.endswith("the fastest plan instead of the cheapest")
    assert fallen_back.cheapest_usd_per_million_tokens is None
    assert fallen_back.plan.pipelines == fastest_now.plan.pipelines
    assert fallen_back.plan.ranks == fastest_now.plan.ranks
    # still recorded: the re-plan after the node comes back is the cheapest again
    assert (fallen_back.plan.objective, fallen_back.plan.min_tokens_per_s) == (
        "cost", previous.min_tokens_per_s)
    back = replan(fallen_back.plan, fleet, GPT)
    assert back.objective_note is None and back.cost.tokens_per_s >= previous.min_tokens_per_s

    # `autohet replan` says it once, and the plan it writes says the floor is not reached
    old, new = tmp_path / "old.yaml", tmp_path / "new.yaml"
    previous.save(old)
    assert main(["replan", "--plan", str(old), "--cluster",
                 str(fleet_file(tmp_path / "now.yaml", [n.name for n in survivors.nodes])),
                 "--model", str(GPT_FILE), "-o", str(new)]) == 0
    out = capsys.readouterr().out
    warnings = [line for line in out.splitlines() if "WARNING" in line]
    assert warnings == ["> WARNING: the plan's objective is cost, not kept on this fleet: "
                        + fallen_back.objective_note]
    assert "(NOT REACHED by this plan)" in out
    assert load_plan(new).objective == "cost"


def test_a_node_without_a_price_gives_the_fastest_plan_and_says_why(fleet, cost_plans,
                                                                     tmp_path):
    previous = cost_plans[0.6]
    names = [n.name for n in without(fleet, "h800-1").nodes]
    survivors = load_cluster(fleet_file(tmp_path / "now.yaml", names, unpriced=["h20"]))
    result = replan(previous, survivors, GPT, cluster_file="now.yaml")
    assert result.objective_note == (
        "node h20 has no price; the plan's objective cost needs one on every node: the fastest "
        "plan instead of the cheapest")
    assert "h20" in nodes_of(result.plan)


def test_an_elastic_job_logs_the_objective_it_could_not_keep(fleet, cost_plans, tmp_path,
                                                             monkeypatch):
    """The elastic worker's re-plan (a new round's, here; the in-process one after a notice
    calls the same method) keeps the plan's objective, and says so once where it cannot."""
    from megatron_autohet.elastic.fleet import Member
    from megatron_autohet.elastic.worker import ElasticWorker
    from megatron_autohet.job import TrainOptions
    from megatron_autohet.runtime.optimizer import OptimizerSettings

    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                       "AUTOHET_NODE": "a100-1", "AUTOHET_GPU": "A100-80GB"}.items():
        monkeypatch.setenv(key, value)
    events = tmp_path / "events.jsonl"
    for fraction, kept in ((0.6, True), (0.9, False)):
        previous = cost_plans[fraction]
        worker = ElasticWorker(initial_plan=previous, template=fleet, model=GPT,
                               options=TrainOptions(iters=1, seed=0, precision="bf16",
                                                    optimizer=OptimizerSettings(lr=1e-4)),
                               notice_file=None, events_jsonl=str(events))
        survivors = without(fleet, "h800-1")
        plan, _ = worker._decide([Member(n.name, n.gpu, i) for n in survivors.nodes
                                  for i in range(n.num_gpus)], [])
        assert (plan.objective, plan.min_tokens_per_s) == ("cost", previous.min_tokens_per_s)
        assert (plan.predicted["tokens_per_s"] >= previous.min_tokens_per_s) == kept
        said = [json.loads(line) for line in events.read_text().splitlines()]
        noted = [e for e in said if e["event"] == "objective"]
        assert len(noted) == (0 if kept else 1)
    assert noted[0]["kept"] is False and noted[0]["note"].startswith(
        "no plan on the fleet present reaches the plan's floor of")


def test_a_per_gpu_cost_plan_replans_per_gpu_within_the_replan_budget(fleet, fastest, tmp_path,
                                                                      monkeypatch):
    """Charged per GPU the cost search runs per set of GPU types and TP degree; a re-plan runs
    at most REPLAN_COST_SEARCHES of them (here 1: the budget is what stops it)."""
    previous = search(fleet, GPT, None, GBS, 1, progress=False, objective="cost",
                      min_tokens_per_s=0.6 * fastest.cost.tokens_per_s, charge="per-gpu").plan
    survivors = without(fleet, "h800-1")
    kept = replan(previous, survivors, GPT)
    assert kept.objective_note is None and kept.cost.charge == "per-gpu"
    assert kept.cost.tokens_per_s >= previous.min_tokens_per_s
    fastest_now = replan(as_throughput_plan(previous), survivors, GPT)
    assert kept.cost.usd_per_million_tokens < fastest_now.cost.usd_per_million_tokens
    monkeypatch.setattr(objective_module, "REPLAN_COST_SEARCHES", 1)
    assert replan(previous, survivors, GPT).stopped_by == STOP_SETS
