"""runtime/dashboard.py: --tensorboard-dir's event files, read back with tensorboard's own reader,
hold every scalar of every iteration the --metrics-jsonl lines hold, under Megatron-LM's names,
and the job's events as text on the iteration axis; bad flags are one line, status 2."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_autohet.elastic.events import EventLog
from megatron_autohet.runtime.dashboard import Dashboard, DashboardOptions
from megatron_autohet.runtime.train_log import IterationRecord

ROOT = Path(__file__).resolve().parents[2]
PLAN = ROOT / "configs/plans/tiny-two-pipelines.yaml"
MODEL = ROOT / "configs/models/tiny.yaml"


def _read(directory: Path):
    """(scalars: tag -> [(step, value)], texts: event -> [(step, text)]) of every event file in
    ``directory``, by tensorboard's EventAccumulator (what TensorBoard itself loads)."""
    from tensorboard.backend.event_processing import event_accumulator as ea
    from tensorboard.util import tensor_util

    acc = ea.EventAccumulator(str(directory), size_guidance={ea.SCALARS: 0, ea.TENSORS: 0})
    acc.Reload()
    tags = acc.Tags()
    scalars = {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in tags["scalars"]}
    texts = {}
    for tag in tags["tensors"]:
        event = tag.removeprefix("events/").removesuffix("/text_summary")
        texts[event] = [(e.step, tensor_util.make_ndarray(e.tensor_proto).item().decode())
                        for e in acc.Tensors(tag)]
    return scalars, texts


def _expected_scalars(records: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """Megatron-LM's scalar names and what each iteration's JSON line says they hold."""
    by_iteration = {"lm loss": "lm_loss", "learning-rate": "learning_rate",
                    "batch-size": "global_batch_size", "grad-norm": "grad_norm"}
    expected = {}
    for name, field in by_iteration.items():
        expected[name] = [(r["iteration"], r[field]) for r in records]
        expected[f"{name} vs samples"] = [(r["consumed_samples"], r[field]) for r in records]
    expected["iteration-time"] = [(r["iteration"], r["elapsed_ms"] / 1000) for r in records]
    expected["throughput"] = [(r["iteration"], r["throughput_tflops_per_gpu"]) for r in records]
    expected["tokens-per-second"] = [(r["iteration"], r["tokens_per_second"]) for r in records]
    if records[0]["mem_max_allocated_gigabytes"] is not None:      # a GPU job
        expected["mem-max-allocated-bytes"] = [
            (r["iteration"], r["mem_max_allocated_gigabytes"] * 2**30) for r in records]
    return expected


def _check_against(scalars: dict, expected: dict) -> None:
    assert set(scalars) >= set(expected), f"missing: {sorted(set(expected) - set(scalars))}"
    for name, points in expected.items():
        got = scalars[name]
        assert [step for step, _ in got] == [step for step, _ in points], name
        # TensorBoard keeps a scalar as a float32
        assert [v for _, v in got] == pytest.approx([v for _, v in points], rel=1e-6,
                                                    abs=1e-12), name


@pytest.mark.e2e
def test_tensorboard_holds_every_iteration_of_the_metrics_jsonl(tmp_path):
    """A real 4-rank autohet train of tiny-two-pipelines, 4 iterations, a validation every 2 and
    a save every 2: every scalar of every iteration equals the JSON line's (iteration and
    samples axes), the validation losses likewise, the saves are text entries at their
    iterations."""
    metrics, tb = tmp_path / "metrics.jsonl", tmp_path / "tb" / "run"
    result = subprocess.run(
        [sys.executable, "-m", "megatron_autohet.cli.main", "train", "--plan", str(PLAN),
         "--model", str(MODEL), "--iters", "4", "--metrics-jsonl", str(metrics),
         "--tensorboard-dir", str(tb), "--eval-interval", "2", "--eval-iters", "1",
         "--save", str(tmp_path / "ckpt"), "--save-interval", "2",
         "--data-dir", str(tmp_path / "data")],
        capture_output=True, text=True, cwd=ROOT, timeout=600, env=dict(os.environ))
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    records = [r for r in lines if "lm_loss" in r]
    validations = [r for r in lines if "validation_lm_loss" in r]
    assert [r["iteration"] for r in records] == [1, 2, 3, 4]
    assert [r["iteration"] for r in validations] == [2, 4]
    assert len(list(tb.glob("events.out.tfevents.*"))) == 1       # rank 0's only
    scalars, texts = _read(tb)
    expected = _expected_scalars(records)
    samples = {r["iteration"]: r["consumed_samples"] for r in records}
    expected["lm loss validation"] = [(v["iteration"], v["validation_lm_loss"])
                                      for v in validations]
    expected["lm loss validation ppl"] = [(v["iteration"], v["validation_ppl"])
                                          for v in validations]
    expected["lm loss validation vs samples"] = [(samples[v["iteration"]],
                                                  v["validation_lm_loss"]) for v in validations]
    expected["lm loss validation ppl vs samples"] = [(samples[v["iteration"]],
                                                      v["validation_ppl"]) for v in validations]
    _check_against(scalars, expected)
    assert all(math.isfinite(v) for points in scalars.values() for _, v in points)
    assert [step for step, _ in texts["save"]] == [2, 4]
    assert all(text.startswith(f"successfully saved checkpoint from iteration {step:7d}")
               for step, text in texts["save"])


@pytest.mark.unit
def test_events_land_on_the_iteration_axis_and_never_go_back(tmp_path):
    """A restarted elastic job's events before its first iteration (plan, fleet, recovery) are
    written at the iteration it resumed from, just before that iteration's scalars; later ones
    at the last iteration logged (elastic/events.py's sink)."""
    dashboard = Dashboard(DashboardOptions(tensorboard_dir=str(tmp_path / "tb")))
    events = EventLog(None, enabled=True, node="node1", sink=dashboard.event)
    events.emit("fleet", "node1 (2 x A100)")
    events.emit("plan", "kept step 6's plan")

    def record(iteration: int) -> IterationRecord:
        return IterationRecord.make(iteration=iteration, train_iters=9, global_batch_size=8,
                                    seq_length=64, elapsed_s=0.5, learning_rate=1e-3,
                                    lm_loss=5.0 - iteration / 10, grad_norm=1.0,
                                    flops_per_iteration=1e12, world_size=2,
                                    max_allocated_bytes=[2**30, 3 * 2**30])
    dashboard.log(record(7))
    events.emit("recovery", "iteration 6 recovered")
    dashboard.log(record(8))
    events.emit("stop", "preemption notice on node1: saving iteration 8")
    EventLog(None, enabled=False, sink=dashboard.event).emit("saved", "not the reporter")
    dashboard.close()
    scalars, texts = _read(tmp_path / "tb")
    assert texts == {"fleet": [(6, "node1 (2 x A100)")], "plan": [(6, "kept step 6's plan")],
                     "recovery": [(7, "iteration 6 recovered")],
                     "stop": [(8, "preemption notice on node1: saving iteration 8")]}
    assert scalars["mem-max-allocated-bytes"] == [(7, 3 * 2**30), (8, 3 * 2**30)]
    assert [step for step, _ in scalars["lm loss"]] == [7, 8]


@pytest.mark.unit
def test_a_dashboard_that_reports_nothing_writes_no_file(tmp_path):
    Dashboard(DashboardOptions(tensorboard_dir=str(tmp_path / "tb"))).close()
    assert not (tmp_path / "tb").exists()


def _train(*flags) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_autohet.cli.main", "train", "--plan",
                           str(PLAN), "--model", str(MODEL), "--iters", "2", *flags],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)


@pytest.mark.integration
def test_bad_dashboard_flags_are_one_line_before_any_process(tmp_path):
    afile = tmp_path / "a-file"
    afile.write_text("")
    cases = [
        (["--tensorboard-dir", str(afile)],
         f"field '--tensorboard-dir': {afile}: not a directory"),
        (["--tensorboard-dir", str(afile / "tb")],
         f"field '--tensorboard-dir': {afile / 'tb'}: {afile} is not a directory"),
        (["--wandb-exp-name", "run1"], "field '--wandb-exp-name': 'run1' without "
         "--wandb-project (allowed: with --wandb-project NAME only)"),
    ]
    try:
        import wandb  # noqa: F401
    except ImportError:
        cases.append((["--wandb-project", "p"], "field '--wandb-project': 'p': wandb is not "
                      "installed (allowed: pip install wandb, or no --wandb-project"))
    for flags, message in cases:
        result = _train(*flags)
        assert result.returncode == 2, (flags, result.stderr)
        assert len(result.stderr.splitlines()) == 1 and message in result.stderr, result.stderr
        assert "Traceback" not in result.stdout + result.stderr
    assert not list(tmp_path.rglob("events.out.tfevents.*"))


@pytest.mark.unit
def test_dashboard_options_travel_to_the_ranks_as_data(tmp_path):
    """job.TrainOptions.write / read (the launcher's job file): the options reach every rank."""
    from megatron_autohet.job import TrainOptions
    from megatron_autohet.runtime.optimizer import OptimizerSettings

    options = TrainOptions(iters=2, seed=1, optimizer=OptimizerSettings(lr=1e-3),
                           dashboard=DashboardOptions(tensorboard_dir=str(tmp_path / "tb")))
    options.write(tmp_path / "job.json")
    assert TrainOptions.read(tmp_path / "job.json") == options


def _elastic_generation(rank, world_size, tmp: Path):
    """One generation of an elastic job (elastic/worker.py) on two gloo ranks, its windows'
    drift events forced by the plan (helpers/elastic_generation.py), with --tensorboard-dir and
    --metrics-jsonl."""
    from helpers.elastic_generation import generation_worker

    worker, plan, members = generation_worker(
        rank, world_size, tmp, adapt="off", metrics_jsonl=str(tmp / "metrics.jsonl"),
        dashboard=DashboardOptions(tensorboard_dir=str(tmp / "tb")))
    worker.events.emit("plan", "kept the initial plan")      # before the first iteration
    try:
        return worker._generation(plan, rank, members).last
    finally:
        worker.dashboard.close()


@pytest.mark.integration
def test_an_elastic_jobs_events_are_text_beside_its_scalars(tmp_path):
    from helpers.dist_utils import run_on_ranks

    assert run_on_ranks(2, _elastic_generation, tmp_path, timeout=300) == [4, 4]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    scalars, texts = _read(tmp_path / "tb")
    _check_against(scalars, _expected_scalars(records))
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    drift = [e for e in events if e["event"] == "drift"]
    assert [step for step, _ in texts["drift"]] == [2, 4]     # each window's last iteration
    assert all(text.startswith("window") or "A100" in text for _, text in texts["drift"])
    assert len(drift) == 2
    assert texts["plan"] == [(0, "kept the initial plan")]
