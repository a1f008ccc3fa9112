"""Megatron-LM integration: the patch script, and pretrain_gpt.py --autohet-plan.

Needs a Megatron-LM checkout at tag core_v0.16.1 named by MEGATRON_LM_DIR (it is not a pip
package); skipped otherwise. The checkout itself is never modified: the tests patch copies.

Each pretrain_gpt.py job is four processes that import Megatron-LM (slow on a small CPU machine),
so the module builds one patched tree and one uninterrupted run for all tests, and the flag checks
that need no job run in one process on Megatron-LM's own parser (:func:`_flag_checks_in_tree`).
"""

import argparse
import contextlib
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_autohet.known_warnings import KNOWN_WARNINGS
from megatron_autohet.system.ports import free_port
from helpers.megatron_lm import (MLM, PLAN, ROOT, SCHEDULE_ARGS, logged_metrics,
                                 megatron_lm_runnable, output_tail, pristine_copy)
from helpers.training import LOSS_REL, NORM_REL

SCRIPT = ROOT / "scripts/apply_megatron_patch.sh"
HOMOGENEOUS = ROOT / "configs/plans/tiny-homogeneous.yaml"      # same model and batch as PLAN

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(
    not MLM, reason="set MEGATRON_LM_DIR to a Megatron-LM checkout at tag core_v0.16.1 "
                    "(git clone https://github.com/NVIDIA/Megatron-LM; git checkout core_v0.16.1)")]

PATCHED_FILES = ("pretrain_gpt.py", "megatron/training/training.py")


def _apply(directory: Path):
    return subprocess.run(["bash", str(SCRIPT), str(directory)], capture_output=True, text=True)


def test_apply_is_idempotent(tmp_path):
    copy = pristine_copy(tmp_path / "mlm")
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
    other = pristine_copy(tmp_path / "other")
    info = other / "megatron/core/package_info.py"
    info.write_text(info.read_text().replace("PATCH = 1", "PATCH = 0"))
    before = (other / "pretrain_gpt.py").read_bytes()
    result = _apply(other)
    assert result.returncode == 1
    assert "is megatron-core 0.16.0; this patch is for core_v0.16.1" in result.stderr
    assert (other / "pretrain_gpt.py").read_bytes() == before

    edited = pristine_copy(tmp_path / "edited")
    training = edited / "megatron/training/training.py"
    training.write_text(training.read_text() + "\n# local edit\n")
    result = _apply(edited)
    assert result.returncode == 1 and "differs from core_v0.16.1" in result.stderr
    assert "megatron-autohet" not in (edited / "pretrain_gpt.py").read_text()


SETUP = ROOT / "scripts/setup_megatron_lm.sh"


def test_setup_script_builds_the_helpers_for_this_python(tmp_path):
    """scripts/setup_megatron_lm.sh on a pristine copy whose `.python-version` names another
    Python and which holds that Python's helper: patched, the other helper gone, this
    interpreter's built and importable."""
    assert "--python PYTHON" in subprocess.run(["bash", str(SETUP), "--help"], capture_output=True,
                                               text=True, check=True).stdout
    copy = pristine_copy(tmp_path / "mlm")
    datasets = copy / "megatron/core/datasets"
    shutil.copytree(Path(MLM) / "megatron/core/datasets", datasets, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    (copy / ".python-version").write_text("3.12\n")
    stale = datasets / "helpers_cpp.cpython-312-x86_64-linux-gnu.so"
    stale.write_bytes(b"built by another Python")
    result = subprocess.run(["bash", str(SETUP), "--python", sys.executable, str(copy)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "megatron-autohet" in (copy / "pretrain_gpt.py").read_text()
    import sysconfig
    built = datasets / f"helpers_cpp{sysconfig.get_config_var('EXT_SUFFIX')}"
    assert sorted(p.name for p in datasets.glob("helpers_cpp*")) == [built.name]
    assert f"dataset helpers: {built}" in result.stdout
    probe = subprocess.run([sys.executable, "-c", "import importlib.util as u, sys; "
                            "s = u.spec_from_file_location('helpers_cpp', sys.argv[1]); "
                            "m = u.module_from_spec(s); s.loader.exec_module(m); "
                            "print(m.build_sample_idx_int64.__name__)", str(built)],
                           capture_output=True, text=True)
    assert probe.stdout.strip() == "build_sample_idx_int64", probe.stderr


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


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """One patched copy for the module: Megatron compiles its dataset helpers into it once."""
    reason = megatron_lm_runnable()
    if reason:
        pytest.skip(reason)
    return _patched_tree(tmp_path_factory.mktemp("mlm") / "tree")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("data")


TRAIN_ITERS = 4
TINY_ARGS = ["--num-layers", "6", "--hidden-size", "64", "--num-attention-heads", "4",
             "--ffn-hidden-size", "256", "--seq-length", "64", "--max-position-embeddings", "64",
             "--micro-batch-size", "2", "--global-batch-size", "8",
             "--train-iters", str(TRAIN_ITERS), *SCHEDULE_ARGS, "--tokenizer-type",
             "NullTokenizer", "--vocab-size", "511", "--distributed-backend", "gloo",
             "--hidden-dropout", "0", "--attention-dropout", "0"]


def _venv_env(path_first: str | None = None, **extra) -> dict:
    """This interpreter's bin first on PATH (``autohet`` is the one of the venv under test), after
    ``path_first``; no CUDA_DEVICE_MAX_CONNECTIONS, as in the documented command (the ranks set
    it, as `autohet train`'s do)."""
    path = os.pathsep.join(p for p in (path_first, str(Path(sys.executable).parent),
                                       os.environ["PATH"]) if p)
    env = dict(os.environ, OMP_NUM_THREADS="1", PATH=path, **extra)
    env.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
    return env


def _torchrun(tree: Path, plan: Path, args: list[str], tiny_args=TINY_ARGS, **env):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
           "--master-port", str(free_port()), "pretrain_gpt.py", "--autohet-plan", str(plan),
           *tiny_args, *map(str, args)]
    return subprocess.run(cmd, cwd=tree, capture_output=True, text=True, timeout=600,
                          env=_venv_env(**env))


def _autohet_torchrun(tree: Path, plan: Path, args: list[str], *torchrun_options: str,
                      tiny_args=TINY_ARGS):
    """The documented command: `autohet torchrun` in place of torchrun."""
    cmd = [sys.executable, "-m", "megatron_autohet.cli.main", "torchrun", "--nproc-per-node",
           "4", "--master-port", str(free_port()), *torchrun_options, "pretrain_gpt.py",
           "--autohet-plan", str(plan), *tiny_args, *map(str, args)]
    env = _venv_env()
    env.pop("OMP_NUM_THREADS")          # as a user types it: autohet torchrun sets it
    return subprocess.run(cmd, cwd=tree, capture_output=True, text=True, timeout=600, env=env)


def _autohet_train(plan: Path, metrics: Path, data_dir: Path, *flags: str) -> str:
    """`autohet train` of ``plan`` with the tiny model, TRAIN_ITERS and SCHEDULE_ARGS: the
    comparison run of the pretrain_gpt.py tests. Returns its stdout."""
    plain = subprocess.run(
        [sys.executable, "-m", "megatron_autohet.cli.main", "train", "--plan", str(plan),
         "--model", str(ROOT / "configs/models/tiny.yaml"), "--iters", str(TRAIN_ITERS),
         *SCHEDULE_ARGS, *flags, "--metrics-jsonl", str(metrics), "--data-dir", str(data_dir)],
        capture_output=True, text=True, timeout=600, env=_venv_env())
    assert plain.returncode == 0, plain.stderr[-3000:]
    return plain.stdout


@pytest.fixture(scope="module")
def uninterrupted_job(tree, data_dir, tmp_path_factory) -> tuple[list[tuple], str]:
    """TRAIN_ITERS iterations of PLAN, no checkpoint: its metrics (what every other run is
    compared with) and its output."""
    metrics = tmp_path_factory.mktemp("uninterrupted") / "metrics.jsonl"
    result = _autohet_torchrun(tree, PLAN, ["--autohet-metrics-jsonl", metrics,
                                            "--autohet-data-dir", data_dir])
    assert result.returncode == 0, output_tail(result)
    return logged_metrics(metrics), result.stdout + result.stderr


@pytest.fixture(scope="module")
def uninterrupted(uninterrupted_job) -> list[tuple]:
    return uninterrupted_job[0]


def _warning_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if re.search(r"warning", line, re.I)]


def test_pretrain_gpt_starts_without_warnings(uninterrupted_job):
    """The documented command's start-up on a CPU: Megatron-LM's known-benign warnings ignored
    (known_warnings.py), one_logger not set up, CUDA_DEVICE_MAX_CONNECTIONS set by the ranks."""
    assert _warning_lines(uninterrupted_job[1]) == []


# Run before pretrain_gpt.py: Megatron-LM's lists of known-benign warnings emptied, so that the
# job shows what they ignore.
_UNFILTERED = """\
import megatron_autohet.known_warnings as known
known.MEGATRON_LM_WARNINGS = known.MEGATRON_LM_LOG_RECORDS = ()
"""


def test_megatron_lm_known_warnings_are_all_given(tree, data_dir, tmp_path):
    """Each entry of MEGATRON_LM_WARNINGS / MEGATRON_LM_LOG_RECORDS is given by a job whose
    filter has them emptied (no stale entry); the vocabulary job stops after
    ``initialize_megatron``, which gives them all."""
    (tmp_path / "sitecustomize.py").write_text(_UNFILTERED)
    pythonpath = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    result = _torchrun(tree, PLAN, ["--vocab-size", "1000", "--autohet-data-dir", data_dir],
                       PYTHONPATH=pythonpath)
    assert "field '--vocab-size'" in result.stderr, output_tail(result)
    from megatron_autohet.known_warnings import MEGATRON_LM_LOG_RECORDS, MEGATRON_LM_WARNINGS
    warned = re.findall(r"^\S+/megatron/\S+:\d+: UserWarning: (.*)$", result.stderr, re.M)
    logged = re.findall(r"^WARNING:(\S+?):(.*)$", result.stdout, re.M)
    assert [m for m, *_ in MEGATRON_LM_WARNINGS
            if not any(re.match(m, message) for message in warned)] == [], output_tail(result)
    assert [m for name, m, *_ in MEGATRON_LM_LOG_RECORDS
            if not any(n == name and re.match(m, msg) for n, msg in logged)] == [], \
        output_tail(result)


def test_first_run_after_setup_builds_no_dataset_helper(tmp_path, data_dir):
    """After scripts/setup_megatron_lm.sh, the first job's rank 0 runs Megatron's helper Makefile
    again: with a ``python3-config`` on PATH that answers for another Python (as pyenv's shim does
    from Megatron-LM's ``.python-version``) it builds nothing."""
    if megatron_lm_runnable():
        pytest.skip(megatron_lm_runnable())
    tree = _patched_tree(tmp_path / "tree")
    setup = subprocess.run(["bash", str(SETUP), "--python", sys.executable, str(tree)],
                           capture_output=True, text=True, timeout=600)
    assert setup.returncode == 0, setup.stdout + setup.stderr
    datasets = tree / "megatron/core/datasets"
    built = {p.name: p.stat().st_mtime_ns for p in datasets.glob("helpers_cpp*")}
    other = tmp_path / "other-python"
    other.mkdir()
    config = other / "python3-config"
    config.write_text("#!/bin/sh\necho .cpython-312-x86_64-linux-gnu.so\n")
    config.chmod(0o755)
    result = _torchrun(tree, PLAN, ["--vocab-size", "1000", "--autohet-data-dir", data_dir],
                       path_first=str(other))
    assert "field '--vocab-size'" in result.stderr, output_tail(result)    # initialised
    assert "> compiling dataset index builder" in result.stdout, output_tail(result)
    assert {p.name: p.stat().st_mtime_ns for p in datasets.glob("helpers_cpp*")} == built


def test_pretrain_gpt_trains_the_plan_like_autohet_train(uninterrupted, data_dir, tmp_path):
    assert [m[0] for m in uninterrupted] == list(range(1, TRAIN_ITERS + 1))
    assert all(math.isfinite(m[1]) for m in uninterrupted)
    ours = tmp_path / "autohet.jsonl"
    _autohet_train(PLAN, ours, data_dir)
    reference = logged_metrics(ours)
    # Same runtime, batches, seed, AdamW with weight decay; Megatron-LM's scheduler and ours
    # (both counting samples) give the same learning rates.
    assert len(uninterrupted) == len(reference) == TRAIN_ITERS
    assert len({m[3] for m in uninterrupted}) == TRAIN_ITERS          # the schedule moved
    for (_, loss, norm, lr), (_, ref_loss, ref_norm, ref_lr) in zip(uninterrupted, reference):
        assert lr == pytest.approx(ref_lr, rel=1e-12)
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        assert norm == pytest.approx(ref_norm, rel=1e-5)


def test_pretrain_gpt_use_distributed_optimizer(uninterrupted, tree, data_dir, tmp_path):
    """Megatron-LM's --use-distributed-optimizer reaches the plan runtime: the Adam state is
    sharded, the training the same."""
    metrics = tmp_path / "metrics.jsonl"
    result = _torchrun(tree, PLAN, ["--use-distributed-optimizer", "--autohet-metrics-jsonl",
                                    metrics, "--autohet-data-dir", data_dir])
    assert result.returncode == 0, output_tail(result)
    assert "> distributed optimizer: rank 0 keeps" in result.stdout
    for (_, loss, norm, lr), (_, ref_loss, ref_norm, ref_lr) in zip(logged_metrics(metrics),
                                                                    uninterrupted):
        assert lr == ref_lr
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        assert norm == pytest.approx(ref_norm, rel=1e-5)


def test_pretrain_gpt_overlap_grad_reduce(uninterrupted, tree, data_dir, tmp_path):
    """Megatron-LM's --overlap-grad-reduce reaches the plan runtime: each bucket synced during
    the backward, the training bit for bit the same (runtime/grad_sync.py)."""
    metrics = tmp_path / "metrics.jsonl"
    result = _torchrun(tree, PLAN, ["--overlap-grad-reduce", "--autohet-metrics-jsonl", metrics,
                                    "--autohet-data-dir", data_dir])
    assert result.returncode == 0, output_tail(result)
    assert result.stdout.count("; gradient sync overlapped with the backward") == 1
    assert logged_metrics(metrics) == uninterrupted


def _repeated_diagnostics(output: str) -> dict[str, int]:
    """Warning and log lines that appear more than once in a job's output (once per rank)."""
    lines = [line for line in output.splitlines()
             if "Warning" in line or line.startswith(("WARNING", "INFO:", "ERROR"))]
    return {line: lines.count(line) for line in set(lines) if lines.count(line) > 1}


def test_pretrain_gpt_bf16_with_distributed_optimizer_like_autohet_train(tree, data_dir,
                                                                           tmp_path):
    """--bf16 --use-distributed-optimizer, Megatron-LM's usual combination, trains the plan as
    ``autohet train --bf16 --use-distributed-optimizer`` does (the same runtime), and every
    warning or log line of the four ranks appears once."""

    flags = ["--bf16", "--use-distributed-optimizer"]
    metrics = tmp_path / "pretrain.jsonl"
    result = _torchrun(tree, PLAN, [*flags, "--autohet-metrics-jsonl", metrics,
                                    "--autohet-data-dir", data_dir])
    assert result.returncode == 0, output_tail(result)
    assert "> distributed optimizer: rank 0 keeps" in result.stdout
    # megatron-core's known-benign warnings: ignored on every rank (known_warnings.py)
    assert [m for m, *_ in KNOWN_WARNINGS if re.search(m, result.stderr)] == []
    assert _repeated_diagnostics(result.stdout + result.stderr) == {}
    ours = tmp_path / "autohet.jsonl"
    assert "training in bf16 (--bf16)" in _autohet_train(PLAN, ours, data_dir, *flags)
    pretrain, reference = logged_metrics(metrics), logged_metrics(ours)
    assert len(pretrain) == len(reference) == TRAIN_ITERS
    for (_, loss, norm, lr), (_, ref_loss, ref_norm, ref_lr) in zip(pretrain, reference):
        assert lr == pytest.approx(ref_lr, rel=1e-12)
        assert loss == pytest.approx(ref_loss, rel=LOSS_REL)
        assert norm == pytest.approx(ref_norm, rel=NORM_REL)


@pytest.fixture(scope="module")
def saved_half(tree, data_dir, uninterrupted, tmp_path_factory) -> Path:
    """--save/--save-interval/--exit-interval stop PLAN after TRAIN_ITERS // 2 iterations: the
    --save directory (tests resume from copies of it)."""
    half = TRAIN_ITERS // 2
    root = tmp_path_factory.mktemp("saved_half")
    ckpt, first = root / "ckpt", root / "first.jsonl"
    saved = _torchrun(tree, PLAN, ["--save", ckpt, "--save-interval", half,
                                   "--exit-interval", half, "--autohet-metrics-jsonl", first,
                                   "--autohet-data-dir", data_dir])
    assert saved.returncode == 0, output_tail(saved)
    assert logged_metrics(first) == uninterrupted[:half]                    # bit-identical
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == str(half)
    return ckpt


def test_pretrain_gpt_resumes_on_another_plan_like_an_uninterrupted_run(tree, data_dir,
                                                                        uninterrupted, saved_half,
                                                                        tmp_path):
    """--load resumes the half-way step on HOMOGENEOUS (other layer split, no TP): the weights,
    Adam state, Megatron's sample-counting scheduler and the data position all have to come
    back for the numbers to match."""
    half = TRAIN_ITERS // 2
    ckpt, rest = tmp_path / "ckpt", tmp_path / "rest.jsonl"
    shutil.copytree(saved_half, ckpt)
    resumed = _torchrun(tree, HOMOGENEOUS, ["--load", ckpt, "--exit-on-missing-checkpoint",
                                            "--autohet-metrics-jsonl", rest,
                                            "--autohet-data-dir", data_dir])
    assert resumed.returncode == 0, output_tail(resumed)
    after = logged_metrics(rest)
    assert [m[0] for m in after] == list(range(half + 1, TRAIN_ITERS + 1))
    for (_, loss, norm, lr), (_, ref_loss, ref_norm, ref_lr) in zip(after, uninterrupted[half:]):
        assert lr == ref_lr
        assert loss == pytest.approx(ref_loss, rel=1e-6)
        assert norm == pytest.approx(ref_norm, rel=1e-6)


def test_pretrain_gpt_changed_schedule_is_refused_or_overridden(tree, data_dir, saved_half,
                                                                 tmp_path):
    """--train-iters 4 -> 6 on resume: without a flag one error line (not megatron-core's
    AssertionError on every rank); with --override-opt-param-scheduler Megatron's scheduler
    takes the new flags from the checkpoint's 16 samples on (expected rates: a fresh
    megatron-core scheduler built from hand-written sample counts)."""
    import torch
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    half, longer = TRAIN_ITERS // 2, 6
    ckpt, rest = tmp_path / "ckpt", tmp_path / "rest.jsonl"
    shutil.copytree(saved_half, ckpt)
    common = ["--load", ckpt, "--train-iters", longer, "--autohet-data-dir", data_dir]
    refused = _torchrun(tree, HOMOGENEOUS, common)
    assert refused.returncode != 0
    line = ("pretrain_gpt.py: error: <command line>: field '--lr-decay-iters': this run's "
            "learning-rate schedule has lr_decay_steps 48, the checkpoint's iteration 2 was "
            "trained with 32 (allowed: the checkpoint's flags (the schedule continues where it "
            "stopped), or --override-opt-param-scheduler (this run's schedule, from the "
            "checkpoint's sample count on) or --use-checkpoint-opt-param-scheduler (the "
            "checkpoint's schedule))\n")
    assert refused.stderr.count(line) == 1, output_tail(refused)
    # no traceback of a rank (torchrun's own ChildFailedError summary follows any failed job)
    assert "AssertionError" not in refused.stderr, output_tail(refused)
    assert "ConfigError" not in refused.stderr, output_tail(refused)
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", refused.stderr)
    assert codes and set(codes) <= {"2", "-15"} and "2" in codes, output_tail(refused)

    # the same refusal by `autohet torchrun`: only the ranks can decide it (Megatron-LM's
    # scheduler), so they print it, and the job ends in one more line with their status
    ended = _autohet_torchrun(tree, HOMOGENEOUS, common)
    assert ended.returncode == 2, output_tail(ended)
    assert "Traceback" not in ended.stdout + ended.stderr, output_tail(ended)
    assert ended.stderr.count(line) == 1, output_tail(ended)
    assert re.fullmatch(r"autohet torchrun: rank \d exited with status 2; its lines are above",
                        ended.stderr.splitlines()[-1]), output_tail(ended)

    overridden = _torchrun(tree, HOMOGENEOUS, [*common, "--override-opt-param-scheduler",
                                               "--autohet-metrics-jsonl", rest])
    assert overridden.returncode == 0, output_tail(overridden)
    after = logged_metrics(rest)
    assert [m[0] for m in after] == list(range(half + 1, longer + 1))
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    fresh = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=2e-3, min_lr=2e-4,
                                    lr_warmup_steps=8, lr_decay_steps=longer * 8,
                                    lr_decay_style="cosine", start_wd=0.01, end_wd=0.01,
                                    wd_incr_steps=longer * 8, wd_incr_style="constant")
    fresh.step(half * 8)
    expected = []
    for _ in after:                      # the logged rate is the one after the iteration's step
        fresh.step(8)
        expected.append(optimizer.param_groups[0]["lr"])
    assert [m[3] for m in after] == expected


@pytest.mark.parametrize("case", ["refused flag", "vocabulary", "missing checkpoint"])
def test_pretrain_gpt_stops_with_one_error_line(case, tree, data_dir, tmp_path):
    """Every rank raises the same ConfigError: one line on stderr, every rank exits 2. A flag
    outside the allow-list stops the job before Megatron-LM initialises; the vocabulary is
    checked on Megatron's tokenizer, after it."""
    flags, problem = {
        "refused flag": (["--ckpt-format", "torch"],
                         f"{PLAN}: field '--ckpt-format': 'torch' is not supported with "
                         "--autohet-plan (allowed: torch_dist, the format megatron-autohet "
                         "writes)"),
        "vocabulary": (["--vocab-size", "1000"],
                       f"{PLAN}: field '--vocab-size': Megatron-LM's NullTokenizer has 1001 "
                       "tokens but the plan's model has vocab_size 512 (allowed: a tokenizer of "
                       "512 tokens (NullTokenizer: --vocab-size 511, the EOD token is added))"),
        # the resume's error (job.train_job's checkpointer), as autohet train words it
        "missing checkpoint": (["--load", tmp_path, "--exit-on-missing-checkpoint"],
                               f"<command line>: field '--load': no complete checkpoint in "
                               f"{tmp_path} (allowed: a directory holding one, as "
                               "--exit-on-missing-checkpoint is set)"),
    }[case]
    result = _torchrun(tree, PLAN, [*flags, "--autohet-data-dir", data_dir])
    assert result.returncode != 0
    line = f"pretrain_gpt.py: error: {problem}\n"
    assert result.stderr.count(line) == 1, output_tail(result)
    assert "ConfigError" not in result.stderr, output_tail(result)           # no traceback
    # torchrun exits 1 when a worker fails; its summary names each worker's status.
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", result.stderr)
    assert codes and set(codes) <= {"2", "-15"} and "2" in codes, output_tail(result)


# The Megatron-LM path's mistaken command lines: (case, pretrain_gpt.py arguments after the tiny
# model's, torchrun options, the line after "autohet torchrun: error: "), {ckpt} an empty
# directory, {plan} the plan file.
MISTAKES = [
    ("refused flag", ["--ckpt-format", "torch"], [],
     "{plan}: field '--ckpt-format': 'torch' is not supported with --autohet-plan (allowed: "
     "torch_dist, the format megatron-autohet writes)"),
    ("flag Megatron-LM does not know", ["--no-such-flag"], [],
     "<command line>: field 'pretrain_gpt.py's arguments': unrecognized arguments: "
     "--no-such-flag (allowed: pretrain_gpt.py --help lists them)"),
    ("model flag against the plan", ["--num-layers", "4"], [],
     "{plan}: field '--num-layers': Megatron-LM was given 4 but the plan has 6 (allowed: 6 (the "
     "plan's value))"),
    ("vocabulary", ["--vocab-size", "1000"], [],
     "{plan}: field '--vocab-size': Megatron-LM's NullTokenizer has 1001 tokens but the plan's "
     "model has vocab_size 512 (allowed: a tokenizer of 512 tokens (NullTokenizer: --vocab-size "
     "511, the EOD token is added))"),
    ("processes against the plan's ranks", [], ["--nproc-per-node", "2"],
     "<command line>: field '--nproc-per-node': torchrun would start 2 processes, the plan "
     "{plan} has 4 ranks (allowed: 4 processes in all (one per planned GPU))"),
    ("missing data prefix", ["--data-path", "{ckpt}/text"], [],
     "<command line>: field '--data-path': {ckpt}/text.bin not found"),
    ("missing checkpoint", ["--load", "{ckpt}", "--exit-on-missing-checkpoint"], [],
     "<command line>: field '--load': no complete checkpoint in {ckpt} (allowed: a directory "
     "holding one, as --exit-on-missing-checkpoint is set)"),
]


@pytest.mark.parametrize("case,args,options,line", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_autohet_torchrun_refuses_a_mistake_in_one_line_before_any_process(
        case, args, options, line, tree, data_dir, tmp_path):
    """Each of the ranks' checks that needs no rank, made by `autohet torchrun` first: one line,
    status 2, no traceback, no rank started (a rank would print Megatron-LM's arguments)."""
    names = {"ckpt": tmp_path, "plan": PLAN}
    args = [a.format(**names) for a in args]
    result = _autohet_torchrun(tree, PLAN, [*args, "--autohet-data-dir", data_dir], *options)
    output = (result.stdout + result.stderr).strip().splitlines()
    assert result.returncode == 2, output_tail(result)
    assert "Traceback" not in result.stdout + result.stderr, output_tail(result)
    assert len(output) <= 2, output
    assert result.stderr.startswith("autohet torchrun: error: " + line.format(**names)), \
        output_tail(result)


# A plan `autohet train` runs that Megatron-LM's own batch arithmetic would refuse: global
# batch 4 of micro-batches of 2 on 4 ranks (Megatron's grid: data-parallel 4, 4 % (2 * 4) != 0).
# Two pipelines of one micro-batch each, with full activation recompute.
SMALL_BATCH_PLAN = """\
format_version: 1
cluster: local-4
model: {name: tiny, num_layers: 6, hidden_size: 64, num_attention_heads: 4, ffn_hidden_size: 256,
        vocab_size: 512, seq_length: 64, num_query_groups: 4, gated_linear_unit: false,
        position_embedding_type: learned_absolute, tie_embeddings: true}
micro_batch_size: 2
global_batch_size: 4
seq_length: 64
activation_recompute: true
ranks:
  - {rank: 0, node: a100, local_rank: 0, gpu: A100-80GB}
  - {rank: 1, node: a100, local_rank: 1, gpu: A100-80GB}
  - {rank: 2, node: h800, local_rank: 0, gpu: H800}
  - {rank: 3, node: h20, local_rank: 0, gpu: H20}
pipelines:
  - num_microbatches: 1
    stages:
      - {ranks: [0, 1], layers: [0, 4]}
      - {ranks: [2], layers: [4, 6]}
  - num_microbatches: 1
    stages:
      - {ranks: [3], layers: [0, 6]}
"""
EVAL_ARGS = ["--eval-interval", "2", "--eval-iters", "2"]


def test_pretrain_gpt_small_batch_recompute_dropout_and_evaluation_like_autohet_train(
        tree, data_dir, tmp_path):
    """Global batch 4 on 4 ranks is not refused; the plan's recompute, Megatron's dropout flags
    and --eval-interval/--eval-iters run on both paths with the same numbers (the same dropout
    masks, replayed by the recompute): training and validation losses (validation on the
    built-in corpus's 969,30,1 split after iterations 2 and 4), and Megatron's validation line
    on the console."""
    plan = tmp_path / "small-batch.yaml"
    plan.write_text(SMALL_BATCH_PLAN)
    tiny = list(TINY_ARGS)
    tiny[tiny.index("--global-batch-size") + 1] = "4"
    tiny[tiny.index("--hidden-dropout") + 1] = tiny[tiny.index("--attention-dropout") + 1] = "0.1"
    ours, theirs = tmp_path / "autohet.jsonl", tmp_path / "megatron.jsonl"
    megatron = _torchrun(tree, plan, [*EVAL_ARGS, "--recompute-granularity", "full",
                                      "--recompute-method", "uniform", "--recompute-num-layers",
                                      "1", "--log-interval", "1", "--autohet-metrics-jsonl",
                                      theirs, "--autohet-data-dir", data_dir], tiny_args=tiny)
    assert megatron.returncode == 0, output_tail(megatron)
    _autohet_train(plan, ours, data_dir, *EVAL_ARGS, "--hidden-dropout", "0.1",
                   "--attention-dropout", "0.1")
    records = [json.loads(line) for line in theirs.read_text().splitlines()]
    reference = [json.loads(line) for line in ours.read_text().splitlines()]
    assert [sorted(r) for r in records] == [sorted(r) for r in reference]
    validation = [r for r in records if "validation_lm_loss" in r]
    assert [r["iteration"] for r in validation] == [2, 4]
    for got, want in zip(records, reference):
        key = "validation_lm_loss" if "validation_lm_loss" in got else "lm_loss"
        assert got[key] == pytest.approx(want[key], rel=1e-5)
    for r in validation:
        line = f" validation loss at iteration {r['iteration']} | lm loss value: "
        assert megatron.stdout.count(line + f"{r['validation_lm_loss']:.6E} |") == 1, \
            output_tail(megatron)


def test_flags_on_megatron_lm_parser(tree, tmp_path):
    """The flag checks that need no job (:func:`_flag_checks_in_tree`), in one process inside the
    patched tree: seconds instead of a four-process launch per flag."""
    code = ("from test_megatron_lm import _flag_checks_in_tree; "
            f"_flag_checks_in_tree({str(tmp_path)!r})")
    # this folder and tests/ (helpers) first, and whatever PYTHONPATH already names (a worktree
    # shadowing the install)
    pythonpath = os.pathsep.join(p for p in (str(Path(__file__).parent),
                                             str(Path(__file__).resolve().parents[1]),
                                             os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=pythonpath, RANK="0", WORLD_SIZE="4")
    result = subprocess.run([sys.executable, "-c", code], cwd=tree, capture_output=True,
                            text=True, timeout=600, env=env)
    assert result.returncode == 0, output_tail(result)


def _other_value(action: argparse.Action, off) -> str:
    """A command-line value of ``action`` other than ``off``."""
    if action.choices:
        return next(str(c) for c in action.choices if c != off)
    return str((off or 0) + 1) if action.type is int else "x"


def _flag_checks_in_tree(tmp: str) -> None:
    """Runs where ``megatron`` is Megatron-LM's package (the patched tree is the working directory,
    WORLD_SIZE=4): Megatron's parser, validated as ``pretrain()`` does, against check_megatron_args,
    and every unsupported flag's name, attribute and default against Megatron's parser."""
    from megatron.training.arguments import parse_args, validate_args

    from megatron_autohet.checkpoint.options import CheckpointOptions
    from megatron_autohet.errors import ConfigError
    from megatron_autohet.megatron import hooks
    from megatron_autohet.megatron.args import add_autohet_args
    from megatron_autohet.plan import load_plan

    plan = load_plan(PLAN)

    def megatron_args(*flags) -> argparse.Namespace:
        sys.argv = ["pretrain_gpt.py", "--autohet-plan", str(PLAN), *TINY_ARGS, *flags]
        with contextlib.redirect_stdout(io.StringIO()):              # validate_args prints args
            return validate_args(parse_args(extra_args_provider=add_autohet_args))

    def error(*flags) -> str | None:
        args = megatron_args(*flags)
        try:
            hooks.check_megatron_args(args, plan, PLAN)
            hooks.train_options(args, PLAN)
        except ConfigError as err:
            return str(err)
        return None

    assert error() is None
    assert hooks.train_options(megatron_args("--overlap-grad-reduce"), PLAN).overlap_grad_reduce
    assert hooks.train_options(megatron_args(), PLAN).checkpoint == CheckpointOptions()
    honoured = megatron_args("--save", tmp, "--save-interval", "2", "--load", tmp,
                             "--exit-interval", "2", "--autohet-keep-ckpts", "3",
                             "--exit-on-missing-checkpoint", "--use-checkpoint-opt-param-scheduler",
                             "--use-dist-ckpt")
    hooks.check_megatron_args(honoured, plan, PLAN)
    assert hooks.train_options(honoured, PLAN).checkpoint == CheckpointOptions(
        save=tmp, save_interval=2, load=tmp, keep=3, exit_on_missing_checkpoint=True)
    resume = megatron_args("--load", tmp, "--ckpt-step", "2", "--no-load-optim", "--no-load-rng",
                           "--finetune")
    assert hooks.train_options(resume, PLAN).checkpoint == CheckpointOptions(
        load=tmp, ckpt_step=2, no_load_optim=True, no_load_rng=True, finetune=True)
    assert error("--finetune") == (f"{PLAN}: field '--finetune': given without --load "
                                   "(allowed: with --load DIR (it says what a resume takes from "
                                   "the step))")
    assert error("--load", tmp, "--override-opt-param-scheduler",
                 "--use-checkpoint-opt-param-scheduler") == (
        f"{PLAN}: field '--override-opt-param-scheduler': given with "
        "--use-checkpoint-opt-param-scheduler (allowed: one of them: this run's schedule "
        "(override) or the checkpoint's)")
    local = megatron_args("--autohet-local-ckpt-dir", f"{tmp}/{{node}}", "--save-interval", "2")
    assert hooks.train_options(local, PLAN).checkpoint == CheckpointOptions(
        local_dir=f"{tmp}/{{node}}", save_interval=2)
    with pytest.raises(ConfigError) as no_place:              # CheckpointOptions' own error
        CheckpointOptions(save_interval=2).validate(str(PLAN))
    assert error("--save-interval", "2") == str(no_place.value)
    assert error("--ffn-hidden-size", "128") == (
        f"{PLAN}: field '--ffn-hidden-size': Megatron-LM was given 128 but the plan has 256 "
        "(allowed: 256 (the plan's value))")
    # validate_args turns --async-save off (with a warning) unless --use-persistent-ckpt-worker;
    # kept, it is the background writer's.
    assert megatron_args("--async-save").async_save is False
    background = megatron_args("--async-save", "--use-persistent-ckpt-worker", "--save", tmp,
                               "--save-interval", "2", "--autohet-s3-uri", "s3://bucket/run",
                               "--autohet-s3-endpoint-url", "http://127.0.0.1:9")
    assert hooks.train_options(background, PLAN).checkpoint == CheckpointOptions(
        save=tmp, save_interval=2, async_save=True, s3_uri="s3://bucket/run",
        s3_endpoint_url="http://127.0.0.1:9")

    _allow_list_checks(tmp)
    _model_flag_checks(megatron_args, error)

    help_text = io.StringIO()
    with contextlib.redirect_stdout(help_text), pytest.raises(SystemExit) as done:
        hooks.prepare_process(["pretrain_gpt.py", "--help"])
    assert done.value.code == 0
    assert "--autohet-plan" in help_text.getvalue()
    assert "--autohet-keep-ckpts" in help_text.getvalue()


def _allow_list_checks(tmp: str) -> None:
    """megatron/flags.py: every flag of the table is Megatron-LM's; the job's flags pass; a
    flag set to something other than Megatron's default is refused unless the table honours
    it, with the table's alternative for the refused ones, before Megatron-LM starts."""
    from megatron_autohet.errors import ConfigError
    from megatron_autohet.megatron.flags import FLAGS, REFUSED, check_flags, megatron_parser

    parser = megatron_parser()
    assert set(FLAGS) - set(parser._option_string_actions) == set(), "not Megatron-LM's"
    job = ["--autohet-plan", str(PLAN), *TINY_ARGS]
    check_flags(job, parser)
    check_flags([*job, "--save", tmp, "--save-interval", "2", "--use-dist-ckpt",
                 "--no-bias-gelu-fusion", "--eval-interval", "2", "--eval-iters", "1",
                 "--recompute-granularity", "full", "--log-interval", "1"], parser)

    def refusal(*flags) -> str:
        with pytest.raises(ConfigError) as refused:
            check_flags([*job, *flags], parser)
        return str(refused.value)

    check_flags([*job, "--overlap-grad-reduce"], parser)
    assert refusal("--use-distributed-optimizer", "--overlap-grad-reduce",
                   "--overlap-param-gather") == (
        f"{PLAN}: field '--overlap-param-gather': not yet supported with --autohet-plan "
        "(allowed: not set (the distributed optimizer gathers the weights after its step, not "
        "during the next forward))")
    check_flags([*job, "--tensorboard-dir", tmp, "--log-timers-to-tensorboard",
                 "--log-throughput"], parser)              # honoured (runtime/dashboard.py)
    assert refusal("--wandb-entity", "team") == (
        f"{PLAN}: field '--wandb-entity': 'team' is not supported with --autohet-plan "
        "(allowed: its default (docs/megatron-lm.md, 'Megatron-LM flags with --autohet-plan', "
        "lists the flags the plan path honours))")
    assert refusal("--fp16") == (f"{PLAN}: field '--fp16': not yet supported with --autohet-plan "
                                 "(allowed: not set (fp16 needs a dynamic loss scaler, which the "
                                 "plan runtime does not have; --bf16 trains in bf16 mixed "
                                 "precision))")
    assert refusal("--recompute-activations").startswith(
        f"{PLAN}: field '--recompute-activations': not yet supported")
    for flag, rule in FLAGS.items():
        if rule.how != REFUSED:
            continue
        action = parser._option_string_actions[flag]
        value = [] if action.nargs == 0 else [_other_value(action, action.default)]
        assert refusal(flag, *value).endswith(f"(allowed: {rule.detail})"), flag


def _model_flag_checks(megatron_args, error) -> None:
    """hooks.check_megatron_args: the model-shape, dropout and recompute flags against the plan
    (after Megatron's validate_args, as pretrain_from_plan runs it)."""
    from dataclasses import replace

    from megatron_autohet.errors import ConfigError
    from megatron_autohet.megatron import hooks
    from megatron_autohet.plan import load_plan

    plan = load_plan(PLAN)
    with pytest.raises(ConfigError) as vocab:
        hooks.check_megatron_args(megatron_args("--vocab-size", "1000"), plan, PLAN,
                                  tokenizer_vocab_size=1001)
    assert str(vocab.value) == (
        f"{PLAN}: field '--vocab-size': Megatron-LM's NullTokenizer has 1001 tokens but the "
        "plan's model has vocab_size 512 (allowed: a tokenizer of 512 tokens (NullTokenizer: "
        "--vocab-size 511, the EOD token is added))")
    hooks.check_megatron_args(megatron_args(), plan, PLAN, tokenizer_vocab_size=512)
    assert error("--normalization", "RMSNorm") == (
        f"{PLAN}: field '--normalization': Megatron-LM was given 'RMSNorm' but the plan has "
        "'LayerNorm' (allowed: 'LayerNorm' (the plan's model: RMSNorm with SwiGLU, LayerNorm "
        "without))")
    assert error("--disable-bias-linear") == (
        f"{PLAN}: field '--disable-bias-linear': Megatron-LM was given True but the plan has "
        "False (allowed: False (the plan's model: no linear biases with SwiGLU, biases without))")
    hooks.check_megatron_args(megatron_args("--hidden-dropout", "0.1", "--attention-dropout",
                                            "0.2"), plan, PLAN)        # honoured
    assert error("--hidden-dropout", "1.0") == (
        "<command line>: field '--hidden-dropout': got 1.0 (allowed: a probability in [0, 1))")
    assert error("--attention-dropout", "-0.1") == (
        "<command line>: field '--attention-dropout': got -0.1 (allowed: a probability in "
        "[0, 1))")
    assert error("--recompute-granularity", "full") == (
        f"{PLAN}: field '--recompute-granularity': 'full', but the plan has activation_recompute "
        "false (allowed: not set (the plan decides recompute: autohet plan --recompute on))")
    recompute = replace(plan, activation_recompute=True)
    full = ["--recompute-granularity", "full", "--recompute-method", "uniform",
            "--recompute-num-layers", "1"]
    hooks.check_megatron_args(megatron_args(*full), recompute, PLAN)
    hooks.check_megatron_args(megatron_args(), recompute, PLAN)       # the plan decides
    with pytest.raises(ConfigError) as block:
        hooks.check_megatron_args(megatron_args(*full[:2], "--recompute-method", "block",
                                                "--recompute-num-layers", "1"), recompute, PLAN)
    assert str(block.value) == (
        f"{PLAN}: field '--recompute-method': 'block', but the plan's activation_recompute is "
        "megatron-core's full recompute of every layer (allowed: 'uniform' or not set)")
