"""A profile from a run (profiling/from_run.py): per-layer costs scaled from the entries the plan
was priced on to a window's measured stage times, which the cost model then prices the plan at;
profiles merged for `autohet plan --profile A --profile B` (profiling/profile.py
``merge_profiles``). Synthetic windows (runtime/stage_drift.py ``window_report``), no timing."""

from __future__ import annotations

import pytest

from helpers.training import PLANS
from helpers.training import plan as load_bundled_plan
from megatron_autohet.cost_model import evaluate_plan
from megatron_autohet.errors import ConfigError
from megatron_autohet.planner.space import resolve_profile
from megatron_autohet.profiling.estimate import estimate_entry
from megatron_autohet.profiling.from_run import (priced_entries, profile_from_window,
                                                 save_run_profile)
from megatron_autohet.profiling.profile import PARTS, Profile, merge_profiles
from megatron_autohet.runtime.stage_drift import window_report
from megatron_autohet.spec import load_cluster
from megatron_autohet.spec.gpus import load_gpu_catalog
from megatron_autohet.spec.precision import PRECISIONS

pytestmark = pytest.mark.unit

CATALOG = load_gpu_catalog()
FP32 = PRECISIONS["fp32"]
FUSIONS = {"bias_activation_fusion": False, "bias_dropout_fusion": False}


def _window(plan, compute: list[float]):
    """A window whose rank r's compute median is ``compute[r]`` seconds per iteration."""
    return window_report(plan, 1, 20, [[c, 0.001, 0.001, 0.001] for c in compute])


def _derive(plan, compute):
    return profile_from_window(plan, _window(plan, compute).stages,
                               priced_entries(plan, CATALOG), precision=FP32,
                               attention="flash", fusions=FUSIONS)


def _stage_s(plan, profile, p, s):
    pipe = plan.pipelines[p]
    stage = pipe.stages[s]
    entry = profile.get(plan.ranks[stage.ranks[0]].gpu, len(stage.ranks), plan.micro_batch_size,
                        plan.seq_length)
    return sum(entry.stage_compute_s(stage.layers[1] - stage.layers[0], s == 0,
                                     s == len(pipe.stages) - 1, plan.activation_recompute))


def test_each_stage_is_priced_at_its_measured_time_with_the_priors_split():
    """tiny-two-pipelines: [A100 TP2 (embedding, layers 0-3) | H800 (layers 4-5, output)] x 3
    micro-batches and [H20: everything] x 1; one stage per (GPU type, TP degree)."""
    plan = load_bundled_plan("tiny-two-pipelines")
    priors = priced_entries(plan, CATALOG)
    # a plan priced on estimates: its priors are the estimates
    assert priors["H20", 1] == estimate_entry(plan.model, CATALOG["H20"], 1, 2, 64,
                                              CATALOG["H20"].intra_node_bandwidth_gbs)
    profile = _derive(plan, [0.036, 0.030, 0.0315, 0.050])
    assert (profile.model, profile.precision, profile.attention, profile.fusions) == (
        "tiny", FP32, "flash", FUSIONS)
    assert sorted(profile.entries) == [("A100-80GB", 2, 2, 64), ("H20", 1, 2, 64),
                                       ("H800", 1, 2, 64)]
    # per micro-batch: the slowest TP rank's 36 ms over 3, 31.5 ms over 3, 50 ms over 1
    for (p, s), seconds in {(0, 0): 0.012, (0, 1): 0.0105, (1, 0): 0.050}.items():
        assert _stage_s(plan, profile, p, s) == pytest.approx(seconds, rel=1e-12)
    for key, entry in profile.entries.items():
        prior = priors[key[:2]]
        k = entry.layer.forward_s / prior.layer.forward_s
        for part in PARTS:
            mine, was = getattr(entry, part), getattr(prior, part)
            assert mine.source == "measured"
            assert mine.forward_s == pytest.approx(k * was.forward_s, rel=1e-12)
            assert mine.backward_s == pytest.approx(k * was.backward_s, rel=1e-12)
            assert (mine.activation_bytes, mine.param_count) == (was.activation_bytes,
                                                                  was.param_count)


def test_the_cost_model_prices_the_plan_at_the_window():
    """What `autohet plan --profile` and `autohet show --profile` do with the file: resolved
    over the estimates, each stage's predicted time is its measured one."""
    plan = load_bundled_plan("tiny-two-pipelines")
    cluster = load_cluster(PLANS.parent / "clusters" / "local-4.yaml")
    window = _window(plan, [0.036, 0.030, 0.0315, 0.050])
    profile = profile_from_window(plan, window.stages, priced_entries(plan, CATALOG),
                                  precision=FP32, attention="flash", fusions=FUSIONS)
    cost = evaluate_plan(plan, cluster, resolve_profile(cluster, plan.model, profile, 2, 64))
    assert [s.time_s for s in cost.stages] == pytest.approx(
        [s.per_microbatch_s for s in window.stages], rel=1e-12)


def test_stages_of_one_gpu_type_share_one_scale():
    """tiny-homogeneous: both pipelines' first stages are A100 TP1 (layers 0-2 and the
    embedding). Measured 20 and 30 ms per iteration (2 micro-batches): one entry prices their
    sum, each at the mean."""
    plan = load_bundled_plan("tiny-homogeneous")
    profile = _derive(plan, [0.020, 0.030, 0.040, 0.050])
    assert _stage_s(plan, profile, 0, 0) + _stage_s(plan, profile, 1, 0) == pytest.approx(
        0.010 + 0.015, rel=1e-12)
    assert _stage_s(plan, profile, 0, 0) == pytest.approx(0.0125, rel=1e-12)
    assert _stage_s(plan, profile, 1, 1) == pytest.approx(0.025, rel=1e-12)     # H20 alone


def test_recompute_and_a_window_without_times():
    """Under activation recompute the priced time has the layers' forward twice: still exact. A
    stage without a time (no iteration read: CUDA's first) gives its GPU type no entry."""
    plan = load_bundled_plan("tiny-two-pipelines")
    plan.activation_recompute = True
    profile = _derive(plan, [0.036, 0.030, 0.0, 0.050])
    assert _stage_s(plan, profile, 0, 0) == pytest.approx(0.012, rel=1e-12)
    assert not profile.has("H800", 1, 2, 64)


def test_a_plan_priced_on_a_profile_scales_its_entries():
    """The prior is the entry the plan recorded (a measured one here, with its own split)."""
    plan = load_bundled_plan("tiny-two-pipelines")
    recorded = estimate_entry(plan.model, CATALOG["H20"], 1, 2, 64, 100.0)
    layer = recorded.layer.__class__(forward_s=1.0, backward_s=3.0, activation_bytes=7.0,
                                     activation_bytes_recompute=1.0, param_count=5,
                                     source="measured")
    recorded = recorded.__class__(**{**recorded.__dict__, "layer": layer})
    plan.profile = Profile("tiny", {recorded.key: recorded}).to_dict()
    prior = priced_entries(plan, CATALOG)["H20", 1]
    assert prior.layer == layer
    entry = _derive(plan, [0.036, 0.030, 0.0315, 0.050]).get("H20", 1, 2, 64)
    assert entry.layer.backward_s == pytest.approx(3 * entry.layer.forward_s, rel=1e-12)


def test_a_gpu_type_of_no_catalog_and_no_profile_cannot_be_scaled():
    plan = load_bundled_plan("tiny-two-pipelines")
    catalog = {k: v for k, v in CATALOG.items() if k != "H20"}
    with pytest.raises(ConfigError) as err:
        priced_entries(plan, catalog, "plan.yaml")
    assert str(err.value) == (
        "plan.yaml: field '--autohet-measured-profile': the plan's H20 TP1 stages have no entry "
        "to scale: H20 is neither in the plan's profile nor in the GPU catalog (allowed: a plan "
        "of GPU types of the catalog, or priced on a profile with their entries)")


def test_the_file_keeps_other_entries_of_the_same_figures(tmp_path):
    """A later window replaces its keys and keeps the others (an elastic job's generations on
    changing fleets); a file of other figures (precision) is replaced."""
    plan = load_bundled_plan("tiny-two-pipelines")
    path = tmp_path / "measured.yaml"
    save_run_profile(path, _derive(plan, [0.036, 0.030, 0.0315, 0.050]))
    only_h20 = _derive(plan, [0.0, 0.0, 0.0, 0.100])
    assert sorted(e[0] for e in only_h20.entries) == ["H20"]
    save_run_profile(path, only_h20)
    saved = Profile.load(path)
    assert sorted(e[0] for e in saved.entries) == ["A100-80GB", "H20", "H800"]
    assert saved.get("H20", 1, 2, 64) == only_h20.get("H20", 1, 2, 64)
    bf16 = profile_from_window(plan, _window(plan, [0.0, 0.0, 0.0, 0.1]).stages,
                               priced_entries(plan, CATALOG), precision=PRECISIONS["bf16"],
                               attention="flash", fusions=FUSIONS)
    save_run_profile(path, bf16)
    assert sorted(e[0] for e in Profile.load(path).entries) == ["H20"]


def test_merged_profiles_prefer_measured_entries(tmp_path):
    plan = load_bundled_plan("tiny-two-pipelines")
    measured = _derive(plan, [0.036, 0.030, 0.0315, 0.050])
    estimated = Profile("tiny", precision=FP32)
    for gpu in ("H20", "V100-32GB"):
        estimated.add(estimate_entry(plan.model, CATALOG[gpu], 1, 2, 64, 100.0))
    for order in ((estimated, measured), (measured, estimated)):
        merged = merge_profiles(list(order), ["a.yaml", "b.yaml"])
        assert merged.get("H20", 1, 2, 64) == measured.get("H20", 1, 2, 64)
        assert merged.has("V100-32GB", 1, 2, 64) and len(merged.entries) == 4
        assert merged.fusions == FUSIONS
    other = _derive(plan, [0.1, 0.1, 0.1, 0.1])
    assert merge_profiles([other, measured], ["a", "b"]).get("H20", 1, 2, 64) == other.get(
        "H20", 1, 2, 64)                                    # a tie: the first given
    with pytest.raises(ConfigError, match="^b.yaml: field 'precision': bf16, a.yaml is fp32"):
        merge_profiles([measured, Profile("tiny")], ["a.yaml", "b.yaml"])
    unfused = Profile("tiny", precision=FP32, fusions={"bias_activation_fusion": True})
    with pytest.raises(ConfigError, match="^b.yaml: field 'fusions'"):
        merge_profiles([measured, unfused], ["a.yaml", "b.yaml"])
