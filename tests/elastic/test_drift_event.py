"""An elastic job's measurement windows are events (elastic/worker.py, elastic/events.py): every
window of --autohet-measure-window is one ``drift`` event in the job's events file, written by the
plan's rank 0, naming the stages off their predictions. Two gloo ranks, one generation, a plan
whose predictions are set far below any machine's time (drift is triggered by the plan, never by
timing)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.dist_utils import run_on_ranks
from helpers.elastic_generation import generation_worker

pytestmark = pytest.mark.integration


def _generation(rank, world_size, tmp: Path):
    worker, plan, members = generation_worker(rank, world_size, tmp)
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
