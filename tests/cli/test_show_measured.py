"""`autohet show PLAN --measured FILE`: a job's measured window beside the plan's prediction, per
stage and phase (cli/show.py). The windows are written from synthetic medians by the runtime's own
report (runtime/stage_drift.py ``window_report``), so every figure is known; bad input is one line
naming the file, status 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from helpers.cli import expect_usage_error, run_cli, table
from megatron_autohet.cost_model import evaluate_plan
from megatron_autohet.planner.space import resolve_profile
from megatron_autohet.plan import load_plan
from megatron_autohet.runtime.stage_drift import window_report
from megatron_autohet.spec import load_cluster

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
PLAN = CONFIGS / "plans" / "tiny-two-pipelines.yaml"     # on the bundled local-4
LOCAL4 = CONFIGS / "clusters" / "local-4.yaml"
# per rank, seconds per phase (compute, P2P waits, grad sync, optimizer) over the window
MEDIANS = [[0.030, 0.004, 0.002, 0.001], [0.036, 0.004, 0.002, 0.001],
           [0.0315, 0.006, 0.003, 0.001], [0.050, 0.000, 0.001, 0.002]]


def _write(path: Path, *records: dict) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _window(first: int, last: int, scale: float = 1.0) -> dict:
    medians = [[v * scale for v in rank] for rank in MEDIANS]
    return window_report(load_plan(PLAN), first, last, medians).to_dict()


def _measured_table(out: str) -> list[dict[str, str]]:
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("measured iterations"))
    return table("\n".join(lines[start + 1:start + 6]))


@pytest.mark.unit
def test_the_newest_window_beside_the_prediction(capsys, tmp_path):
    measured = _write(tmp_path / "m.jsonl", _window(1, 20, 2.0), _window(21, 40))
    rc, out, err = run_cli(capsys, "show", PLAN, "--measured", measured)
    assert rc == 0, err
    assert f"measured iterations 21-40 ({measured}): predicted / measured (ratio)" in out
    cluster = load_cluster(LOCAL4)
    plan = load_plan(PLAN)
    cost = evaluate_plan(plan, cluster, resolve_profile(cluster, plan.model, None, 2, 64))
    rows = _measured_table(out)
    assert [(r["pipe"], r["stage"], r["GPU"], r["TP"]) for r in rows] == [
        ("0", "0", "A100-80GB", "2"), ("", "1", "H800", "1"), ("1", "0", "H20", "1")]
    # stage (0, 0): its slowest TP rank, 36 ms over 3 micro-batches
    first = cost.pipelines[0].stages[0]
    assert rows[0]["compute/mb ms"] == (f"{first.time_s * 1e3:.3g} / 12 "
                                        f"({0.012 / first.time_s:.2f}x)")
    # its waits: what of its pipeline's time is not its compute; gradient sync: the wait for
    # the slowest pipeline plus the plan's sync
    waits = cost.pipelines[0].time_s - 3 * first.time_s
    assert rows[0]["P2P wait ms"] == f"{waits * 1e3:.3g} / 4 ({0.004 / waits:.2f}x)"
    sync = cost.pipeline_time_s - cost.pipelines[0].time_s + cost.grad_sync_s
    assert rows[0]["grad sync ms"].startswith(f"{sync * 1e3:.3g} / 2 ")
    assert rows[0]["optimizer ms"].startswith(f"{first.optimizer_s * 1e3:.3g} / 1 ")
    assert rows[2]["compute/mb ms"].split(" (")[0].endswith(" / 50")
    # the CPU's times are far from an estimate of these GPUs'
    assert {r["within 10%"] for r in rows} == {"DRIFT"}
    assert "measured iteration 0.053 s (the slowest rank's median), predicted " in out
    rc, out, _ = run_cli(capsys, "show", PLAN, "--measured", measured, "--window", 7)
    assert rc == 0 and "measured iterations 1-20 " in out
    assert _measured_table(out)[0]["compute/mb ms"].split(" (")[0].endswith(" / 24")


@pytest.mark.unit
def test_windows_of_another_plan_are_passed_over(capsys, tmp_path):
    """An elastic job that re-planned writes both plans' windows to one file."""
    other = _window(41, 60)
    other["stages"] = other["stages"][:2]
    measured = _write(tmp_path / "m.jsonl", _window(21, 40), other)
    rc, out, _ = run_cli(capsys, "show", PLAN, "--measured", measured)
    assert rc == 0
    assert (f"measured iterations 21-40 ({measured}; 1 newer windows of other plans passed "
            "over)") in out


@pytest.mark.unit
def test_the_figure_draws_the_measured_panel(capsys, tmp_path):
    measured = _write(tmp_path / "m.jsonl", _window(1, 20))
    with_measured, plain = tmp_path / "m.png", tmp_path / "p.png"
    assert run_cli(capsys, "show", PLAN, "--measured", measured, "--figure", with_measured)[0] == 0
    assert run_cli(capsys, "show", PLAN, "--figure", plain)[0] == 0
    assert with_measured.read_bytes()[:4] == b"\x89PNG"
    assert with_measured.stat().st_size > plain.stat().st_size     # one more panel


@pytest.mark.unit
def test_bad_measured_files_are_one_line(capsys, tmp_path):
    missing = tmp_path / "none.jsonl"
    what = "the --autohet-measured-jsonl file of a job that trained this plan"
    expect_usage_error(capsys, ["show", PLAN, "--measured", missing],
                       f"autohet show: error: {missing}: field '<file>': file not found "
                       f"(allowed: {what})")
    garbage = tmp_path / "metrics.jsonl"
    garbage.write_text(json.dumps({"iteration": 1, "lm_loss": 6.2}) + "\n")
    expect_usage_error(capsys, ["show", PLAN, "--measured", garbage],
                       f"autohet show: error: {garbage}: field 'line 1': not a measurement "
                       f"window (KeyError: 'window') (allowed: {what})")
    empty = _write(tmp_path / "empty.jsonl")
    expect_usage_error(capsys, ["show", PLAN, "--measured", empty],
                       f"autohet show: error: {empty}: field '<file>': no measurement window in "
                       f"it (allowed: {what})")
    # a window of another plan: the same stages on other ranks, then fewer stages
    raw = yaml.safe_load(PLAN.read_text())
    raw["pipelines"][1]["stages"][0]["layers"] = [0, 6]
    raw["pipelines"][0]["stages"][1]["layers"] = [3, 6]
    raw["pipelines"][0]["stages"][0]["layers"] = [0, 3]
    other_plan = tmp_path / "other.yaml"
    other_plan.write_text(yaml.safe_dump(raw))
    measured = _write(tmp_path / "m.jsonl", _window(1, 20))
    expect_usage_error(capsys, ["show", other_plan, "--measured", measured],
                       f"autohet show: error: {measured}: field 'stages': no window of this "
                       "plan: the newest (iterations 1-20) has pipeline 0 stage 0: A100-80GB "
                       "ranks 0-1 layers 0-3, 3 micro-batches; the plan's pipeline 0 stage 0: "
                       f"A100-80GB ranks 0-1 layers 0-2, 3 micro-batches (allowed: {what})")
    fewer = _window(1, 20)
    fewer["stages"] = fewer["stages"][:2]
    _write(measured, fewer)
    expect_usage_error(capsys, ["show", PLAN, "--measured", measured],
                       f"autohet show: error: {measured}: field 'stages': no window of this "
                       f"plan: the newest (iterations 1-20) has 2 stages, the plan has 3 "
                       f"(allowed: {what})")
    _write(measured, _window(1, 20))
    expect_usage_error(capsys, ["show", PLAN, "--measured", measured, "--window", 21],
                       f"autohet show: error: <command line>: field '--window': no window of "
                       f"this plan in {measured} holds iteration 21 (allowed: an iteration of "
                       "1-20)")
    expect_usage_error(capsys, ["show", PLAN, "--window", 3],
                       "autohet show: error: <command line>: field '--window': needs --measured "
                       "(allowed: --measured M.jsonl --window ITER)")
