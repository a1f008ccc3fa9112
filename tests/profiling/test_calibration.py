"""The GPU catalog's achieved_efficiency: the analytic estimates divide their kernel times by it,
and a measured profile sets it (autohet profile --update-catalog)."""

import dataclasses
from pathlib import Path

import pytest

from megatron_autohet.cli.main import main
from megatron_autohet.planner.search import search
from megatron_autohet.profiling.estimate import achieved_efficiency, estimate_entry
from megatron_autohet.profiling.profile import PARTS, Profile
from megatron_autohet.spec import load_gpu_catalog, load_model
from megatron_autohet.spec.cluster import cluster_from_dict
from megatron_autohet.spec.gpus import DEFAULT_CATALOG, set_achieved_efficiency

ROOT = Path(__file__).resolve().parents[2]
GPT = load_model(ROOT / "configs/models/gpt3-1.3b.yaml")


def one_h100(catalog):
    return cluster_from_dict({"name": "one-h100", "inter_node_bandwidth_gbs": 25,
                              "nodes": [{"name": "h100", "gpu": "H100", "gpus": 1}]},
                             catalog=catalog)


@pytest.mark.unit
def test_bundled_h100_factor_predicts_the_measured_iteration():
    """The issue's H100 run (GPT-3 1.3B, seq 2048, micro-batch 2, global batch 16, SDPA):
    measured 0.705 s per iteration; the estimate said 0.562 s without the factor."""
    catalog = load_gpu_catalog()
    assert catalog["H100"].achieved_efficiency == pytest.approx(0.792)
    calibrated = search(one_h100(catalog), GPT, None, 16, 2, progress=False)
    plain = dict(catalog, H100=dataclasses.replace(catalog["H100"], achieved_efficiency=1.0))
    uncalibrated = search(one_h100(plain), GPT, None, 16, 2, progress=False)
    assert uncalibrated.cost.iteration_time_s == pytest.approx(0.562, abs=0.001)
    assert calibrated.cost.iteration_time_s == pytest.approx(0.705, rel=0.01)


@pytest.mark.unit
def test_factor_divides_kernel_times_not_tp_all_reduces():
    h100 = load_gpu_catalog()["H100"]
    one, half = (estimate_entry(GPT, dataclasses.replace(h100, achieved_efficiency=e), 2, 1,
                                2048, h100.intra_node_bandwidth_gbs) for e in (1.0, 0.5))
    assert half.embedding.backward_s == pytest.approx(2 * one.embedding.backward_s)  # no comm
    # The layer's forward has two TP all-reduces, which the factor leaves alone.
    assert one.layer.forward_s < half.layer.forward_s < 2 * one.layer.forward_s
    assert half.layer.activation_bytes == one.layer.activation_bytes


def measured_as(model, gpu, efficiency, tps=(1, 2)):
    """A profile whose entries are what the estimate says at this efficiency, marked measured
    (the form `autohet profile` writes on a GPU)."""
    profile = Profile(model.name)
    for tp in tps:
        entry = estimate_entry(model, dataclasses.replace(gpu, achieved_efficiency=efficiency),
                               tp, 1, 2048, gpu.intra_node_bandwidth_gbs)
        profile.add(dataclasses.replace(entry, **{
            p: dataclasses.replace(getattr(entry, p), source="measured") for p in PARTS}))
    return profile


@pytest.mark.unit
def test_measured_profile_sets_the_factor_and_the_estimates_follow(tmp_path):
    catalog = load_gpu_catalog()
    a100 = catalog["A100-80GB"]
    found = achieved_efficiency(measured_as(GPT, a100, 0.6), GPT, catalog)
    assert found == {"A100-80GB": pytest.approx(0.6)}
    out = tmp_path / "gpus.yaml"
    set_achieved_efficiency(out, "A100-80GB", found["A100-80GB"])     # a copy of the bundled
    text = out.read_text()
    assert text.startswith(DEFAULT_CATALOG.read_text().split("gpus:")[0])   # comments kept
    updated = load_gpu_catalog(out)
    assert updated["A100-80GB"].achieved_efficiency == 0.6
    assert {g: t for g, t in updated.items() if g != "A100-80GB"} == {
        g: t for g, t in catalog.items() if g != "A100-80GB"}
    before = estimate_entry(GPT, a100, 1, 1, 2048, a100.intra_node_bandwidth_gbs)
    after = estimate_entry(GPT, updated["A100-80GB"], 1, 1, 2048, a100.intra_node_bandwidth_gbs)
    assert after.layer.forward_s == pytest.approx(before.layer.forward_s / 0.6)
    # A second measurement replaces the value, the bundled H100 line is edited in place.
    set_achieved_efficiency(out, "H100", 0.5)
    set_achieved_efficiency(out, "H100", 0.75)
    again = out.read_text()
    assert again.count("achieved_efficiency: 0.75") == 1 and "0.792" not in again
    assert load_gpu_catalog(out)["H100"].achieved_efficiency == 0.75


@pytest.mark.unit
def test_bad_factor_in_a_catalog_is_one_line(tmp_path, capsys):
    bad = tmp_path / "gpus.yaml"
    bad.write_text(DEFAULT_CATALOG.read_text().replace("achieved_efficiency: 0.792",
                                                       "achieved_efficiency: 0"))
    args = ["plan", "--cluster", str(ROOT / "configs/clusters/one-h100.yaml"), "--model",
            str(ROOT / "configs/models/tiny.yaml"), "--global-batch-size", "8",
            "--gpu-catalog", str(bad), "-o", str(tmp_path / "p.yaml")]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err]
    assert "field 'gpus.H100.achieved_efficiency': got 0.0 (allowed: a number > 0)" in err


@pytest.mark.integration        # the profiler imports torch to look for a GPU
def test_update_catalog_needs_a_gpu_measurement(tmp_path, capsys):
    """On a CPU the timings are fp32 CPU timings, whatever --as-gpu says: refused before any
    measurement."""
    args = ["profile", "--model", str(ROOT / "configs/models/tiny.yaml"), "--as-gpu", "H100",
            "--update-catalog", str(tmp_path / "g.yaml"), "-o", str(tmp_path / "p.yaml")]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("autohet profile: error: <command line>: field '--update-catalog': measuring "
                   "H100 on a CPU (allowed: a measurement on a GPU of a catalog type)")
    assert not (tmp_path / "g.yaml").exists()
