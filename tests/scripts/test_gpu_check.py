"""scripts/gpu_check.sh in its CPU mode: every step runs as on the GPU machine (the real `autohet`
commands, bench_runtime's paired comparison, a real SIGKILL during a save and a resume), with the
tiny model; the rows whose target is a GPU figure say skip and why, and the exit status is 0."""

from __future__ import annotations

import pytest
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

from gpu_check import (NOT_ON_CPU, bf16_ulp, loss_tolerance, memory_meets_target,  # noqa: E402
                       memory_vs_plan, no_cuda_device, one_gpu_cluster, requested_rows,
                       time_meets_target)

from megatron_autohet.errors import ConfigError  # noqa: E402
from megatron_autohet.spec.cluster import cluster_from_dict  # noqa: E402

TINY = ["--model", "configs/models/tiny.yaml", "--profile-micro-batch-sizes", "2",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--iters", "3", "--warmup", "1",
        "--bench-iters", "7", "--ckpt-model", "configs/models/tiny.yaml",
        "--ckpt-global-batch-size", "4", "--ckpt-interval", "2"]
GPU_TARGETS = ("c. iteration time vs plan", "c. peak memory vs plan", "c. MFU",
               "d. ours / stock megatron-core", "h. time by kernel kind", "total time")


def gpu_check(args: list[str], tmp_path: Path, out: Path | None = None
              ) -> subprocess.CompletedProcess:
    """The script as a user runs it; ``out``: the device machine's $OUT (else unset)."""
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    if out is not None:
        env["OUT"] = str(out)
    env["PYTHON"] = sys.executable
    env["CUDA_VISIBLE_DEVICES"] = ""            # CPU mode wherever the test runs
    return subprocess.run(["bash", str(REPO / "scripts/gpu_check.sh"), *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=1800)


@pytest.mark.e2e
def test_cpu_mode_runs_every_step_and_skips_only_the_gpu_targets(tmp_path):
    """Run as on a device machine ($OUT set, of which at most 8 files come back): the JSON
    report, the README section and the packed command logs, nothing else."""
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = out_dir / "gpu_check.json"
    done = gpu_check([*TINY, "--work-dir", str(tmp_path / "work"), "--time-budget", "1500"],
                     tmp_path, out=out_dir)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert sorted(p.name for p in out_dir.iterdir()) == [
        "gpu_check-logs.tar.gz", "gpu_check.json", "gpu_check.md"]
    report = json.loads(out.read_text())
    rows = {r["check"]: r for r in report["rows"]}
    assert list(rows) == ["a. autohet profile", "b. autohet plan", "c. autohet train",
                          *GPU_TARGETS[:4], "e. autohet plan (tiny)",
                          "e. kill -9 during a save, resume", "f. autohet checkpoint verify",
                          "g. snapshot stall per GB", *GPU_TARGETS[4:]]
    for check in GPU_TARGETS:
        assert rows[check]["result"] == "skip" and rows[check]["note"].startswith(NOT_ON_CPU)
    snapshot = rows["g. snapshot stall per GB"]           # measured on the CPU, judged on a GPU
    assert snapshot["result"] == "skip" and "clone (CPU)" in snapshot["measured"], snapshot
    for check in ("a. autohet profile", "b. autohet plan", "c. autohet train",
                  "e. autohet plan (tiny)", "f. autohet checkpoint verify"):
        assert rows[check]["result"] == "pass", rows[check]
    killed = rows["e. kill -9 during a save, resume"]
    # The tiny model's save can finish before the kill lands on a loaded CPU: then there is no
    # interrupted save to resume from, and the row says so instead of judging.
    assert killed["result"] == "pass" or (
        killed["result"] == "skip" and "the kill landed after step 4 was written" in killed["note"])
    if killed["result"] == "pass":
        figures = report["figures"]["checkpoint"]
        assert figures["committed_after_kill"] == [2] and figures["loaded_iteration"] == 2
        assert figures["precision"] == "fp32" and figures["diffs"] == [0.0, 0.0]
    # The table's header names the versions it ran with; the JSON carries them.
    env = report["environment"]
    assert env["torch"] == torch.__version__ and env["megatron_core"] == "0.16.1"
    assert f"torch {torch.__version__}, megatron-core 0.16.1" in done.stdout
    assert no_cuda_device(torch.version.cuda) in done.stdout
    with tarfile.open(out_dir / "gpu_check-logs.tar.gz") as logs:
        train_log = logs.extractfile("gpu_check-logs/c-train.log").read().decode()
    assert train_log.startswith("$ -m megatron_autohet.cli.main train")
    # The README section: title, what ran with which versions, one table line per row.
    section = (out_dir / "gpu_check.md").read_text().splitlines()
    assert section[0] == "## Measured without a GPU (gpu_check.sh's CPU mode)"
    assert f"torch {torch.__version__}, megatron-core 0.16.1" in section[2]
    table = section[4:]
    assert table[:2] == ["| check | result | measured | target | note |",
                         "| --- | --- | --- | --- | --- |"]
    assert [line.split(" | ")[:2] for line in table[2:]] == [
        [f"| {r['check']}", r["result"]] for r in report["rows"]]


@pytest.mark.e2e
def test_rows_runs_those_steps_only(tmp_path):
    """--rows e: the save, kill and resume with its verify, nothing else; the 7-minute target
    is not judged on a part of the check."""
    out = tmp_path / "gpu_check.json"
    done = gpu_check([*TINY, "--rows", "e", "--json", str(out)], tmp_path)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    rows = {r["check"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["e. autohet plan (tiny)", "e. kill -9 during a save, resume",
                          "f. autohet checkpoint verify", "total time"]
    assert rows["total time"]["result"] == "skip" and "rows e only" in rows["total time"]["note"]


@pytest.mark.unit
def test_rows_bring_the_steps_they_need():
    assert requested_rows("e") == requested_rows("f") == "e"
    assert requested_rows("c") == "abc" and requested_rows("hd") == "abcdh"
    assert requested_rows("ga") == "ag" and requested_rows("abcdefgh") == "abcdegh"
    for bad in ("", "x", "e,f"):
        with pytest.raises(ConfigError, match="--rows"):
            requested_rows(bad)


@pytest.mark.e2e
def test_a_bad_flag_is_one_line_and_exit_status_2(tmp_path):
    done = gpu_check(["--model", "no-such.yaml", "--json", str(tmp_path / "r.json")], tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "gpu_check: error: <command line>: field '--model': no-such.yaml: no such file "
        "(allowed: an existing file)"]
    assert not (tmp_path / "r.json").exists()


@pytest.mark.unit
def test_bf16_ulp_is_the_spacing_of_bfloat16_numbers():
    for value in (0.3, 1.0, 2.5, 7.99, 10.8, 1000.0):
        x = torch.tensor(value, dtype=torch.bfloat16)
        up = torch.nextafter(x, torch.tensor(float("inf"), dtype=torch.bfloat16))
        assert bf16_ulp(float(x)) == float(up) - float(x), value


@pytest.mark.unit
def test_the_gpu_targets_as_the_checks_word_them():
    """The rows a CPU only reports: predicted within 10% of measured, memory never more than 5%
    under the measured peak, resumed bf16 losses within 2 bf16 ulps."""
    assert time_meets_target(0.562, 0.60) and time_meets_target(0.62, 0.57)
    assert time_meets_target(0.905, 1.0)      # 9.5% under the measured (10.5% of the prediction)
    assert not time_meets_target(0.562, 0.705) and not time_meets_target(0.70, 0.62)
    assert memory_meets_target(31.1, 29.3) and memory_meets_target(28.0, 29.3)
    assert not memory_meets_target(27.7, 29.3)          # 5.5% under the measured peak
    assert not memory_meets_target(32.4, 29.3)          # 10.6% over
    assert loss_tolerance(10.8, "bf16") == 2 * 2.0 ** -4 and loss_tolerance(10.8, "fp32") == 0.0


@pytest.mark.unit
def test_row_c_compares_the_allocator_peak_with_the_plans_less_its_context_reserve():
    """torch.cuda.max_memory_allocated never counts the CUDA context and NCCL buffers the plan
    reserves 1.5 GiB for: a plan of 32.8 GiB against an allocator peak of 29.3 is 31.3 / 29.3."""
    ok, shown = memory_vs_plan(32.8, 29.3)
    assert ok and shown == ("31.3 GiB predicted (the plan's 32.8 less its 1.5 GiB for the CUDA "
                            "context and NCCL) / 29.3 measured = 1.068")
    assert not memory_vs_plan(34.0, 29.3)[0]            # 32.5 / 29.3: 10.9% over
    assert not memory_vs_plan(28.9, 29.3)[0]            # 27.4 / 29.3: 6.5% under


@pytest.mark.unit
def test_the_default_cluster_is_one_gpu_of_the_local_device_type():
    """On a GPU machine the plan is for the GPU that is there (torch's device names and memory),
    whatever the type; a device the catalog lacks is refused rather than planned as another."""
    for device, memory_gib, gpu in (("NVIDIA H100 80GB HBM3", 79.2, "H100"),
                                    ("NVIDIA H200", 139.8, "H200"),
                                    ("NVIDIA A100-SXM4-40GB", 39.4, "A100-40GB"),
                                    ("NVIDIA A100-SXM4-80GB", 79.2, "A100-80GB"),
                                    ("Tesla T4", 14.6, "T4")):
        cluster = cluster_from_dict(one_gpu_cluster(device, memory_gib))
        assert [(n.gpu, n.num_gpus) for n in cluster.nodes] == [(gpu, 1)], device
    assert one_gpu_cluster("NVIDIA B200", 178.4) is None


@pytest.mark.unit
def test_the_device_line_without_cuda_names_a_cpu_only_torch_build():
    assert no_cuda_device(None) == "no CUDA device (CPU-only torch build)"
    assert no_cuda_device("12.8") == "no CUDA device (torch built for CUDA 12.8)"


@pytest.mark.unit
def test_help_says_what_the_check_checks():
    done = subprocess.run([sys.executable, str(REPO / "scripts/gpu_check.py"), "--help"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert ("Check on one GPU machine that profile, plan, train, resume and speed meet their "
            "targets.") in done.stdout
    assert "issue" not in done.stdout.lower()
