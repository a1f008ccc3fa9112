"""Megatron-LM integration: the patch script, and pretrain_gpt.py --autohet-plan.

Needs a Megatron-LM checkout at tag core_v0.16.1 named by MEGATRON_LM_DIR (it is not a pip
package); skipped otherwise. The checkout itself is never modified: the tests patch copies.
"""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_autohet.launch import free_port

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts/apply_megatron_patch.sh"
PATCH = ROOT / "patches/megatron-lm-core_v0.16.1.patch"
PLAN = ROOT / "configs/plans/tiny-two-pipelines.yaml"
MLM = os.environ.get("MEGATRON_LM_DIR")

pytestmark = pytest.mark.skipif(
    not MLM, reason="set MEGATRON_LM_DIR to a Megatron-LM checkout at tag core_v0.16.1 "
                    "(git clone https://github.com/NVIDIA/Megatron-LM; git checkout core_v0.16.1)")

PATCHED_FILES = ("pretrain_gpt.py", "megatron/training/training.py")


def _pristine_copy(dest: Path, parts=("pretrain_gpt.py", "megatron/training/training.py",
                                      "megatron/core/package_info.py")) -> Path:
    for part in parts:
        (dest / part).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(Path(MLM) / part, dest / part)
    if "megatron-autohet" in (dest / "pretrain_gpt.py").read_text():     # checkout was patched
        subprocess.run(["patch", "-d", str(dest), "-p1", "-R", "--silent", "-i", str(PATCH)],
                       check=True)
    return dest


def _apply(directory: Path):
    return subprocess.run(["bash", str(SCRIPT), str(directory)], capture_output=True, text=True)


def test_apply_is_idempotent(tmp_path):
    copy = _pristine_copy(tmp_path / "mlm")
    first = _apply(copy)
    assert first.returncode == 0, first.stderr
    assert "patched" in first.stdout
    after_first = {f: (copy / f).read_bytes() for f in PATCHED_FILES}
    assert b"add_autohet_args" in after_first["pretrain_gpt.py"]
    assert b"pretrain_from_plan" in after_first["megatron/training/training.py"]
    second = _apply(copy)
    assert second.returncode == 0 and "already has the megatron-autohet patch" in second.stdout
    assert {f: (copy / f).read_bytes() for f in PATCHED_FILES} == after_first
    assert not list(copy.rglob("*.orig")) and not list(copy.rglob("*.rej"))


def test_apply_refuses_other_versions_and_local_edits(tmp_path):
    other = _pristine_copy(tmp_path / "other")
    info = other / "megatron/core/package_info.py"
    info.write_text(info.read_text().replace("PATCH = 1", "PATCH = 0"))
    before = (other / "pretrain_gpt.py").read_bytes()
    result = _apply(other)
    assert result.returncode == 1
    assert "is megatron-core 0.16.0; this patch is for core_v0.16.1" in result.stderr
    assert (other / "pretrain_gpt.py").read_bytes() == before

    edited = _pristine_copy(tmp_path / "edited")
    training = edited / "megatron/training/training.py"
    training.write_text(training.read_text() + "\n# local edit\n")
    result = _apply(edited)
    assert result.returncode == 1 and "differs from core_v0.16.1" in result.stderr
    assert "megatron-autohet" not in (edited / "pretrain_gpt.py").read_text()


def _megatron_lm_runnable() -> str | None:
    for module, why in (("triton", "Megatron-LM's training package imports triton"),
                        ("pybind11", "Megatron-LM compiles the dataset helpers with pybind11")):
        probe = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True)
        if probe.returncode:
            return f"{why}: pip install {module}"
    return None


def _patched_tree(dest: Path) -> Path:
    dest.mkdir(parents=True)
    for part in ("pretrain_gpt.py", "gpt_builders.py", "model_provider.py"):
        shutil.copy(Path(MLM) / part, dest / part)
    shutil.copytree(Path(MLM) / "megatron", dest / "megatron",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "build"))
    if "megatron-autohet" in (dest / "pretrain_gpt.py").read_text():
        return dest
    result = _apply(dest)
    assert result.returncode == 0, result.stderr
    return dest


# Optimizer and schedule flags that both `pretrain_gpt.py` and `autohet train` take, spelled the
# same; --weight-decay is left at Megatron's default 0.01 on both.
SCHEDULE_ARGS = ["--lr", "2e-3", "--min-lr", "2e-4", "--lr-warmup-iters", "1",
                 "--lr-decay-style", "cosine", "--clip-grad", "1.0", "--seed", "1234"]
TINY_ARGS = ["--num-layers", "6", "--hidden-size", "64", "--num-attention-heads", "4",
             "--ffn-hidden-size", "256", "--seq-length", "64", "--max-position-embeddings", "64",
             "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "3",
             *SCHEDULE_ARGS, "--tokenizer-type", "NullTokenizer", "--vocab-size", "511",
             "--distributed-backend", "gloo"]


def _torchrun(tree: Path, args: list[str], tmp_path: Path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
           "--master-port", str(free_port()), "pretrain_gpt.py", "--autohet-plan", str(PLAN), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_DEVICE_MAX_CONNECTIONS="1")
    return subprocess.run(cmd, cwd=tree, capture_output=True, text=True, timeout=300, env=env)


def test_pretrain_gpt_trains_the_plan_like_autohet_train(tmp_path):
    reason = _megatron_lm_runnable()
    if reason:
        pytest.skip(reason)
    tree = _patched_tree(tmp_path / "mlm")
    data_dir = tmp_path / "data"
    metrics = tmp_path / "megatron.jsonl"
    result = _torchrun(tree, TINY_ARGS + ["--autohet-metrics-jsonl", str(metrics),
                                          "--autohet-data-dir", str(data_dir)], tmp_path)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    megatron = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["iteration"] for r in megatron] == [1, 2, 3]
    assert all(math.isfinite(r["lm_loss"]) for r in megatron)

    ours = tmp_path / "autohet.jsonl"
    plain = subprocess.run(
        [sys.executable, "-m", "megatron_autohet.cli.main", "train", "--plan", str(PLAN),
         "--model", str(ROOT / "configs/models/tiny.yaml"), "--iters", "3", *SCHEDULE_ARGS,
         "--metrics-jsonl", str(ours), "--data-dir", str(data_dir)],
        capture_output=True, text=True, timeout=600)
    assert plain.returncode == 0, plain.stderr[-3000:]
    reference = [json.loads(line) for line in ours.read_text().splitlines()]
    # Same runtime, batches, seed, AdamW with weight decay; Megatron-LM's scheduler (counting
    # samples) and ours (counting iterations) give the same learning rates.
    assert len(megatron) == len(reference) == 3
    assert len({r["learning_rate"] for r in megatron}) == 3          # the schedule moved
    for a, b in zip(megatron, reference):
        assert a["learning_rate"] == pytest.approx(b["learning_rate"], rel=1e-12)
        assert a["lm_loss"] == pytest.approx(b["lm_loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)


def test_pretrain_gpt_rejects_flags_that_contradict_the_plan(tmp_path):
    reason = _megatron_lm_runnable()
    if reason:
        pytest.skip(reason)
    tree = _patched_tree(tmp_path / "mlm")
    args = [a if a != "256" else "128" for a in TINY_ARGS]             # --ffn-hidden-size 128
    result = _torchrun(tree, args + ["--autohet-data-dir", str(tmp_path / "data")], tmp_path)
    assert result.returncode != 0
    assert (f"{PLAN}: field '--ffn-hidden-size': Megatron-LM was given 128 but the plan has 256"
            in result.stderr)
