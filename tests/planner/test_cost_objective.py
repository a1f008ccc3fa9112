"""The cost objective: the cheapest plan that reaches a throughput floor, charged per node (a
partly used node is paid whole) or per GPU, and the flags that ask for it."""

import json

import pytest

from helpers.cli import run_cli
from megatron_autohet.cli.main import main
from megatron_autohet.cost_model import evaluate_plan
from megatron_autohet.errors import ConfigError
from megatron_autohet.plan import load_plan
from megatron_autohet.planner.candidate import STOP_COMPLETE, STOP_SETS
from megatron_autohet.planner.cost_search import FloorNotMet
from megatron_autohet.planner.search import search
from megatron_autohet.planner.space import resolve_profile
from megatron_autohet.spec import load_cluster, load_model
from megatron_autohet.spec.gpus import CONFIG_DIR

pytestmark = pytest.mark.integration      # searches of seconds

FLEET_24 = CONFIG_DIR / "clusters/a100-h800-h20.yaml"     # one 8-GPU node of each type
GPT_FILE = CONFIG_DIR / "models/gpt3-1.3b.yaml"
CLUSTER, GPT = load_cluster(FLEET_24), load_model(GPT_FILE)
GBS = 512


@pytest.fixture(scope="module")
def fastest():
    return search(CLUSTER, GPT, None, GBS, 1, progress=False)


def used_nodes(plan) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in plan.ranks:
        out[r.node] = out.get(r.node, 0) + 1
    return out


def test_issue_case_meets_the_floor(fastest):
    """The issue: the cheapest plan of the bundled 24-GPU fleet trained on a few H800s at a
    fraction of the fleet's speed (per-GPU prices, no floor). With a floor of 80% of the fastest
    plan's throughput the cost objective reaches it, and pays no more than the fastest plan."""
    degenerate = search(CLUSTER, GPT, None, GBS, 1, progress=False, objective="cost",
                        charge="per-gpu")
    assert degenerate.cost.tokens_per_s < 0.5 * fastest.cost.tokens_per_s
    assert sum(used_nodes(degenerate.plan).values()) < 8     # a partly used node
    floor = 0.8 * fastest.cost.tokens_per_s
    for charge in ("per-node", "per-gpu"):
        cheap = search(CLUSTER, GPT, None, GBS, 1, progress=False, objective="cost",
                       min_tokens_per_s=floor, charge=charge)
        assert cheap.cost.tokens_per_s >= floor
        assert cheap.cost.charge == charge
        fast = evaluate_plan(fastest.plan, CLUSTER, resolve_profile(CLUSTER, GPT, None, 1,
                                                                     GPT.seq_length),
                             charge=charge)
        assert cheap.cost.usd_per_million_tokens <= fast.usd_per_million_tokens * (1 + 1e-9)


def test_per_node_and_per_gpu_differ_on_a_partly_used_node():
    """A plan on 3 of a node's 8 GPUs: per-GPU charging pays the 3, per-node the whole node
    (8/3 the price); on whole nodes both agree. The per-node cost search does not pick the
    partly used node the per-GPU search picks."""
    per_gpu = search(CLUSTER, GPT, None, GBS, 1, progress=False, objective="cost",
                     charge="per-gpu")
    (node, used), = used_nodes(per_gpu.plan).items()
    size = CLUSTER.node(node).num_gpus
    assert used < size
    profile = resolve_profile(CLUSTER, GPT, None, 1, GPT.seq_length)
    as_node = evaluate_plan(per_gpu.plan, CLUSTER, profile, charge="per-node")
    assert as_node.usd_per_hour == pytest.approx(per_gpu.cost.usd_per_hour * size / used)
    assert as_node.usd_per_million_tokens == pytest.approx(
        per_gpu.cost.usd_per_million_tokens * size / used)
    per_node = search(CLUSTER, GPT, None, GBS, 1, progress=False, objective="cost")
    assert per_node.cost.charge == "per-node"
    assert all(n == CLUSTER.node(name).num_gpus for name, n in used_nodes(per_node.plan).items())
    assert per_node.cost.usd_per_million_tokens < as_node.usd_per_million_tokens
    whole = evaluate_plan(per_node.plan, CLUSTER, profile, charge="per-gpu")
    assert whole.usd_per_million_tokens == pytest.approx(per_node.cost.usd_per_million_tokens)


def test_unreachable_floor_names_the_fastest(fastest):
    with pytest.raises(FloorNotMet) as info:
        search(CLUSTER, GPT, None, GBS, 1, progress=False, objective="cost",
               min_tokens_per_s=2 * fastest.cost.tokens_per_s)
    assert info.value.fastest_tokens_per_s == pytest.approx(fastest.cost.tokens_per_s)


def test_floor_needs_the_cost_objective():
    with pytest.raises(ConfigError, match="min_tokens_per_s"):
        search(CLUSTER, GPT, None, GBS, 1, progress=False, min_tokens_per_s=1e5)
    with pytest.raises(ConfigError, match="'charge': got 'per-box'"):
        search(CLUSTER, GPT, None, GBS, 1, progress=False, charge="per-box")


class Output:
    def __init__(self, out: str, err: str):
        self.out, self.err = out, err


def planning(capsys, *extra, command="plan", cluster=FLEET_24, tmp_path=None):
    """`autohet plan` (writing tmp_path/plan.yaml) or `autohet compare` on the 24-GPU fleet."""
    args = [command, "--cluster", cluster, "--model", GPT_FILE, "--global-batch-size", GBS,
            *extra] + (["-o", tmp_path / "plan.yaml"] if command == "plan" else [])
    rc, out, err = run_cli(capsys, *args)
    return rc, Output(out, err)


@pytest.mark.parametrize("flags, message", [
    (["--objective", "cost"],
     "field '--objective': cost without a throughput floor: the cheapest plan would train on a "
     "few GPUs for as long as it takes (allowed: with --min-tokens-per-s X, or --deadline-hours "
     "H and --train-tokens T)"),
    (["--objective", "cost", "--deadline-hours", "12"],
     "field '--deadline-hours': no --train-tokens: the deadline is for training that many "
     "tokens (allowed: with --train-tokens T)"),
    (["--objective", "cost", "--min-tokens-per-s", "1e5", "--deadline-hours", "12",
      "--train-tokens", "1e10"],
     "field '--min-tokens-per-s': given with --deadline-hours (allowed: one throughput floor: "
     "--min-tokens-per-s X, or --deadline-hours H with --train-tokens T)"),
    (["--min-tokens-per-s", "1e5"],
     "field '--min-tokens-per-s': without --objective cost (the throughput objective's plan is "
     "the fastest anyway) (allowed: with --objective cost)"),
    (["--objective", "cost", "--min-tokens-per-s", "nan"],
     "field '--min-tokens-per-s': got nan, not a finite number (allowed: a number > 0)"),
    (["--objective", "cost", "--deadline-hours", "0", "--train-tokens", "1e10"],
     "field '--deadline-hours': got 0.0 (allowed: a number > 0)"),
])
@pytest.mark.parametrize("command", ["plan", "compare"])
def test_bad_flag_combinations_are_one_line(capsys, tmp_path, flags, message, command):
    rc, out = planning(capsys, *flags, command=command, tmp_path=tmp_path)
    assert rc == 2
    assert out.err == f"autohet {command}: error: <command line>: {message}\n"
    assert not (tmp_path / "plan.yaml").exists()


def test_charge_needs_prices(capsys, tmp_path):
    rc, out = planning(capsys, "--charge", "per-gpu", cluster=CONFIG_DIR / "clusters/spot-4.yaml",
                      tmp_path=tmp_path)
    assert rc == 2
    assert out.err.endswith("field 'nodes[0].spot_price': node node0 has no price; --charge "
                            "needs one on every node (allowed: USD per GPU-hour, a number >= 0)\n")
    assert out.err.count("\n") == 1


def test_unreachable_deadline_is_one_line(capsys, tmp_path, fastest):
    hours = 1e10 / fastest.cost.tokens_per_s / 3600
    rc, out = planning(capsys, "--objective", "cost", "--deadline-hours", "1", "--train-tokens",
                      "1e10", tmp_path=tmp_path)
    assert rc == 2      # one line, no progress bar (stderr is not a terminal)
    assert out.err == (
        "autohet plan: error: <command line>: field '--deadline-hours': 1e10 tokens in 1 h need "
        f"2,777,778 tokens/s; the fastest plan found reaches {fastest.cost.tokens_per_s:,.0f} "
        f"({hours:.3g} h) (allowed: at least {hours:.3g} h, fewer tokens, or more GPUs)\n")


def test_plan_meets_the_deadline_and_says_what_it_costs(capsys, tmp_path, fastest):
    hours = 1.25 * 1e10 / fastest.cost.tokens_per_s / 3600
    rc, out = planning(capsys, "--objective", "cost", "--deadline-hours", f"{hours}",
                      "--train-tokens", "1e10", tmp_path=tmp_path)
    assert rc == 0, out.err
    plan = load_plan(tmp_path / "plan.yaml")
    predicted = plan.predicted
    assert predicted["tokens_per_s"] >= 1e10 / hours / 3600
    assert predicted["charge"] == "per-node"
    # recorded for its re-plans (test_replan_objective.py): the deadline as the floor it sets
    assert plan.objective == "cost"
    assert plan.min_tokens_per_s == pytest.approx(1e10 / hours / 3600)
    assert (f"objective: the fewest USD per million tokens at {plan.min_tokens_per_s:,.0f} "
            "tokens/s or more; its re-plans keep it") in out.out
    train_hours = 1e10 / predicted["tokens_per_s"] / 3600
    usd = predicted["usd_per_million_tokens"] * 1e4
    assert f"1e10 tokens train in {train_hours:.3g} h for ${usd:,.0f}" in out.out


def test_compare_shows_price_and_time_to_train(capsys, fastest):
    floor = 0.8 * fastest.cost.tokens_per_s
    rc, out = planning(capsys, "--objective", "cost", "--min-tokens-per-s", f"{floor}",
                      "--train-tokens", "3e10", command="compare")
    assert rc == 0, out.err
    header = out.out.splitlines()[1]
    for column in ("$/1M tokens (per-node)", "time to train 3e10", "$ to train", "meets floor"):
        assert column in header
    rc, out = planning(capsys, "--objective", "cost", "--min-tokens-per-s", f"{floor}",
                      "--train-tokens", "3e10", "--json", command="compare")
    data = json.loads(out.out)
    ours = data["autohet"]
    assert ours["meets_floor"] and ours["charge"] == "per-node"
    assert ours["hours_to_train"] == pytest.approx(3e10 / ours["tokens_per_s"] / 3600)
    assert ours["usd_to_train"] == pytest.approx(ours["usd_per_million_tokens"] * 3e4)
    for b in data["baselines"]:
        if b["tokens_per_s"] is not None:
            assert b["meets_floor"] == (b["tokens_per_s"] >= floor)
            assert b["hours_to_train"] == pytest.approx(3e10 / b["tokens_per_s"] / 3600)


def test_show_prices_a_plan_as_it_was_charged(capsys, tmp_path):
    rc, out = planning(capsys, "--charge", "per-gpu", "--objective", "cost", "--min-tokens-per-s",
                      "1e5", tmp_path=tmp_path)
    assert rc == 0, out.err
    planned = [line for line in out.out.splitlines() if line.strip().startswith("price:")]
    assert main(["show", str(tmp_path / "plan.yaml"), "--cluster", str(FLEET_24)]) == 0
    shown = [line for line in capsys.readouterr().out.splitlines()
             if line.strip().startswith("price:")]
    assert planned == shown and "--charge per-gpu" in shown[0]


def test_the_node_set_budget_is_named_when_it_binds(monkeypatch, fastest):
    """With room for one node set the per-node cost search stops at that budget, and says so
    (it named the SCIP work budget, which had not bound). At 80% of the fastest plan's
    throughput it searches three sets."""
    from megatron_autohet.cli._common import search_end
    from megatron_autohet.planner import cost_search

    floor = 0.8 * fastest.cost.tokens_per_s
    full = search(CLUSTER, GPT, None, GBS, 1, progress=False, objective="cost",
                  min_tokens_per_s=floor)
    assert full.stopped_by == STOP_COMPLETE
    monkeypatch.setattr(cost_search, "MAX_NODE_SETS", 1)
    cut = search(CLUSTER, GPT, None, GBS, 1, progress=False, objective="cost",
                 min_tokens_per_s=floor)
    assert cut.stopped_by == STOP_SETS
    assert search_end(cut).startswith("budget of throughput searches (node sets, or GPU types "
                                      "and TP degrees) spent before the cheapest was proven")
    # the budget as an argument (the re-planner's, planner/replan.py)
    monkeypatch.undo()
    assert search(CLUSTER, GPT, None, GBS, 1, progress=False, objective="cost",
                  min_tokens_per_s=floor, max_searches=1).stopped_by == STOP_SETS
    assert search(CLUSTER, GPT, None, GBS, 1, progress=False, objective="cost",
                  min_tokens_per_s=floor, max_searches=1,
                  charge="per-gpu").stopped_by == STOP_SETS
    for objective, budget in (("throughput", 1), ("cost", 0)):
        with pytest.raises(ConfigError, match="field 'max_searches': got "):
            search(CLUSTER, GPT, None, GBS, 1, progress=False, objective=objective,
                   max_searches=budget)
