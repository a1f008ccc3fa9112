"""Planner: valid plans, memory limits, flags, errors, and optimality against brute force."""

import dataclasses
import itertools
import math

import pytest

from megatron_autohet.errors import ConfigError
from megatron_autohet.planner import compare, make_plan, search
from megatron_autohet.planner.options import ALL_ORDERS_BUDGET, orders_of, stage_sequences
from megatron_autohet.planner.space import Pool
from megatron_autohet.testing.exhaustive import exhaustive_search
from megatron_autohet.spec import load_cluster, load_model
from megatron_autohet.spec.cluster import cluster_from_dict

GPT13 = load_model("configs/models/gpt3-1.3b.yaml")
TINY = load_model("configs/models/tiny.yaml")


def _check(plan, cluster):
    plan.validate()
    devices = {(d.node, d.local_rank, d.gpu) for d in cluster.devices()}
    assert plan.world_size <= cluster.world_size      # idle GPUs have no rank
    assert {(r.node, r.local_rank, r.gpu) for r in plan.ranks} <= devices
    for pipe in plan.pipelines:
        for stage in pipe.stages:
            gpu = cluster.gpu_types[plan.ranks[stage.ranks[0]].gpu]
            assert stage.predicted_memory_gib <= gpu.memory_gib
            assert stage.predicted_time_s > 0
    assert plan.predicted["iteration_time_s"] > 0 and plan.predicted["fits_memory"]


@pytest.mark.integration
@pytest.mark.parametrize("name", ["a100-h800-h20", "a100-v100-t4", "fleet-96"])
def test_bundled_clusters_get_valid_plans(name):
    cluster = load_cluster(f"configs/clusters/{name}.yaml")
    plan = make_plan(cluster, GPT13, None, 2 * cluster.world_size, 1, progress=False)
    _check(plan, cluster)


@pytest.mark.integration
def test_the_quick_start_plan_puts_the_a100s_at_both_ends():
    """The README's quick start (bundled a100-h800-h20, GPT-3 1.3B, global batch 64): four
    stacked pipelines A100, H800, H800, H20, A100, an order with the A100's stages apart, at
    0.2656 s after the warm-up pass. The search judged that plan at standard warm-up depths
    (0.2851 s) against its A100 + H800 sub-fleet's plan already warmed up (0.2744 s, 0.2857
    at standard depths) and returned the latter, 3.3% slower."""
    cluster = load_cluster("configs/clusters/a100-h800-h20.yaml")
    cand = search(cluster, GPT13, None, 64, 1, progress=False)
    gpus = [[cand.plan.ranks[s.ranks[0]].gpu for s in p.stages] for p in cand.plan.pipelines]
    assert gpus == [["A100-80GB", "H800", "H800", "H20", "A100-80GB"]] * 4
    assert cand.cost.iteration_time_s < 0.266


@pytest.mark.unit
def test_tiny_on_local_cluster():
    cluster = load_cluster("configs/clusters/local-4.yaml")
    plan = make_plan(cluster, TINY, None, 8, 2, progress=False)
    _check(plan, cluster)


@pytest.mark.integration
def test_symmetric_tp_by_default_and_asymmetric_on_request():
    cluster = load_cluster("configs/clusters/a100-v100-t4.yaml")
    sym = search(cluster, GPT13, None, 64, 1, progress=False)
    assert len({s.tp for p in sym.plan.pipelines for s in p.stages}) == 1
    asym = search(cluster, GPT13, None, 64, 1, progress=False, allow_asymmetric_tp=True)
    _check(asym.plan, cluster)
    assert asym.cost.iteration_time_s <= sym.cost.iteration_time_s * (1 + 1e-9)


@pytest.mark.integration
def test_speedup_over_megatron_on_three_type_fleet():
    cluster = load_cluster("configs/clusters/a100-h800-h20.yaml")
    result = compare(cluster, GPT13, None, 64, 1, progress=False)
    megatron = result.baseline("megatron-lm")
    assert megatron.plan is not None and megatron.cost.fits_memory
    assert megatron.speedup >= 1.3


@pytest.mark.unit
def test_errors():
    cluster = load_cluster("configs/clusters/local-4.yaml")
    with pytest.raises(ConfigError, match="global_batch_size"):
        make_plan(cluster, TINY, None, 7, 2, progress=False)
    with pytest.raises(ConfigError, match="fits in memory"):
        make_plan(_cluster([("L4", 1)]), load_model("configs/models/llama2-13b.yaml"), None, 8,
                  1, progress=False)
    with pytest.raises(ConfigError, match="no GPU with bf16"):       # as `autohet plan` says
        make_plan(_cluster([("T4", 2)]), load_model("configs/models/llama2-13b.yaml"), None, 8,
                  1, progress=False)


def _cluster(nodes):
    return cluster_from_dict({"name": "small", "inter_node_bandwidth_gbs": 25, "nodes": [
        {"name": f"n{i}", "gpu": gpu, "gpus": n} for i, (gpu, n) in enumerate(nodes)]})


GPT13_8 = dataclasses.replace(GPT13, num_layers=8)


EXHAUSTIVE_CASES = {
    "local-4": ("configs/clusters/local-4.yaml", None, TINY, 8, 2, None),
    "8-gpu-3-types": (None, [("A100-80GB", 4), ("H20", 2), ("T4", 2)], GPT13_8, 32, 1, [2, 4]),
    "8-gpu-2-types": (None, [("A100-80GB", 4), ("H800", 4)], GPT13_8, 32, 1, [2, 4]),
    "16-gpu-a100-v100-t4": (None, [("A100-40GB", 8), ("V100-32GB", 4), ("T4", 4)], GPT13_8, 64,
                            1, [4]),
    "16-gpu-h800-a100-h20": (None, [("H800", 8), ("A100-80GB", 4), ("H20", 4)], GPT13_8, 64, 1,
                             [4, 8]),
}


@pytest.mark.integration
@pytest.mark.parametrize("case", sorted(EXHAUSTIVE_CASES))
def test_within_two_percent_of_brute_force(case):
    path, nodes, model, gbs, mbs, tps = EXHAUSTIVE_CASES[case]
    cluster = load_cluster(path) if path else _cluster(nodes)
    ours = search(cluster, model, None, gbs, mbs, progress=False, tp_degrees=tps, max_stages=4,
                  virtual_stages=False)
    best = exhaustive_search(cluster, model, None, gbs, mbs, tp_degrees=tps, max_stages=4)
    _check(ours.plan, cluster)
    assert ours.cost.iteration_time_s <= 1.02 * best.cost.iteration_time_s


@pytest.mark.integration
@pytest.mark.parametrize("name", ["a100-h800-h20", "a100-v100-t4"])
def test_no_baseline_beats_our_plan(name):
    """On A100 + H800 + H20 the plan beats Megatron-LM's by 30% or more; on A100 + V100 + T4 a
    bf16 job (the estimates' precision) trains on the A100s alone, as every baseline does: the
    V100s and T4s cannot train bf16 and stay idle, so the plans tie."""
    cluster = load_cluster(f"configs/clusters/{name}.yaml")
    result = compare(cluster, GPT13, None, 64, 1, progress=False)
    for b in result.baselines:
        if b.cost is not None:
            assert result.cost.iteration_time_s <= b.cost.iteration_time_s * (1 + 1e-9), b.name
    if name == "a100-v100-t4":
        assert result.cost.idle_gpus == {"V100-32GB": 8, "T4": 8}
        assert {rank.gpu for rank in result.plan.ranks} == {"A100-40GB"}
    else:
        assert result.baseline("megatron-lm").speedup >= 1.3


@pytest.mark.unit
def test_exhaustive_is_a_true_brute_force():
    """The exhaustive optimum is never worse than any plan it could have enumerated, including
    the planner's own (a sanity check that its space contains the planner's)."""
    cluster = _cluster([("A100-80GB", 2), ("T4", 2)])
    ours = search(cluster, TINY, None, 8, 2, progress=False, max_stages=4, virtual_stages=False)
    best = exhaustive_search(cluster, TINY, None, 8, 2, max_stages=4)
    assert best.cost.iteration_time_s <= ours.cost.iteration_time_s * (1 + 1e-9)


@pytest.mark.unit
def test_warmup_post_pass_overlaps_a_slow_link():
    from megatron_autohet.cost_model import StageCost, simulate_1f1b
    from megatron_autohet.planner.warmup import best_warmups

    # t = 1 per stage, 1 per message each way: standard 1F1B needs 2 per micro-batch (a round
    # trip covers two), running ahead overlaps the link: ~1 per micro-batch.
    stages = [StageCost(0, s, "x", 1, (s, s + 1), 0.5, 0.5, 2.0 if s == 0 else 0.0, None, 1, 1,
                        1.0, 1.0, 0.0, 0.0) for s in range(2)]
    depths, makespan = best_warmups(stages, 8, [8, 0])
    assert depths[0] > 1 and depths[1] == 0
    assert makespan < 0.7 * simulate_1f1b(stages, 8)
    assert best_warmups(stages, 8, [1, 0]) == ([1, 0], simulate_1f1b(stages, 8))  # no memory


def _stages(times_ms):
    from megatron_autohet.cost_model import StageCost
    return [StageCost(0, s, "x", 1, (s, s + 1), f / 1e3, b / 1e3, c / 1e3, None, 1, 1, 1.0, 1.0,
                      0.0, 0.0) for s, (f, b, c) in enumerate(times_ms)]


# A pipeline the planner builds on fleet-96 (GPT-3 1.3B, global batch 512, micro-batch 2):
# forward / backward / outgoing link ms per micro-batch; m = 47. The H800 stages 2-4 set the pace.
FLEET96_PIPELINE = [(3.1, 6.0, 0.07), (3.0, 6.0, 0.67), (3.9, 6.6, 0.17), (3.9, 6.6, 0.17),
                    (3.9, 6.6, 0.17), (3.4, 6.0, 0.0)]


@pytest.mark.unit
def test_deeper_warmup_removes_the_slow_stages_start_up_gap_even_on_free_links():
    """Real 1F1B behaviour (planner/warmup.py docstring): with free links the standard order
    leaves the slowest stage idle at start-up; a deeper warm-up reaches the bound of that stage
    working without a gap, and the post-pass takes a shallow depth close to it."""
    from megatron_autohet.cost_model import simulate_1f1b
    from megatron_autohet.planner.warmup import MIN_GAIN, best_warmups

    stages, m = _stages([(f, b, 0.0) for f, b, _ in FLEET96_PIPELINE]), 47
    slow = 4                        # the last of the three slow stages has the most before it
    bound = (sum(s.forward_s + s.backward_s for s in stages[:slow])
             + m * (stages[slow].forward_s + stages[slow].backward_s))
    standard = simulate_1f1b(stages, m)
    assert standard > bound * (1 + MIN_GAIN)
    plus_two = simulate_1f1b(stages, m, [7, 6, 5, 4, 3, 0])
    assert plus_two == pytest.approx(bound, rel=1e-12)
    assert simulate_1f1b(stages, m, [m] * 5 + [0]) == pytest.approx(bound, rel=1e-12)  # GPipe
    depths, makespan = best_warmups(stages, m, [m] * 5 + [0])
    assert depths == [6, 5, 4, 3, 2, 0] and makespan <= bound * (1 + MIN_GAIN)


@pytest.mark.unit
def test_warmup_post_pass_takes_the_shallowest_step_close_to_the_fastest():
    """With the pipeline's real (small) link times, running every forward first (depth 47) is
    0.9% faster in the simulation than 2 more micro-batches of warm-up, for 47 instead of 7
    micro-batches of activations: the post-pass takes the shallow step."""
    from megatron_autohet.cost_model import simulate_1f1b
    from megatron_autohet.planner.warmup import best_warmups

    stages, m = _stages(FLEET96_PIPELINE), 47
    deepest = simulate_1f1b(stages, m, [m] * 5 + [0])
    depths, makespan = best_warmups(stages, m, [m] * 5 + [0])
    assert depths == [7, 6, 5, 4, 3, 0]
    assert deepest < makespan < 1.01 * deepest < 0.99 * simulate_1f1b(stages, m)


@pytest.mark.integration
def test_warmup_post_pass_gives_valid_depths_within_memory_and_a_shorter_iteration():
    from megatron_autohet.cost_model import evaluate_plan
    from megatron_autohet.planner.space import resolve_profile

    cluster = load_cluster("configs/clusters/fleet-96.yaml")
    # the work budget ends the search, not the wall clock: a loaded machine's 60 s net would
    # cut it, and a cut search skips the warm-up pass this test is about
    result = compare(cluster, GPT13, None, 256, 1, progress=False, time_limit_s=3600.0)
    plan = result.plan
    _check(plan, cluster)                         # validates: non-increasing, 0 last, >= 1 before
    assert any(s.warmup_microbatches is not None for p in plan.pipelines for s in p.stages)
    standard = dataclasses.replace(plan, pipelines=[dataclasses.replace(
        p, stages=[dataclasses.replace(s, warmup_microbatches=None) for s in p.stages])
        for p in plan.pipelines])
    profile = resolve_profile(cluster, GPT13, None, 1, GPT13.seq_length)
    before = evaluate_plan(standard, cluster, profile)
    assert result.cost.iteration_time_s < 0.99 * before.iteration_time_s
    for b in result.baselines:                    # Megatron-LM has no such option
        assert b.plan is None or all(s.warmup_microbatches is None
                                     for p in b.plan.pipelines for s in p.stages)


@pytest.mark.unit
def test_measured_activation_bytes_decide_the_split():
    """A measured profile's activation bytes replace the estimate's: 13 GiB per layer and
    micro-batch on 80 GB GPUs (72 GiB usable) leave no room for the 6-layer model on one GPU,
    and a first stage keeping 2 micro-batches in flight holds at most 2 layers; the estimate
    alone needs a few GiB whatever the split. The exhaustive search agrees."""
    from megatron_autohet.planner.space import resolve_profile
    from megatron_autohet.profiling.profile import Profile

    cluster = _cluster([("A100-80GB", 2)])
    estimated = search(cluster, TINY, None, 8, 2, progress=False, tp_degrees=[1])
    assert estimated.cost.peak_memory_gib < 5
    entry = resolve_profile(cluster, TINY, None, 2, 64).get("A100-80GB", 1, 2, 64)
    layer = dataclasses.replace(entry.layer, activation_bytes=13 * 1024 ** 3, source="measured")
    measured = Profile(TINY.name)
    measured.add(dataclasses.replace(entry, layer=layer))
    ours = search(cluster, TINY, measured, 8, 2, progress=False, tp_degrees=[1],
                  virtual_stages=False)
    (pipe,) = ours.plan.pipelines
    assert len(pipe.stages) == 2 and pipe.stages[0].num_layers <= 2
    assert all(s.memory_gib <= s.memory_limit_gib for s in ours.cost.stages)
    assert ours.cost.stages[1].memory_gib > pipe.stages[1].num_layers * 13
    best = exhaustive_search(cluster, TINY, measured, 8, 2, tp_degrees=[1])
    assert ours.cost.iteration_time_s <= best.cost.iteration_time_s * 1.01


@pytest.mark.integration
def test_composition_model_keeps_only_the_columns_that_matter_and_stays_exact():
    """The per-solve SCIP model drops options other columns dominate (same or fewer GPUs of every
    pool, at least the capacity); whether a composition finishes the batch by tau must not
    change. Brute force over every composition of random small option sets."""
    import itertools
    import random

    from megatron_autohet.planner.scip_model import CompositionModel
    from megatron_autohet.planner.space import PipelineOption

    rng = random.Random(7)
    checked = reduced = 0
    for _ in range(60):
        pools = [rng.randint(1, 4) for _ in range(3)]
        options = []
        for _ in range(rng.randint(2, 9)):
            seq = tuple(sorted(rng.choice(range(3)) for _ in range(rng.randint(1, 3))))
            period = rng.uniform(0.5, 2.0)
            options.append(PipelineOption(
                pools=seq, layers=(1,) * len(seq), fill_s=period * len(seq) * rng.uniform(1, 1.5),
                period_s=period, sync_shared_s=(0.0,) * len(seq), sync_tied_s=(0.0,) * len(seq),
                sync_tied_own_s=(0.0,) * len(seq), optimizer_s=0.0,
                max_microbatches=rng.choice([None, None, 2])))
        total = rng.randint(3, 12)
        low, high = rng.choice([(1, 1), (1, 3), (2, 4), (1, 12)])
        model = CompositionModel(options, pools, total, (low, high))
        allowed = [rng.random() < 0.8 for _ in options]
        for tau in (rng.uniform(1, 12), None):
            # micro-batches each option's pipeline finishes by tau, from its time formula
            caps = [o.cap(max((m for m in range(1, total + 1)
                               if tau is None or o.time_s(m) <= tau + 1e-9 * o.period_s),
                              default=0)) for o in options]
            ranges = [range(min(high, total) + 1) if a else range(1) for a in allowed]
            exists = any(
                low <= sum(x) <= min(high, total)
                and all(sum(n * o.pools.count(k) for n, o in zip(x, options)) <= pools[k]
                        for k in range(3))
                and sum(c * n for c, n in zip(caps, x)) >= total
                for x in itertools.product(*ranges))
            found = model.feasible(allowed, tau)
            assert (found is not None) == exists
            if found is not None:
                assert all(n == 0 or a for n, a in zip(found, allowed))
                assert sum(c * n for c, n in zip(caps, found)) >= total
                assert low <= sum(found) <= high
            checked += 1
            reduced += len(model.columns(allowed, model.capacities(tau, None))) < sum(
                a and c > 0 for a, c in zip(allowed, caps))
    assert checked == 120 and reduced > 20    # the reduction is exercised, not vacuous


@pytest.mark.unit
def test_layer_splits_start_at_the_smallest_period():
    """layer_splits's first split of a long sequence has the smallest period any split within
    the memory limits has (brute force over every split), and every split is valid."""
    import itertools
    import random

    import numpy as np

    from megatron_autohet.planner.space import layer_splits

    rng = random.Random(3)
    L, S, n = 12, 4, 40
    fixed = np.array([[rng.uniform(0.0, 2.0) for _ in range(S)] for _ in range(n)])
    per_layer = np.array([[rng.choice([0.5, 1.0, 1.3, 2.0]) for _ in range(S)] for _ in range(n)])
    limits = np.array([[rng.randint(1, 6) for _ in range(S)] for _ in range(n)])
    rows, splits = layer_splits(L, fixed, per_layer, limits)
    assert list(rows) == sorted(rows)
    checked = 0
    for i in range(n):
        every = [sp for sp in itertools.product(range(1, L + 1), repeat=S)
                 if sum(sp) == L and all(a <= b for a, b in zip(sp, limits[i]))]
        mine = [tuple(sp) for sp in splits[rows == i]]
        assert bool(every) == bool(mine)
        if not every:
            continue
        assert len(set(mine)) == len(mine) and set(mine) <= set(every)
        best = min(max(fixed[i] + per_layer[i] * np.array(sp)) for sp in every)
        assert max(fixed[i] + per_layer[i] * np.array(mine[0])) == pytest.approx(best, rel=1e-12)
        checked += 1
    assert checked > 20


@pytest.mark.integration
def test_layer_splits_give_the_fastest_pipeline_for_every_microbatch_count():
    """Above ALL_SPLITS_UP_TO splits, layer_splits still holds a split with the smallest
    ``fill + (m - 1) period`` any split within the memory limits has, for every m (brute force):
    the min-fill split under every period cap a stage can take."""
    import itertools
    import random

    import numpy as np

    from megatron_autohet.planner.space import ALL_SPLITS_UP_TO, layer_splits

    rng = random.Random(7)
    L, S, n = 13, 4, 60
    assert math.comb(L - 1, S - 1) > ALL_SPLITS_UP_TO
    fixed = np.array([[rng.uniform(0.0, 3.0) for _ in range(S)] for _ in range(n)])
    per_layer = np.array([[rng.uniform(0.2, 2.5) for _ in range(S)] for _ in range(n)])
    limits = np.array([[rng.randint(2, 9) for _ in range(S)] for _ in range(n)])
    rows, splits = layer_splits(L, fixed, per_layer, limits)
    checked = 0
    for i in range(n):
        every = [np.array(sp) for sp in itertools.product(range(1, L + 1), repeat=S)
                 if sum(sp) == L and all(a <= b for a, b in zip(sp, limits[i]))]
        mine = splits[rows == i]
        assert bool(every) == bool(len(mine))
        for m in (1, 2, 3, 5, 8, 16, 64):
            def time_s(sp):
                periods = fixed[i] + per_layer[i] * sp
                return periods.sum() + (m - 1) * periods.max()
            if every:
                assert min(time_s(sp) for sp in mine) == pytest.approx(
                    min(time_s(sp) for sp in every), rel=1e-12)
                checked += 1
    assert checked > 200


@pytest.mark.unit
def test_every_order_of_pools_where_a_depth_has_few_orders():
    """orders_of counts the sequences of S pools within each pool's count (against brute
    force); stage_sequences holds all of them at every depth up to the budget (three pools of 8
    groups: 5 stages), a type's stages apart included, and only contiguous runs (and their
    wrap-around) beyond it."""
    for counts in ([8, 8, 8], [1, 3, 2], [2, 2], [1] * 5):
        for depth in range(1, 7):
            brute = [q for q in itertools.product(range(len(counts)), repeat=depth)
                     if all(q.count(k) <= c for k, c in enumerate(counts))]
            assert orders_of(counts, depth) == len(brute)
    pools = [Pool(g, 1, 8, 8, 25.0, 300.0, 8) for g in ("A", "B", "C")]
    found = set(stage_sequences(pools, 8))
    every = [d for d in range(1, 9) if orders_of([8] * 3, d) <= ALL_ORDERS_BUDGET]
    assert every == list(range(1, 6))
    for depth in every:
        assert all(q in found for q in itertools.product(range(3), repeat=depth))
    assert (0, 1, 0, 2, 0) in found and (0, 1, 0, 2, 0, 1) not in found
    assert (0, 1, 1, 2, 2, 2, 2, 0) in found            # runs, the first one's stage at the end
