"""An elastic job's measurement windows are events (elastic/worker.py, elastic/events.py): every
window of --autohet-measure-window is one ``drift`` event in the job's events file, written by the
plan's rank 0, naming the stages off their predictions. Two gloo ranks, one generation, a plan
whose predictions are set far below any machine's time (drift is triggered by the plan, never by
timing)."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from helpers.dist_utils import run_on_ranks
from helpers.training import two_ranks
from megatron_autohet.elastic.fleet import Member
from megatron_autohet.runtime.optimizer import OptimizerSettings
from megatron_autohet.spec.cluster import load_cluster

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "configs/clusters/local-4.yaml"


def _generation(rank, world_size, tmp: Path):
    from megatron_autohet.elastic.worker import ElasticWorker
    from megatron_autohet.job import TrainOptions

    plan = two_ranks()
    first = plan.pipelines[0]
    plan.pipelines[0] = replace(first, stages=[replace(first.stages[0], predicted_time_s=1e-9)])
    info = plan.ranks[rank]
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(info.local_rank), AUTOHET_NODE=info.node,
                      AUTOHET_GPU=info.gpu, AUTOHET_LOCAL_ADDR="127.0.0.1")
    options = TrainOptions(iters=4, seed=1, optimizer=OptimizerSettings(lr=1e-3),
                           data_dir=str(tmp / "data"), measure_window=2,
                           distributed_timeout_minutes=1.0)
    worker = ElasticWorker(initial_plan=plan, template=load_cluster(CLUSTER), model=plan.model,
                           options=options, notice_file=None,
                           events_jsonl=str(tmp / "events.jsonl"))
    worker.events = worker._log(rank == 0)          # as run() does: the plan's rank 0 reports
    members = [Member(i.node, i.gpu, i.local_rank) for i in plan.ranks]
    return worker._generation(plan, rank, members).last


def test_every_window_is_a_drift_event_of_the_plans_rank_0(tmp_path, capfd):
    assert run_on_ranks(2, _generation, tmp_path, timeout=300) == [4, 4]
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    drift = [e for e in events if e["event"] == "drift"]
    assert [e["window"] for e in drift] == [[1, 2], [3, 4]]
    for event in drift:
        assert event["reported_by"] == "a100"
        assert [(s["pipeline"], s["stage"], s["gpu"], s["predicted_s"])
                for s in event["drifted"]] == [(0, 0, "A100-80GB", 1e-9)]
        assert event["drifted"][0]["measured_s"] > 0
    out = capfd.readouterr().out
    assert out.count("autohet drift: iterations ") == 2
    assert ("autohet drift: iterations 1-2: 1 of 2 stages more than 10% off their predictions: "
            "pipeline 0 stage 0 (A100-80GB x1) ") in out
