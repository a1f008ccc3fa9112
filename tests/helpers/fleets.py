"""Small emulated spot fleets for the end-to-end tests: a plan for the tiny model on the
bundled spot-4 cluster, and an :class:`EmulatedFleet` training it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from megatron_autohet.testing.emulate import EmulatedFleet

ROOT = Path(__file__).resolve().parents[2]
# `autohet node --loss-timeout` of the tests that lose a node without notice: a loss confirmed
# 5 s after the node's last keep-alive, not the default's 20 (elastic/liveness.py).
FAST_LOSS_TIMEOUT_S = 5.0
MODEL = ROOT / "configs/models/tiny.yaml"
CLUSTER = ROOT / "configs/clusters/spot-4.yaml"


def make_plan(tmp_path: Path) -> Path:
    plan = tmp_path / "plan.yaml"
    done = subprocess.run([sys.executable, "-m", "megatron_autohet.cli.main", "plan",
                           "--cluster", str(CLUSTER), "--model", str(MODEL),
                           "--global-batch-size", "8", "--micro-batch-size", "1", "-o",
                           str(plan)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    return plan


def fleet_of(tmp_path: Path, plan: Path, iters: int, save: int, **kwargs) -> EmulatedFleet:
    return EmulatedFleet(tmp_path / "job", train_args=[
        "--plan", str(plan), "--model", str(MODEL), "--cluster", str(CLUSTER),
        "--iters", str(iters), "--save-interval", str(save),
        "--data-dir", str(tmp_path / "data")], **kwargs)
