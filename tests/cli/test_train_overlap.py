"""`autohet train --overlap-grad-reduce` (and a plan's ``overlap_grad_reduce``) reach the ranks:
the job says so once and trains bit for bit as the same job without it (the same collectives on
the same buffers, runtime/grad_sync.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
PLAN = ROOT / "configs/plans/tiny-two-pipelines.yaml"
MODEL = ROOT / "configs/models/tiny.yaml"
OVERLAPPED = "; gradient sync overlapped with the backward"


def _train(tmp_path: Path, name: str, plan: Path, *flags: str) -> tuple[str, list[tuple]]:
    metrics = tmp_path / f"{name}.jsonl"
    result = subprocess.run(
        [sys.executable, "-m", "megatron_autohet.cli.main", "train", "--plan", str(plan),
         "--model", str(MODEL), "--iters", "3", "--lr", "2e-3", "--lr-warmup-iters", "1",
         "--metrics-jsonl", str(metrics), "--data-dir", str(tmp_path / "data"),
         "--autohet-adapt", "off", *flags],
        capture_output=True, text=True, cwd=ROOT, timeout=300, env=dict(os.environ))
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return result.stdout, [(r["iteration"], r["lm_loss"], r["grad_norm"]) for r in records]


def test_overlap_flag_and_plan_field_train_bit_for_bit_as_without(tmp_path):
    plain_out, plain = _train(tmp_path, "plain", PLAN)
    flag_out, flag = _train(tmp_path, "flag", PLAN, "--overlap-grad-reduce")
    planned = tmp_path / "plan.yaml"
    planned.write_text(PLAN.read_text() + "overlap_grad_reduce: true\n")
    plan_out, from_plan = _train(tmp_path, "plan", planned)
    assert OVERLAPPED not in plain_out
    assert flag_out.count(OVERLAPPED) == plan_out.count(OVERLAPPED) == 1
    assert len(plain) == 3 and flag == plain and from_plan == plain
