"""--autohet-adapt: the flag's values, and replan where it cannot
switch, refused in one line before any process; a real `autohet train` whose rank 0 logs one
decision per window - the decision planner/adapt.py takes from that window's measurements,
recomputed here from the windows the run wrote (its figures compared with the run's numbers,
never with a wall-clock expectation); and replan through the launcher (tests/test_job_replan.py
switches on injected windows)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from dataclasses import replace

import pytest

from megatron_autohet.checkpoint.options import CheckpointOptions
from megatron_autohet.errors import ConfigError
from megatron_autohet.job import ADAPT_MODES, DEFAULT_ADAPT, ElasticOptions, TrainOptions
from megatron_autohet.plan import load_plan
from megatron_autohet.planner.adapt import (DEFAULT_MODE, MODES, Adapter, confirm_window,
                                            replan_window)
from megatron_autohet.profiling.from_run import priced_entries
from megatron_autohet.runtime.optimizer import OptimizerSettings
from megatron_autohet.runtime.stage_drift import PHASES, window_report
from megatron_autohet.spec.gpus import load_gpu_catalog
from megatron_autohet.spec.precision import PRECISIONS

ROOT = Path(__file__).resolve().parents[2]
PLAN = ROOT / "configs/plans/tiny-two-pipelines.yaml"
MODEL = ROOT / "configs/models/tiny.yaml"


def _autohet(*args, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_autohet.cli.main", *map(str, args)],
                          capture_output=True, text=True, cwd=ROOT, timeout=timeout,
                          env=dict(os.environ))


@pytest.mark.unit
def test_the_modes_are_the_planners_and_replan_is_refused_where_it_cannot_switch():
    """replan: pretrain_gpt.py refuses it (Megatron-LM's loop owns the iterations), and autohet
    train without a checkpoint location (the switch moves the state through it); autohet train
    with --save or --autohet-local-ckpt-dir takes it, and an elastic job (which has a node-local
    directory; tests/elastic/test_elastic_adapt.py switches one)."""
    assert ADAPT_MODES == MODES and DEFAULT_ADAPT == DEFAULT_MODE == "log"
    options = TrainOptions(iters=4, seed=1, optimizer=OptimizerSettings(lr=1e-3), adapt="replan")
    saving = replace(options, checkpoint=CheckpointOptions(save="ckpt", save_interval=2))
    for bad, kwargs, problem in (
            (saving, {"no_replan": "with pretrain_gpt.py --autohet-plan: Megatron-LM's training "
                                   "loop owns the iterations"},
             "replan is not available with pretrain_gpt.py --autohet-plan"),
            (options, {}, "replan needs a checkpoint location")):
        with pytest.raises(ConfigError) as err:
            bad.validate("<command line>", **kwargs)
        assert err.value.field == "--autohet-adapt" and problem in err.value.problem
    assert saving.validate() is saving
    local = replace(options, checkpoint=CheckpointOptions(local_dir="d/{node}", save_interval=2))
    assert local.validate() is local
    elastic = replace(local, elastic=ElasticOptions(cluster="c.yaml"))
    assert elastic.validate() is elastic
    for mode in ("off", "log"):
        TrainOptions(iters=4, seed=1, optimizer=OptimizerSettings(lr=1e-3), adapt=mode).validate()


@pytest.mark.integration
def test_gpu_catalog_prices_types_the_bundled_catalog_lacks_on_every_front_end(tmp_path, capsys):
    """--gpu-catalog (autohet plan's flag) on autohet train, autohet node's train flags and
    pretrain_gpt.py: a job on GPU types outside the bundled catalog adapts (the re-plan search
    starts) with it and says it does not without it; given where nothing is priced, or naming
    no catalog, one line naming the flag."""
    from types import SimpleNamespace

    from megatron_autohet.cli.main import build_parser
    from megatron_autohet.job import adapt_sink
    from megatron_autohet.megatron.args import add_autohet_args
    from megatron_autohet.planner.search import make_plan
    from megatron_autohet.spec.cluster import load_cluster
    from megatron_autohet.spec.gpus import load_gpu_catalog
    from megatron_autohet.spec.model import load_model

    catalog = ROOT / "configs/emulated/gpus.yaml"
    fleet = load_cluster(ROOT / "configs/emulated/three-speeds.yaml", load_gpu_catalog(catalog))
    plan = make_plan(fleet, load_model(ROOT / "configs/emulated/emu-gpt.yaml"), None, 8, 1,
                     progress=False, time_limit_s=20)
    options = TrainOptions(iters=40, seed=1, optimizer=OptimizerSettings(lr=1e-3),
                           measure_window=10, adapt="log")
    trainer = SimpleNamespace(attention="flash", fusions=SimpleNamespace(
        config_fields=lambda: None))
    assert adapt_sink(plan, "emu.yaml", options, trainer, PRECISIONS["fp32"]) is None
    assert "not adapting" in capsys.readouterr().out
    sink = adapt_sink(plan, "emu.yaml", replace(options, gpu_catalog=str(catalog)).validate(),
                      trainer, PRECISIONS["fp32"])
    try:
        assert sink is not None and "not adapting" not in capsys.readouterr().out
    finally:
        sink.close()
    # the flag on each front end's parser (autohet node passes train's flags to its workers)
    train = build_parser().parse_args(["train", "--plan", str(PLAN), "--model", str(MODEL),
                                       "--gpu-catalog", str(catalog)])
    assert train.gpu_catalog == str(catalog)
    import argparse
    megatron = add_autohet_args(argparse.ArgumentParser()).parse_args(["--gpu-catalog", "g.yaml"])
    assert megatron.gpu_catalog == "g.yaml"
    for bad, problem in (
            (replace(options, adapt="off", gpu_catalog=str(catalog)), "prices nothing"),
            (replace(options, measure_window=0, gpu_catalog=str(catalog)), "prices nothing"),
            (replace(options, gpu_catalog=str(tmp_path / "none.yaml")), "file not found")):
        with pytest.raises(ConfigError) as err:
            bad.validate("<command line>")
        assert err.value.field == "--gpu-catalog" and problem in err.value.problem, err.value
    result = _autohet("train", "--plan", PLAN, "--model", MODEL, "--autohet-adapt", "off",
                      "--gpu-catalog", catalog)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "--gpu-catalog" in result.stderr


@pytest.mark.integration
def test_replan_without_checkpoints_and_an_unknown_mode_are_one_line_before_any_process(
        tmp_path):
    result = _autohet("train", "--plan", PLAN, "--model", MODEL, "--autohet-adapt", "replan",
                      "--metrics-jsonl", tmp_path / "m.jsonl")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "autohet train: error: <command line>: field '--autohet-adapt': replan needs a "
        "checkpoint location: every rank saves the iteration of a switch and the new plan "
        "resumes from it (allowed: --save DIR or --autohet-local-ckpt-dir DIR (with "
        "--save-interval), or log)"]
    assert not (tmp_path / "m.jsonl").exists()
    result = _autohet("train", "--plan", PLAN, "--model", MODEL, "--autohet-adapt", "often")
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1
    assert "'--autohet-adapt': got 'often' (allowed: off, log, replan)" in result.stderr


NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
LINE = re.compile(r"^ adapt: iterations (\d+)-(\d+) \(decided after iteration (\d+)\): "
                  r"(SWITCH|keep) \((.*?)\): re-plan predicted (\S+) s per iteration against "
                  r"(\S+) s now .* amortised over (\d+) iterations .*; re-plan search (\S+) s")


@pytest.mark.e2e
def test_log_mode_logs_each_windows_decision_from_its_measurements(tmp_path):
    """Four gloo ranks, eight iterations, windows of two: each window's decision taken at the
    next window's end (its search ran meanwhile in a child process), on rank 0 - the decision
    planner/adapt.py takes from that window as the JSONL recorded it, confirmed on the next
    window's (the same switch, reason and predicted times, amortised over the iterations after
    the decision); the windows whose
    decision would come at or after iteration 8 are not searched; `off` logs none."""
    measured = tmp_path / "measured.jsonl"
    result = _autohet("train", "--plan", PLAN, "--model", MODEL, "--iters", "8",
                      "--data-dir", tmp_path / "data", "--autohet-measure-window", "2",
                      "--autohet-measured-jsonl", measured, "--autohet-adapt", "log")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [LINE.match(line) for line in result.stdout.splitlines()
             if line.startswith(" adapt: ")]
    assert all(lines), result.stdout
    assert [(m[1], m[2], m[3], m[8]) for m in lines] == [("1", "2", "4", "4"),
                                                         ("3", "4", "6", "2")]

    plan = load_plan(PLAN)
    catalog = load_gpu_catalog()
    priors = priced_entries(plan, catalog)
    fixed = dict(catalog=catalog, precision=PRECISIONS["fp32"], attention="flash", fusions=None)
    reports = []
    for window in (json.loads(x) for x in measured.read_text().splitlines()):
        medians = [[0.0] * len(PHASES) for _ in plan.ranks]
        for stage in window["stages"]:
            for r in stage["ranks"]:
                medians[r] = [stage[f"{phase}_s"] for phase in PHASES]
        reports.append(window_report(plan, *window["window"], medians))
    adapter = Adapter()
    for m, report, following in zip(lines, reports, reports[1:]):
        window = (report.first_iteration, report.last_iteration)
        decided_at = following.last_iteration

        def confirm(candidate, following=following):
            return confirm_window(plan, candidate, following.stages,
                                  (following.first_iteration, decided_at), priors, **fixed)
        again = adapter.decide(replan_window(plan, report.stages, window, priors, **fixed),
                               8 - decided_at, decided_at=decided_at, confirm=confirm)
        # The JSONL rounds its times, so the reason's figures may differ in the last digit.
        assert m[4] == ("SWITCH" if again.switch else "keep")
        assert NUMBER.sub("#", m[5]) == NUMBER.sub("#", again.why)
        assert [float(x) for x in NUMBER.findall(m[5])] == pytest.approx(
            [float(x) for x in NUMBER.findall(again.why)], rel=2e-3, abs=0.15)
        assert float(m[6]) == pytest.approx(again.new_s, rel=2e-3)
        assert float(m[7]) == pytest.approx(again.current_s, rel=2e-3)

    result = _autohet("train", "--plan", PLAN, "--model", MODEL, "--iters", "2",
                      "--data-dir", tmp_path / "data", "--autohet-measure-window", "2",
                      "--autohet-adapt", "off")
    assert result.returncode == 0, result.stderr[-3000:]
    assert " adapt: " not in result.stdout


@pytest.mark.e2e
def test_replan_through_the_launcher_decides_every_window_and_trains_every_iteration(tmp_path):
    """autohet train --autohet-adapt replan --save: launch.run_worker's ranks take each
    window's decision at the next window's end, on what the clock measured (switched after
    iteration 4 or 6, or kept: their figures, not asserted here; after a switch at 4 no window
    is left to decide on), and train every iteration once."""
    metrics = tmp_path / "m.jsonl"
    result = _autohet("train", "--plan", PLAN, "--model", MODEL, "--iters", "8",
                      "--data-dir", tmp_path / "data", "--autohet-measure-window", "2",
                      "--autohet-adapt", "replan", "--save", tmp_path / "ckpt",
                      "--save-interval", "8", "--metrics-jsonl", metrics)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [LINE.match(line) for line in result.stdout.splitlines()
             if line.startswith(" adapt: iterations ")]
    assert all(lines) and [(m[1], m[2]) for m in lines] == [("1", "2")] + (
        [] if lines[0][4] == "SWITCH" else [("3", "4")]), result.stdout
    switches = sum(m[4] == "SWITCH" for m in lines)
    assert result.stdout.count("adapt: switched plans after iteration") == switches
    assert [json.loads(x)["iteration"] for x in metrics.read_text().splitlines()] == \
        list(range(1, 9))
