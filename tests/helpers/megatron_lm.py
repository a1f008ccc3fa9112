"""What the Megatron-LM integration tests share: the checkout (MEGATRON_LM_DIR), the patch,
pristine copies of the patched files, and reading a job's metrics and output."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]
PATCH = ROOT / "patches/megatron-lm-core_v0.16.1.patch"
PLAN = ROOT / "configs/plans/tiny-two-pipelines.yaml"
MLM = os.environ.get("MEGATRON_LM_DIR")


def pristine_copy(dest: Path, parts=("pretrain_gpt.py", "megatron/training/training.py",
                                      "megatron/core/package_info.py")) -> Path:
    for part in parts:
        (dest / part).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(Path(MLM) / part, dest / part)
    if "megatron-autohet" in (dest / "pretrain_gpt.py").read_text():     # checkout was patched
        subprocess.run(["patch", "-d", str(dest), "-p1", "-R", "--silent", "-i", str(PATCH)],
                       check=True)
    return dest


def megatron_lm_runnable() -> str | None:
    for module, why in (("triton", "Megatron-LM's training package imports triton"),
                        ("pybind11", "Megatron-LM compiles the dataset helpers with pybind11")):
        probe = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True)
        if probe.returncode:
            return f"{why}: pip install {module}"
    return None


# Optimizer and schedule flags that both `pretrain_gpt.py` and `autohet train` take, spelled the
# same; --weight-decay is left at Megatron's default 0.01 on both.
SCHEDULE_ARGS = ["--lr", "2e-3", "--min-lr", "2e-4", "--lr-warmup-iters", "1",
                 "--lr-decay-style", "cosine", "--clip-grad", "1.0", "--seed", "1234"]


def output_tail(result) -> str:
    return (result.stdout + result.stderr)[-4000:]


def logged_metrics(path: Path) -> list[tuple]:
    """(iteration, loss, grad norm, learning rate) of each logged iteration."""
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return [(r["iteration"], r["lm_loss"], r["grad_norm"], r["learning_rate"]) for r in records]
