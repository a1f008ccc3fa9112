"""A profile from the run: `autohet train --autohet-measured-profile` writes
what the job measured as a profile that `autohet plan --profile` takes and merges with others,
and that prices the plan the job ran at the times the job measured (compared with the numbers
the run wrote, never with a wall-clock expectation); refused in one line where it cannot be
honoured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.cli import run_cli, table
from megatron_autohet.cost_model import evaluate_plan
from megatron_autohet.plan import load_plan
from megatron_autohet.planner.space import resolve_profile
from megatron_autohet.profiling.estimate import estimate_profile
from megatron_autohet.profiling.profile import Profile
from megatron_autohet.spec import load_cluster
from megatron_autohet.spec.precision import PRECISIONS

ROOT = Path(__file__).resolve().parents[2]
PLAN = ROOT / "configs/plans/tiny-two-pipelines.yaml"
MODEL = ROOT / "configs/models/tiny.yaml"
LOCAL4 = ROOT / "configs/clusters/local-4.yaml"


def _autohet(*args, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_autohet.cli.main", *map(str, args)],
                          capture_output=True, text=True, cwd=ROOT, timeout=timeout,
                          env=dict(os.environ))


@pytest.mark.integration
def test_the_flag_without_windows_is_one_line_before_any_process(tmp_path):
    result = _autohet("train", "--plan", PLAN, "--model", MODEL, "--autohet-measure-window", "0",
                      "--autohet-measured-profile", tmp_path / "p.yaml")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "autohet train: error: <command line>: field '--autohet-measured-profile': needs "
        "measurement windows, and --autohet-measure-window is 0 (allowed: "
        "--autohet-measure-window >= 1 with it)"]
    result = _autohet("train", "--plan", PLAN, "--model", MODEL,
                      "--autohet-measured-profile", tmp_path / "no" / "p.yaml")
    assert result.returncode == 2 and "--autohet-measured-profile" in result.stderr
    assert not (tmp_path / "p.yaml").exists()


@pytest.mark.e2e
def test_a_run_profiles_its_plan_and_the_planner_takes_it(tmp_path, capsys):
    """Four gloo ranks, four iterations, windows of two: the profile of the newest window prices
    every stage of the plan at its measured time per micro-batch (to the JSONL's six decimals);
    `autohet plan` merges it with another profile, its measured entries winning; `autohet show`
    with it and the run's windows finds every stage within 1% (1.00x)."""
    measured, profile_file = tmp_path / "measured.jsonl", tmp_path / "measured.yaml"
    result = _autohet("train", "--plan", PLAN, "--model", MODEL, "--iters", "4",
                      "--data-dir", tmp_path / "data", "--autohet-measure-window", "2",
                      "--autohet-measured-jsonl", measured,
                      "--autohet-measured-profile", profile_file)
    assert result.returncode == 0, result.stderr[-3000:]
    windows = [json.loads(line) for line in measured.read_text().splitlines()]
    assert [w["window"] for w in windows] == [[1, 2], [3, 4]]
    profile = Profile.load(profile_file)
    assert (profile.model, profile.precision.name, profile.attention) == ("tiny", "fp32", "flash")
    assert profile.fusions is not None
    assert sorted(profile.entries) == [("A100-80GB", 2, 2, 64), ("H20", 1, 2, 64),
                                       ("H800", 1, 2, 64)]
    assert {getattr(e, part).source for e in profile.entries.values()
            for part in ("layer", "embedding", "output")} == {"measured"}

    plan, cluster = load_plan(PLAN), load_cluster(LOCAL4)
    cost = evaluate_plan(plan, cluster, resolve_profile(cluster, plan.model, profile, 2, 64))
    assert [s.time_s for s in cost.stages] == pytest.approx(
        [s["per_microbatch_s"] for s in windows[-1]["stages"]], abs=1e-6)

    # merged with an estimated profile of the same figures, given first: measured entries win
    other = estimate_profile(plan.model, cluster, 2, 64)
    other.precision = PRECISIONS["fp32"]
    other.save(tmp_path / "other.yaml")
    planned = tmp_path / "plan.yaml"
    rc, out, err = run_cli(capsys, "plan", "--cluster", LOCAL4, "--model", MODEL,
                           "--global-batch-size", 8, "--micro-batch-size", 2,
                           "--profile", tmp_path / "other.yaml", "--profile", profile_file,
                           "-o", planned)
    assert rc == 0, err
    recorded = Profile.from_dict(load_plan(planned).profile)
    for key, entry in profile.entries.items():
        assert recorded.entries[key] == entry
    assert recorded.get("A100-80GB", 1, 2, 64).layer.source == "estimated"   # other's only

    rc, out, err = run_cli(capsys, "show", PLAN, "--profile", profile_file, "--measured",
                           measured)
    assert rc == 0, err
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("measured iterations 3-4"))
    rows = table("\n".join(lines[start + 1:start + 6]))
    assert [r["compute/mb ms"].endswith("(1.00x)") for r in rows] == [True] * 3
    assert {r["within 10%"] for r in rows} == {"ok"}
