"""The job measures itself (runtime/iteration_clock.py, runtime/stage_drift.py): each rank's
phases every iteration, every stage's medians once per window, a line for each stage off its
plan's prediction. The drift is triggered by predictions set in the plan, never by timing."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import pytest

from helpers.dist_utils import run_on_ranks
from helpers.training import OPTIMIZER, PLANS, SEED, global_batches
from megatron_autohet.plan import load_plan
from megatron_autohet.runtime.iteration_clock import IterationClock, IterationTimes
from megatron_autohet.runtime.stage_drift import window_report

PLAN = PLANS / "tiny-two-pipelines.yaml"    # [TP2 | TP1] x 3 micro-batches, [TP1] x 1
SINK_S = 0.2


def _with_predictions(plan, seconds: dict[tuple[int, int], float | None]):
    for (p, s), value in seconds.items():
        plan.pipelines[p].stages[s] = replace(plan.pipelines[p].stages[s],
                                              predicted_time_s=value)
    return plan


@pytest.mark.unit
def test_a_stage_more_than_ten_percent_off_its_prediction_has_drifted():
    """Medians per rank in PHASES order; a stage takes its slowest TP rank's; compute is per
    iteration, the prediction per micro-batch."""
    plan = _with_predictions(load_plan(PLAN), {(0, 0): 0.010, (0, 1): 0.010, (1, 0): None})
    medians = [[0.030, 0.001, 0.002, 0.001],        # rank 0 \ stage (0, 0): 3 micro-batches,
               [0.036, 0.001, 0.002, 0.001],        # rank 1 / slowest 0.036: 1.2x
               [0.0315, 0.004, 0.002, 0.001],       # stage (0, 1): 0.0105 per micro-batch
               [0.050, 0.000, 0.002, 0.001]]        # stage (1, 0): no prediction
    report = window_report(plan, 1, 20, medians)
    assert [(s.pipeline, s.stage) for s in report.drifted()] == [(0, 0)]
    first = report.stages[0]
    assert first.compute_s == 0.036 and first.per_microbatch_s == pytest.approx(0.012)
    assert first.ratio == pytest.approx(1.2)
    assert report.stages[1].ratio == pytest.approx(1.05)
    assert report.stages[2].ratio is None
    assert report.iteration_s == pytest.approx(0.053)
    assert report.lines() == [
        "iterations 1-20: pipeline 0 stage 0 (A100-80GB x2, layers 0-3): forward+backward "
        "0.012 s per micro-batch measured, 0.01 s predicted (1.20x)"]
    record = report.to_dict()
    assert record["window"] == [1, 20]
    assert [s["drifted"] for s in record["stages"]] == [True, False, False]
    assert report.drifted(threshold=0.25) == []


@pytest.mark.unit
def test_a_window_is_one_drift_event_naming_the_drifted_stages():
    """An elastic job's ``drift`` event (elastic/events.py): every window, drifted or not."""
    plan = _with_predictions(load_plan(PLAN), {(0, 0): 0.010, (0, 1): 0.010, (1, 0): 0.100})
    medians = [[0.036, 0, 0, 0], [0.030, 0, 0, 0], [0.0315, 0, 0, 0], [0.050, 0, 0, 0]]
    message, fields = window_report(plan, 21, 40, medians).event()
    assert message == ("iterations 21-40: 2 of 3 stages more than 10% off their predictions: "
                       "pipeline 0 stage 0 (A100-80GB x2) 1.20x, pipeline 1 stage 0 (H20 x1) "
                       "0.50x")
    assert fields["window"] == [21, 40]
    assert fields["drifted"] == [
        {"pipeline": 0, "stage": 0, "gpu": "A100-80GB", "predicted_s": 0.01, "measured_s": 0.012,
         "ratio": 1.2},
        {"pipeline": 1, "stage": 0, "gpu": "H20", "predicted_s": 0.1, "measured_s": 0.05,
         "ratio": 0.5}]
    calm = _with_predictions(load_plan(PLAN), {(0, 0): 0.012, (0, 1): 0.0105, (1, 0): None})
    message, fields = window_report(calm, 1, 20, medians).event()
    assert message == "iterations 1-20: every stage within 10% of its prediction"
    assert fields["drifted"] == []
    message, _ = window_report(load_plan(PLAN), 1, 20, medians).event()
    assert message == "iterations 1-20: no stage has a prediction (measured only)"


@pytest.mark.unit
def test_the_clock_splits_an_iteration_into_its_phases(monkeypatch):
    """Readings at the start, around two P2P waits, and at the three boundaries."""
    readings = iter([10.0, 10.5, 10.7, 11.0, 11.1, 12.0, 12.5, 12.75])
    monkeypatch.setattr("megatron_autohet.runtime.iteration_clock.time.perf_counter",
                        lambda: next(readings))
    import torch

    clock = IterationClock(torch.device("cpu"))
    clock.begin()                                   # 10.0
    with clock.p2p_wait():                          # 10.5 - 10.7
        pass
    with clock.p2p_wait():                          # 11.0 - 11.1
        pass
    clock.phase_done("schedule")                    # 12.0
    clock.phase_done("grad_sync")                   # 12.5
    clock.phase_done("optimizer")                   # 12.75
    times = clock.lap()
    assert times == IterationTimes(compute_s=pytest.approx(1.7), p2p_wait_s=pytest.approx(0.3),
                                   grad_sync_s=0.5, optimizer_s=0.25)
    assert times.total_s == pytest.approx(2.75)
    with clock.p2p_wait():                          # between iterations (evaluation): untimed
        pass
    with pytest.raises(RuntimeError, match="marked"):
        clock.lap()


def _train_measured(rank, world, plan, batches, jsonl, window):
    from megatron_autohet.runtime.optimizer import make_lr_scheduler
    from megatron_autohet.runtime.trainer import HeteroTrainer, train_iterations

    class Batches:
        def batch(self, i):
            return batches[i]

    trainer = HeteroTrainer(plan, plan.model, rank=rank, seed=SEED, optimizer=OPTIMIZER)
    scheduler = make_lr_scheduler(trainer.optimizer, OPTIMIZER, len(batches),
                                  plan.global_batch_size)
    waits = []
    original = trainer.clock.lap

    def lap():
        times = original()
        waits.append(times.p2p_wait_s)
        return times
    trainer.clock.lap = lap
    windows = []

    def sink(report):
        windows.append(report.to_dict())
        time.sleep(SINK_S)      # a sink's work: the window's cost the job logs must hold it
    train_iterations(trainer, Batches(), scheduler, train_iters=len(batches),
                     scheduler_increment=plan.global_batch_size, log=rank == 0,
                     measure_window=window, measured_jsonl=jsonl,
                     metrics_jsonl=str(Path(jsonl).with_name("metrics.jsonl")),
                     on_window=sink)
    return waits, windows


@pytest.mark.integration
def test_a_job_reports_every_window_and_the_stages_off_their_predictions(tmp_path, capfd):
    """Four ranks, five iterations, windows of two: windows [1, 2] and [3, 4] (the fifth
    iteration ends no window), every stage in each; a prediction far below the CPU's time
    drifts, one at the measured time's scale does not (it is within 10% of neither: only the
    far one is asserted), none is never drifted. The P2P waits are timed on the ranks of the
    two-stage pipeline only."""
    plan = _with_predictions(load_plan(PLAN), {(0, 0): 1e-9, (0, 1): None, (1, 0): None})
    batches = global_batches(plan, 5)
    jsonl = tmp_path / "measured.jsonl"
    waits, windows = zip(*run_on_ranks(4, _train_measured, plan, batches, str(jsonl), 2))
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [r["window"] for r in records] == [[1, 2], [3, 4]]
    # the front end's sink (on_window) sees every window, on the rank that logs only
    assert list(windows[0]) == records and windows[1:] == ([], [], [])
    for record in records:
        stages = [(s["pipeline"], s["stage"], s["ranks"]) for s in record["stages"]]
        assert stages == [(0, 0, [0, 1]), (0, 1, [2]), (1, 0, [3])]
        assert all(s["compute_s"] > 0 and s["optimizer_s"] > 0 for s in record["stages"])
        assert [s["drifted"] for s in record["stages"]] == [True, False, False]
    out = capfd.readouterr().out
    assert out.count(" measured iterations ") == 2
    assert " measured iterations 1-2: pipeline 0 stage 0 (A100-80GB x2, layers 0-3)" in out
    # what each window cost after its iteration is logged there (the sink's sleep in it), and
    # the next iteration's elapsed time holds it; no other iteration has the field
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in metrics if r["window_ms"] is not None] == [2, 4]
    assert all(r["window_ms"] >= 1e3 * SINK_S for r in metrics if r["window_ms"] is not None)
    assert metrics[2]["elapsed_ms"] >= metrics[1]["window_ms"]
    # rank 3's pipeline has one stage: no communicator, nothing to wait for
    assert all(w > 0 for r in (0, 1, 2) for w in waits[r]) and waits[3] == [0.0] * 5
