"""Bad resumes of `autohet train --load`: refused before any process starts, or recovered from
an older complete step with one line saying so, or stopped with one line and a non-zero exit -
printed once, not once per rank, and never a Python traceback.

One real job (a two-rank pipeline of the tiny model, `autohet train` through torchrun's agent)
saves steps 2, 4 and 6 in a shared --save directory; each test damages a copy of it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_autohet.checkpoint.manifest import MANIFEST_FILE, read_manifest, step_dir_name
from megatron_autohet.cli.main import main
from megatron_autohet.plan import load_plan, plan_from_dict

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "configs" / "models" / "tiny.yaml"
# The save stops after 6 of the 8 iterations (--exit-interval), so resumes have its schedule.
SCHEDULE = ["--iters", 8, "--lr", "1e-3", "--seed", 7]


def _autohet(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_autohet.cli.main", *map(str, args)],
                          capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))


def _train(plan: Path, *flags) -> list:
    return ["train", "--plan", plan, "--model", MODEL, *SCHEDULE, *flags]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, Path]:
    """(plan file, --save directory holding steps 2, 4 and 6) of one two-rank job."""
    root = tmp_path_factory.mktemp("resume-faults")
    data = load_plan(ROOT / "configs" / "plans" / "tiny-two-pipelines.yaml").to_dict()
    data["ranks"] = [dict(data["ranks"][0], rank=0), dict(data["ranks"][2], rank=1)]
    data["pipelines"] = [{"num_microbatches": 4, "stages": [
        {"ranks": [0], "layers": [0, 3]}, {"ranks": [1], "layers": [3, 6]}]}]
    plan = root / "two-ranks.yaml"
    plan_from_dict(data).save(plan)
    save = root / "save"
    result = _autohet(*_train(plan, "--exit-interval", 6, "--save", save, "--save-interval", 2,
                              "--autohet-keep-ckpts", 3))
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in save.glob("iter_*")) == [step_dir_name(i) for i in (2, 4, 6)]
    return plan, save


@pytest.fixture
def load(saved, tmp_path) -> Path:
    """A copy of the saved directory this test may damage."""
    copy = tmp_path / "load"
    shutil.copytree(saved[1], copy)
    return copy


def _truncate_largest_chunk_file(step: Path) -> Path:
    manifest = read_manifest(step)
    item = max(manifest.items, key=lambda i: i.length)
    path = step / item.file
    with open(path, "r+b") as f:
        f.truncate(item.offset + 10)
    return path


def _no_traceback(result: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in result.stdout + result.stderr, result.stderr[-3000:]


def test_another_model_is_refused_before_any_process(saved, load, capsys):
    """A checkpoint of a model with another hidden size: one line naming the model file, the
    field, both values and the step; exit 2 without starting a process."""
    plan, _ = saved
    manifest = load / step_dir_name(6) / MANIFEST_FILE
    data = json.loads(manifest.read_text())
    data["plan"]["model"]["hidden_size"] = 128
    manifest.write_text(json.dumps(data))
    assert main([str(a) for a in _train(plan, "--load", load)]) == 2
    out, err = capsys.readouterr()
    assert (out, err) == ("", f"autohet train: error: {MODEL}: field 'hidden_size': 64, but "
                              f"{load / step_dir_name(6)} was saved from a model with 128 "
                              "(allowed: the model the checkpoint was saved from, or a --load "
                              "directory of this model's checkpoints)\n")


def test_only_step_with_a_garbage_manifest_is_refused_before_any_process(saved, load, capsys):
    plan, _ = saved
    for iteration in (2, 4):
        shutil.rmtree(load / step_dir_name(iteration))
    manifest = load / step_dir_name(6) / MANIFEST_FILE
    manifest.write_bytes(b"\x00garbage{")
    assert main([str(a) for a in _train(plan, "--load", load)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith(f"autohet train: error: <command line>: field '--load': {manifest}: "
                          "not a readable megatron-autohet checkpoint manifest (")
    assert err.count("\n") == 1


def test_bad_newer_steps_fall_back_to_the_newest_complete_one(saved, load):
    """Step 6's manifest is garbage, a data file of step 4 is cut short (no other copy): the job
    skips 6 and falls back from 4 to 2, saying each once, and trains on from step 2."""
    plan, _ = saved
    manifest = load / step_dir_name(6) / MANIFEST_FILE
    manifest.write_bytes(b"{\"format\": ")
    cut = _truncate_largest_chunk_file(load / step_dir_name(4))
    result = _autohet(*_train(plan, "--load", load))
    assert result.returncode == 0, result.stderr[-3000:]
    _no_traceback(result)
    lines = (result.stdout + result.stderr).splitlines()
    skipped = [line for line in lines if "WARNING:" in line and "skipped" in line]
    assert len(skipped) == 1 and f"WARNING: {manifest}: not a readable" in skipped[0]
    fallback = [line for line in lines if "falling back" in line]
    assert len(fallback) == 1
    assert fallback[0].endswith(
        f"WARNING: cannot recover iteration 4 (files missing or of the wrong size on every "
        f"surviving node: {cut.name}); falling back to iteration 2")
    assert sum("successfully loaded checkpoint: recovered iteration 2," in line
               for line in lines) == 1
    assert sum("iteration        8/       8" in line for line in lines) == 1


def test_a_cut_chunk_without_an_older_step_ends_in_one_line(saved, load):
    """The newest step's data file cut short, no other copy and no older step: every rank stops
    with the same error, printed once, exit status 2."""
    plan, _ = saved
    for iteration in (2, 4):
        shutil.rmtree(load / step_dir_name(iteration))
    cut = _truncate_largest_chunk_file(load / step_dir_name(6))
    result = _autohet(*_train(plan, "--load", load))
    assert result.returncode == 2
    _no_traceback(result)
    errors = [line for line in (result.stdout + result.stderr).splitlines()
              if line.startswith("autohet train: error:")]
    assert errors == [f"autohet train: error: <command line>: field '--load': no checkpoint "
                      f"step in {load} can be recovered: iteration 6: files missing or of the "
                      f"wrong size on every surviving node: {cut.name}"]
