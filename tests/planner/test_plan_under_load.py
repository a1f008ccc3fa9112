"""The same input gives the same plan file on a quiet and on a loaded machine: the search's
budget is counted in work (throughput_search.py, "Deterministic budget"), so busy processes
beside the planner, two per core, change its wall time and nothing else. The input, fleet-96
with LLaMA-2 7B and global batch 256 (6 CPU-s of search), ran past the 60 s default limit
under load when that limit was the search's budget. The safety net is set far out here, so
that only the work budget can end the search whatever the load; where the safety net does end
a search, `autohet plan` says so in a WARNING line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_autohet.cli.main import main
from megatron_autohet.planner import candidate  # the safety net's clock

pytestmark = pytest.mark.integration

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
BUSY_PER_CORE = 2


def plan_file(path: Path) -> bytes:
    assert main(["plan", "--cluster", str(CONFIGS / "clusters/fleet-96.yaml"), "--model",
                 str(CONFIGS / "models/llama2-7b.yaml"), "--global-batch-size", "256",
                 "--time-limit", "3600", "-o", str(path)]) == 0
    return path.read_bytes()


def test_a_loaded_machine_plans_the_same_bytes(tmp_path, capsys):
    quiet = plan_file(tmp_path / "quiet.yaml")
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(BUSY_PER_CORE * (os.cpu_count() or 1))]
    try:
        loaded = plan_file(tmp_path / "loaded.yaml")
    finally:
        for process in busy:
            process.kill()
            process.wait()
    assert loaded == quiet
    # both searches ended on their own, not at the safety net
    assert capsys.readouterr().out.count("; complete, ") == 2


def test_a_search_the_safety_net_cuts_says_so_loudly(tmp_path, capsys, monkeypatch):
    """Where the safety net still decides (a machine slow or loaded enough), `autohet plan`
    prints one WARNING line naming the flag to raise, before its last line."""
    ticks = iter(range(10 ** 9))
    monkeypatch.setattr(candidate, "clock", lambda: 1e6 * next(ticks))
    assert main(["plan", "--cluster", str(CONFIGS / "clusters/local-4.yaml"), "--model",
                 str(CONFIGS / "models/tiny.yaml"), "--global-batch-size", "8",
                 "--micro-batch-size", "2", "--time-limit", "30", "-o",
                 str(tmp_path / "p.yaml")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line for line in out if "WARNING" in line] == [out[-2]]
    assert out[-2].startswith("> WARNING: --time-limit 30 s cut the search before its work "
                              "budget ended it"), out[-2]
    assert "raise --time-limit (e.g. 120)" in out[-2]
