"""`autohet compare` says whether each search completed, in its table and in --json: ours as
`autohet plan` says it (complete, work budget spent, cut by the safety net, then with one
WARNING line naming the flag to raise), the baselines' grids never cut."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from megatron_autohet.cli.main import main
from megatron_autohet.planner import candidate

pytestmark = pytest.mark.unit

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
ARGS = ["compare", "--cluster", str(CONFIGS / "clusters" / "local-4.yaml"), "--model",
        str(CONFIGS / "models" / "tiny.yaml"), "--global-batch-size", "8",
        "--micro-batch-size", "2"]


def test_a_complete_search_says_so(capsys):
    assert main(ARGS) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("> searches: autohet (ours) complete, ")
    assert not any(line.startswith("> WARNING:") for line in out)
    assert out[-1].endswith("SCIP nodes; baselines complete (every grid judged)")
    assert main(ARGS + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    search = data["autohet"]["search"]
    assert search["complete"] is True and search["stopped_by"] == "complete"
    assert search["work"] > 0
    assert all(b["search"]["complete"] for b in data["baselines"])


def test_a_cut_search_says_so(capsys, monkeypatch):
    """The safety net's clock jumps past every deadline (a loaded machine): the search is cut,
    and both outputs say it."""
    ticks = iter(range(10 ** 9))
    monkeypatch.setattr(candidate, "clock", lambda: 1e6 * next(ticks))
    assert main(ARGS) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("> searches: autohet (ours) cut by --time-limit"), out[-1]
    # loud, once: the flag to raise for the plan the work budget decides
    warnings = [line for line in out if line.startswith("> WARNING:")]
    assert warnings == [out[-2]] and "raise --time-limit (e.g. 240)" in out[-2], out
    ticks = iter(range(10 ** 9))
    assert main(ARGS + ["--json"]) == 0
    search = json.loads(capsys.readouterr().out)["autohet"]["search"]
    assert search["complete"] is False and search["stopped_by"] == "time limit"
    assert not math.isnan(search["work"])
