#!/usr/bin/env python
"""Check on one GPU machine that profile, plan, train, resume and speed meet their targets.

One table, pass/fail per row: each row's target is given below.

Run it through ``scripts/gpu_check.sh`` (which installs megatron-core, pyscipopt and xxhash from
``.whl/`` on a machine that lacks them). Every step is the ``autohet`` command as a user types it
(run as ``python -m megatron_autohet.cli.main``, so the package need not be installed), and the
rows are read from what the commands write (profile YAML, plan YAML, ``--metrics-jsonl``, ``autohet
checkpoint ls --json``, exit statuses); the ours-vs-stock row runs scripts/bench_runtime.py's
paired comparison on the same plan.

  a. ``autohet profile`` of the model's layer (bf16 on a GPU) for each micro-batch size;
  b. ``autohet plan`` from that profile for a one-GPU cluster (``--cluster``, else one GPU of
     the local device's catalog type: H100, H200, A100-80GB, ...);
  c. ``autohet train`` on that plan: median iteration time after the warm-up, tokens/s,
     TFLOP/s/GPU, MFU (of the catalog's dense peak of the GPU type), peak memory, next to the
     plan's prediction (targets: predicted time within 10% of the measured, predicted peak memory
     within 10% of the measured and never more than 5% below it - the plan's peak less the
     CUDA context and NCCL reserve, against torch's allocator peak -, MFU >= 45%);
  d. ours / stock megatron-core on the same plan, iterations paired and the two trainers' order
     alternated in the same processes (bench_runtime.run_plan; target <= 1.02);
  e. a smaller model (``--ckpt-model``, GPT-3 350M by default) saves every ``--ckpt-interval``
     iterations, with dropout 0.1 (so the resume must restore every RNG, the CUDA generator
     included); the job is killed (SIGKILL, launcher and ranks) while its second save is being
     written; the same command resumes from the step before and the losses of the iterations it
     trains again must equal the killed run's (bf16: within 2 bf16 ulps; fp32: bit-identical);
  f. ``autohet checkpoint verify`` of the step the resume loaded and of the step it saved;
  g. the checkpoint snapshot's stall per GB (scripts/bench_snapshot.py: a stage's state copied
     to the host, as every save does before it writes): through pinned host buffers that the next
     save reuses, against pageable copies (target: reused pinned buffers stall less per GB);
  h. where c's iteration goes, by kind of kernel (scripts/bench_kernels.py: matmuls, attention,
     elementwise, optimizer, communication): what limits the MFU (a measurement, run last and only
     where it leaves the check within its 7 minutes).

On a machine without CUDA every step still runs (fp32, gloo, the profile recorded as the
cluster's GPU type), and the rows whose target is a GPU figure (prediction vs measured time and
memory, MFU, ours/stock, the 7-minute budget) show what was measured and are marked skip, saying
why. The driver imports neither torch nor megatron: the versions come from a child process, and
this process never holds a CUDA context (bench_runtime forks its ranks from a child of its own).

``--rows`` runs some steps only (with those they need: ``--rows e`` checks the save, kill and
resume again in a minute or two where the whole check takes seven).

Exit status: 0 when no row fails (skips allowed), 1 when one does, 2 for bad input. The table
also goes to a JSON file (``--json``; default $OUT/gpu_check.json when OUT is set, else
bench-out/gpu_check.json) and, beside it, to ``gpu_check.md``: the README's "Measured on one
<GPU>" section (the date, the versions, the table in Markdown). Both are rewritten after every
row, so a run cut short still leaves its rows. Each command's output is kept in
``gpu_check-logs/`` beside them; with OUT set (a device machine, which returns at most 8 files of
$OUT) the logs are kept outside $OUT and packed into $OUT/gpu_check-logs.tar.gz after every row
instead.
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
sys.path.insert(0, str(ROOT))       # run as `python scripts/gpu_check.py` without installing

from megatron_autohet.checkpoint.manifest import step_dir_name, write_atomic  # noqa: E402
from megatron_autohet.cost_model import MEMORY_RESERVED_GIB     # noqa: E402
from megatron_autohet.cli._table import format_table            # noqa: E402
from megatron_autohet.testing.emulate import kill_tree          # noqa: E402
from megatron_autohet.errors import ConfigError                 # noqa: E402
from megatron_autohet.plan import load_plan                     # noqa: E402
from megatron_autohet.profiling.measure import catalog_name_for_device  # noqa: E402
from megatron_autohet.profiling.profile import Profile          # noqa: E402
from megatron_autohet.spec import load_cluster, load_gpu_catalog, load_model  # noqa: E402

PASS, FAIL, SKIP = "pass", "FAIL", "skip"
# The targets the checks judge against.
TIME_TOLERANCE = 0.10          # predicted iteration time within 10% of the measured one
MEMORY_TOLERANCE = 0.10        # predicted peak memory within 10% of the measured one ...
MEMORY_UNDER_TOLERANCE = 0.05  # ... and never more than 5% below it
MFU_TARGET = 0.45
STOCK_RATIO_TARGET = 1.02
WALL_TARGET_S = 7 * 60
BF16_ULPS = 2
# The bench's own warm-up (its first iterations are dropped) and the fewest iterations it takes.
BENCH_MIN_ITERS = 7
NOT_ON_CPU = "no CUDA here: the target is for one GPU"
# The steps by their rows' letters (f is e's), and the step each needs before it (a row asked for
# brings the rows it needs).
ALL_ROWS = "abcdegh"
ROW_NEEDS = {"b": "a", "c": "b", "d": "b", "h": "c"}
# The last step gets at least this long, or it is not started.
MIN_STEP_S = 20
CPU_STAND_IN_CLUSTER = ROOT / "configs/clusters/one-h100.yaml"

ENVIRONMENT_PROBE = r"""
import importlib.metadata, importlib.util, json, platform, subprocess, shutil
import torch
def version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None
info = {"python": platform.python_version(), "torch": torch.__version__,
        "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
        "megatron_core": version("megatron-core"), "pyscipopt": version("pyscipopt"),
        "transformer_engine": importlib.util.find_spec("transformer_engine") is not None,
        "apex": importlib.util.find_spec("apex") is not None}
if info["cuda_available"]:
    props = torch.cuda.get_device_properties(0)
    info.update(gpu=props.name, gpu_count=torch.cuda.device_count(),
                gpu_memory_gib=round(props.total_memory / 2**30, 1),
                compute_capability=f"{props.major}.{props.minor}",
                cudnn=torch.backends.cudnn.version())
    info["nvidia_smi"] = shutil.which("nvidia-smi") is not None
    if info["nvidia_smi"]:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True)
        info["driver"] = out.stdout.strip().splitlines()[0] if out.returncode == 0 else None
print(json.dumps(info))
"""

# bench_runtime's paired comparison of stock megatron-core and ours, on the checked plan; run in
# a child process so this one never initialises CUDA before the bench forks its ranks.
BENCH_CHILD = r"""
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from bench_runtime import run_plan, silence_known_megatron_warnings, summarize
silence_known_megatron_warnings()
plan, kinds, iters, data_dir, out = Path(sys.argv[2]), tuple(sys.argv[3].split(",")), \
    int(sys.argv[4]), sys.argv[5], sys.argv[6]
Path(out).write_text(json.dumps(summarize(run_plan(plan, kinds=kinds, iters=iters,
                                                   data_dir=data_dir), plan.name)))
"""


@dataclass
class Row:
    check: str
    result: str           # PASS, FAIL or SKIP
    measured: str
    target: str
    note: str = ""


@dataclass
class Settings:
    model: Path
    cluster: Path | None      # None: one GPU of the local device's type (one H100 on a CPU)
    profile_micro_batch_sizes: list[int]
    micro_batch_size: int
    global_batch_size: int
    seq_length: int | None
    iters: int
    warmup: int
    bench_iters: int
    ckpt_model: Path
    ckpt_micro_batch_size: int
    ckpt_global_batch_size: int
    ckpt_interval: int
    json_path: Path
    work_dir: Path | None
    time_budget_s: float
    rows: str = ALL_ROWS               # the steps run (--rows, with the ones they need)
    logs_archive: Path | None = None   # the logs, packed after every row (OUT set), else None


@dataclass
class Command:
    rc: int | None            # None: killed at its time limit
    log: Path
    seconds: float

    @property
    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def why(self) -> str:
        """A failed command's reason: its status and the last line that looks like an error."""
        if self.rc is None:
            return f"killed at its time limit after {self.seconds:.0f} s (log {self.log.name})"
        lines = [re.sub(r"^\[rank\d+\]: ", "", line.strip()) for line in self.text.splitlines()
                 if line.strip()]
        # A rank's exception rather than the launcher's summary of it, else an error line.
        exceptions = [line for line in lines if re.match(r"[\w.]*(Error|Exception)\b", line)]
        errors = [line for line in lines if re.search(r"error|failed", line, re.IGNORECASE)]
        last = (exceptions or errors or lines or ["no output"])[-1]
        return f"exit {self.rc}: {last[:300]} (log {self.log.name})"


@dataclass
class GpuCheck:
    settings: Settings
    work: Path
    logs: Path
    started: float = field(default_factory=time.monotonic)
    started_wall: float = field(default_factory=time.time)
    environment: dict = field(default_factory=dict)
    cluster_path: Path | None = None      # planned for: see cluster()
    rows: list[Row] = field(default_factory=list)
    figures: dict = field(default_factory=dict)

    @property
    def on_gpu(self) -> bool:
        return bool(self.environment.get("cuda_available"))

    # ---- running commands --------------------------------------------------------------------

    def remaining(self) -> float:
        return self.settings.time_budget_s - (time.monotonic() - self.started)

    def run(self, name: str, argv: list[str], timeout_s: float) -> Command:
        """``argv`` (after the interpreter) with its output in logs/<name>.log; killed, with its
        process tree, at the sooner of ``timeout_s`` and the end of the time budget."""
        log = self.logs / f"{name}.log"
        started = time.monotonic()
        with open(log, "w") as out:
            out.write("$ " + " ".join(argv) + "\n")
            out.flush()
            proc = subprocess.Popen([sys.executable, *argv], cwd=ROOT, stdout=out,
                                    stderr=subprocess.STDOUT, env=child_environment())
            try:
                rc = proc.wait(timeout=max(1.0, min(timeout_s, self.remaining())))
            except subprocess.TimeoutExpired:
                kill_tree(proc.pid)
                proc.wait()
                rc = None
        return Command(rc, log, time.monotonic() - started)

    def autohet(self, name: str, argv: list[str], timeout_s: float) -> Command:
        return self.run(name, ["-m", "megatron_autohet.cli.main", *argv], timeout_s)

    def has_time(self, check: str) -> bool:
        """False (and a failed row) when the time budget cannot fit another step."""
        if self.remaining() >= MIN_STEP_S:
            return True
        self.add(Row(check, FAIL, "not run", f"within the {self.settings.time_budget_s:.0f} s "
                     "budget", "the earlier steps used the time budget"))
        return False

    def add(self, row: Row) -> None:
        self.rows.append(row)
        print(f"[{time.monotonic() - self.started:6.0f} s] {row.result:4s} {row.check}: "
              f"{row.measured}" + (f" ({row.note})" if row.note else ""), flush=True)
        self.write_json()
        self.write_markdown()
        if self.settings.logs_archive is not None:
            pack(self.logs, self.settings.logs_archive)

    def gpu_row(self, check: str, ok: bool, measured: str, target: str, note: str = "") -> Row:
        """A row whose target is a GPU figure: judged on a GPU, reported (skip) on a CPU."""
        if not self.on_gpu:
            return Row(check, SKIP, measured, target, NOT_ON_CPU + (f"; {note}" if note else ""))
        return Row(check, PASS if ok else FAIL, measured, target, note)

    # ---- output ------------------------------------------------------------------------------

    def device(self) -> str:
        env = self.environment
        if self.on_gpu:
            return (f"{env.get('gpu')} ({env.get('gpu_memory_gib')} GiB, sm "
                    f"{env.get('compute_capability')}, driver {env.get('driver')}, CUDA "
                    f"{env.get('torch_cuda')}, cuDNN {env.get('cudnn')})")
        return no_cuda_device(env.get("torch_cuda"))

    def versions(self) -> str:
        env = self.environment
        return (f"python {env.get('python')}, torch {env.get('torch')}, megatron-core "
                f"{env.get('megatron_core')}, pyscipopt {env.get('pyscipopt')}, Transformer "
                f"Engine {'yes' if env.get('transformer_engine') else 'no'}, Apex "
                f"{'yes' if env.get('apex') else 'no'}")

    def header(self) -> str:
        return (f"gpu_check {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit "
                f"{git_commit()}\ndevice: {self.device()}\n{self.versions()}")

    def table(self) -> str:
        return format_table(("check", "result", "measured", "target", "note"),
                            [(r.check, r.result, r.measured, r.target, r.note) for r in self.rows])

    def write_markdown(self) -> None:
        """The README's section: what ran where, then the table (cells' ``|`` escaped)."""
        s = self.settings
        # the catalog's name of the card (H200), as the README's other sections call GPUs
        gpu = self.figures.get("cluster", {}).get("gpu") or self.environment.get("gpu")
        title = (f"## Measured on one {gpu}" if self.on_gpu
                 else "## Measured without a GPU (gpu_check.sh's CPU mode)")

        def row(cells) -> str:
            return "| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ")
                                     for c in cells) + " |"

        lines = [title, "",
                 f"{time.strftime('%Y-%m-%d', time.gmtime())}, commit {git_commit()}: "
                 f"`scripts/gpu_check.sh` ({s.model.stem}, micro-batch {s.micro_batch_size}, "
                 f"global batch {s.global_batch_size}; save, kill and resume on "
                 f"{s.ckpt_model.stem}). Device: {self.device()}; {self.versions()}.", "",
                 row(("check", "result", "measured", "target", "note")), row(["---"] * 5),
                 *(row((r.check, r.result, r.measured, r.target, r.note)) for r in self.rows)]
        write_atomic(self.settings.json_path.with_suffix(".md"), ("\n".join(lines) + "\n").encode())

    def write_json(self) -> None:
        report = {"date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  "commit": git_commit(), "environment": self.environment,
                  "settings": {k: (str(v) if isinstance(v, Path) else v)
                               for k, v in asdict(self.settings).items()},
                  "wall_s": round(time.monotonic() - self.started, 1),
                  "rows": [asdict(r) for r in self.rows], "figures": self.figures,
                  "all_passed": all(r.result != FAIL for r in self.rows)}
        write_atomic(self.settings.json_path, json.dumps(report, indent=1).encode())

    # ---- the steps ---------------------------------------------------------------------------

    def probe(self) -> bool:
        command = self.run("environment", ["-c", ENVIRONMENT_PROBE], 120)
        if command.rc != 0:
            self.add(Row("environment", FAIL, "torch did not import", "", command.why()))
            return False
        # The probe's one JSON line (warnings may come before or after it).
        self.environment = json.loads(next(line for line in reversed(command.text.splitlines())
                                           if line.startswith("{")))
        print(self.header(), flush=True)
        return True

    def cluster(self) -> Path | None:
        """The cluster planned for: --cluster, else one GPU of this machine's catalog type
        (written to the work directory), else (no CUDA) one H100, which the CPU stands in for;
        its GPU type goes to ``figures["cluster"]``. None, with a failed row, when the local GPU
        is not in the catalog."""
        s, env = self.settings, self.environment
        path = s.cluster
        if path is None and not self.on_gpu:
            path = CPU_STAND_IN_CLUSTER
        elif path is None:
            cluster = one_gpu_cluster(env["gpu"], env["gpu_memory_gib"])
            if cluster is None:
                self.add(Row("environment", FAIL, f"{env['gpu']}: no GPU catalog type matches",
                             "a GPU of configs/gpus.yaml",
                             "add its type to configs/gpus.yaml, or pass --cluster"))
                return None
            path = self.work / "cluster.yaml"
            path.write_text(yaml.safe_dump(cluster, sort_keys=False))
        self.figures["cluster"] = {"path": str(path), "gpu": cluster_gpu(path)}
        return path

    def wall(self) -> float:
        """Seconds since gpu_check.sh started (its wheel installation included), else since
        this process did."""
        return time.time() - float(os.environ.get("GPU_CHECK_STARTED", self.started_wall))

    def seq_flags(self) -> list[str]:
        s = self.settings.seq_length
        return [] if s is None else ["--seq-length", str(s)]

    def profile(self, gpu: str) -> Path | None:
        s, check = self.settings, "a. autohet profile"
        path = self.work / "profile.yaml"
        argv = ["profile", "--model", str(s.model), "--micro-batch-size",
                *map(str, s.profile_micro_batch_sizes), *self.seq_flags(), "-o", str(path)]
        if not self.on_gpu:
            argv += ["--as-gpu", gpu]        # the CPU's figures stand in for the cluster's GPU
        command = self.autohet("a-profile", argv, 240)
        target = (f"entries for micro-batch {', '.join(map(str, s.profile_micro_batch_sizes))}"
                  + (", bf16, recorded as the cluster's " + gpu if self.on_gpu else ""))
        if command.rc != 0:
            self.add(Row(check, FAIL, "no profile", target, command.why()))
            return None
        profile = Profile.load(path)
        entries = {e.micro_batch_size: e for e in profile.entries.values() if e.tp == 1}
        missing = [b for b in s.profile_micro_batch_sizes if b not in entries]
        measured = (", ".join(f"mbs {b}: layer {1e3 * (e.layer.forward_s + e.layer.backward_s):.3g}"
                              f" ms" for b, e in sorted(entries.items()))
                    + f" fwd+bwd ({profile.precision.name}, {profile.attention} attention, "
                      f"{command.seconds:.0f} s)")
        gpus = sorted({e.gpu for e in entries.values()})
        self.figures["profile"] = {
            "precision": profile.precision.name, "attention": profile.attention, "gpu": gpus,
            "seconds": command.seconds,
            "layer_ms": {b: 1e3 * (e.layer.forward_s + e.layer.backward_s)
                         for b, e in entries.items()}}
        problems = [f"no entry for micro-batch {b}" for b in missing]
        if self.on_gpu and profile.precision.name != "bf16":
            problems.append(f"measured in {profile.precision.name}")
        if gpus != [gpu]:
            problems.append(f"recorded as {', '.join(gpus)}, the cluster has {gpu} "
                            "(pass --cluster)")
        self.add(Row(check, FAIL if problems else PASS, measured, target, "; ".join(problems)))
        return None if problems else path

    def plan(self, name: str, model: Path, profile: Path | None, micro_batch_size: int,
             global_batch_size: int, check: str) -> Path | None:
        """The plan for ``model``, from ``profile`` (at --seq-length), else from the analytic
        estimates (at the model's own seq_length)."""
        path = self.work / f"{name}.yaml"
        argv = ["plan", "--cluster", str(self.cluster_path), "--model", str(model),
                "--global-batch-size", str(global_batch_size),
                "--micro-batch-size", str(micro_batch_size), "-o", str(path)]
        if profile is not None:
            argv += ["--profile", str(profile), *self.seq_flags()]
        command = self.autohet(name, argv, 120)
        if command.rc != 0:
            self.add(Row(check, FAIL, "no plan", "a plan", command.why()))
            return None
        plan = load_plan(path)
        p = plan.predicted
        stages = [len(pipe.stages) for pipe in plan.pipelines]
        measured = (f"predicted {p['iteration_time_s']:.3g} s/iter, {p['tokens_per_s']:,.0f} "
                    f"tokens/s, peak {p['peak_memory_gib']:.1f} GiB ({len(plan.pipelines)} "
                    f"pipeline(s) of {stages} stages, recompute "
                    f"{'on' if plan.activation_recompute else 'off'})")
        self.figures[name] = {"predicted": p, "plan": str(path)}
        if profile is None:
            self.add(Row(check, PASS, measured, "a plan (analytic estimates)"))
            return path
        unmeasured = sorted(key for key, parts in (p.get("profile_sources") or {}).items()
                            if any(v != "measured" for v in parts.values()))
        self.add(Row(check, FAIL if unmeasured else PASS, measured,
                     "a plan priced from the measured profile",
                     f"not measured: {', '.join(unmeasured)}" if unmeasured else ""))
        return None if unmeasured else path

    def train(self, plan_path: Path) -> None:
        s = self.settings
        metrics = self.work / "train.jsonl"
        argv = ["train", "--plan", str(plan_path), "--model", str(s.model), "--iters",
                str(s.iters), "--metrics-jsonl", str(metrics), "--data-dir", self.data_dir()]
        if self.on_gpu:
            argv.append("--bf16")
        command = self.autohet("c-train", argv, 300)
        check = "c. autohet train"
        records = iteration_records(metrics)
        if command.rc != 0 or len(records) != s.iters:
            self.add(Row(check, FAIL, f"{len(records)} of {s.iters} iterations", "runs",
                         command.why()))
            return
        plan = load_plan(plan_path)
        predicted = plan.predicted
        timed = records[s.warmup:]
        seconds = statistics.median(r["elapsed_ms"] for r in timed) / 1e3
        tokens = plan.global_batch_size * plan.seq_length
        losses = [r["lm_loss"] for r in records]
        ok = all(math.isfinite(v) for v in losses)
        self.add(Row(check, PASS if ok else FAIL,
                     f"{seconds:.3f} s/iter, {tokens / seconds:,.0f} tokens/s (median of "
                     f"iterations {s.warmup + 1}-{s.iters}); lm loss {losses[0]:.3f} -> "
                     f"{losses[-1]:.3f}", "runs, finite losses", attention_note(command.text)))

        ratio = predicted["iteration_time_s"] / seconds
        self.add(self.gpu_row("c. iteration time vs plan",
                              time_meets_target(predicted["iteration_time_s"], seconds),
                              f"{predicted['iteration_time_s']:.3f} s predicted / {seconds:.3f} "
                              f"s measured = {ratio:.3f}",
                              f"prediction within {TIME_TOLERANCE:.0%} of the measured"))

        # The train log's own figures (runtime/train_log.py): the logging rank's CUDA peak
        # (None on a CPU) and Megatron-LM's throughput per GPU.
        peaks = log_field(records, "mem_max_allocated_gigabytes")
        peak = max(peaks) if peaks else None
        memory_target = (f"prediction within {MEMORY_TOLERANCE:.0%}, never "
                         f">{MEMORY_UNDER_TOLERANCE:.0%} below")
        if peak is None:
            # On a GPU machine: the job ran without CUDA.
            self.add(self.gpu_row("c. peak memory vs plan", False, "not in the train log",
                                  memory_target,
                                  "the metrics have no mem_max_allocated_gigabytes value"))
        else:
            ok, measured = memory_vs_plan(predicted["peak_memory_gib"], peak)
            self.add(self.gpu_row("c. peak memory vs plan", ok, measured, memory_target,
                                  "torch.cuda.max_memory_allocated, the train log's "
                                  "mem_max_allocated_gigabytes"))

        peak_tflops = load_gpu_catalog()[plan.ranks[0].gpu].dense_tflops
        logged = log_field(timed, "throughput_tflops_per_gpu")
        tflops = statistics.median(logged) if logged else None
        mfu = tflops / peak_tflops if tflops is not None else None
        self.add(self.gpu_row("c. MFU", mfu is not None and mfu >= MFU_TARGET,
                              f"{tflops:.3g} TFLOP/s/GPU = {mfu:.1%} of {peak_tflops:g}"
                              if mfu is not None else "not in the train log",
                              f">= {MFU_TARGET:.0%}",
                              "median of the train log's throughput_tflops_per_gpu"))
        self.figures["train"] = {
            "seconds_per_iteration": seconds, "tokens_per_s": tokens / seconds,
            "tflops_per_gpu": tflops, "mfu": mfu, "peak_tflops": peak_tflops,
            "peak_memory_gib": peak, "predicted_iteration_time_s": predicted["iteration_time_s"],
            "predicted_peak_memory_gib": predicted["peak_memory_gib"],
            "elapsed_ms": [r["elapsed_ms"] for r in records], "lm_loss": losses,
            "command_seconds": command.seconds}

    def kernels(self, plan_path: Path) -> None:
        check, out = "h. time by kernel kind", self.work / "bench_kernels.json"
        command = self.run("h-bench-kernels", [
            "scripts/bench_kernels.py", "--plan", str(plan_path), "--model",
            str(self.settings.model), "--iters", "2", "--warmup", "2", "--data-dir",
            self.data_dir(), "--json", str(out)], 180)
        if command.rc != 0 or not out.is_file():
            self.add(Row(check, FAIL, "bench_kernels failed", "a breakdown", command.why()))
            return
        result = json.loads(out.read_text())
        wall = result["wall_s_per_iteration"]
        shares = sorted(result["seconds_per_iteration"].items(), key=lambda kv: -kv[1])
        self.figures["kernels"] = result
        # A measurement, not a target: what the MFU row's time is spent on.
        self.add(self.gpu_row(check, True, ", ".join(f"{kind} {seconds / wall:.0%}"
                                                     for kind, seconds in shares if seconds)
                              + f" of {wall:.3f} s", "a breakdown (what limits the MFU)",
                              result["time"]))

    def bench(self, plan_path: Path) -> None:
        s, check = self.settings, "d. ours / stock megatron-core"
        kind, base = ("ours-bf16", "stock-bf16") if self.on_gpu else ("ours", "stock")
        out = self.work / "bench.json"
        command = self.run("d-bench", ["-c", BENCH_CHILD, str(SCRIPTS), str(plan_path),
                                       f"{base},{kind}", str(s.bench_iters), self.data_dir(),
                                       str(out)], 360)
        target = f"<= {STOCK_RATIO_TARGET} (median of paired iterations)"
        if command.rc != 0:
            self.add(Row(check, FAIL, "no comparison", target, command.why()))
            return
        entry = json.loads(out.read_text())
        prefix = "" if base == "stock" else f"{kind}/{base} "   # bench_runtime's key names
        ratio, (low, high) = entry[f"{prefix}ratio"], entry[f"{prefix}ratio_ci95"]
        ours_ms, stock_ms = (entry[k]["wall_quartiles_ms"][1] for k in (kind, base))
        self.figures["bench"] = {"kinds": [kind, base], "ratio": ratio, "ratio_ci95": [low, high],
                                 "ours_ms": ours_ms, "stock_ms": stock_ms,
                                 "paired_ratios": entry[f"{prefix}paired_ratios"]}
        self.add(self.gpu_row(check, ratio <= STOCK_RATIO_TARGET,
                              f"{ratio:.3f} [95% CI {low:.3f}-{high:.3f}]; {ours_ms:.0f} / "
                              f"{stock_ms:.0f} ms", target,
                              f"{kind} vs {base}, same grad norms checked"))

    def checkpoint(self) -> None:
        """e and f: save, SIGKILL during the next save, resume; verify the steps."""
        s = self.settings
        check_e, check_f = "e. kill -9 during a save, resume", "f. autohet checkpoint verify"
        plan_path = self.plan("e-plan", s.ckpt_model, None, s.ckpt_micro_batch_size,
                              s.ckpt_global_batch_size, f"e. autohet plan ({s.ckpt_model.stem})")
        if plan_path is None or not self.has_time(check_e):
            return
        half = s.ckpt_interval
        ckpt = self.work / "ckpt"
        killed_jsonl, resumed_jsonl = self.work / "killed.jsonl", self.work / "resumed.jsonl"

        def argv(metrics: Path) -> list[str]:
            return ["-m", "megatron_autohet.cli.main", "train", "--plan", str(plan_path),
                    "--model", str(s.ckpt_model), "--iters", str(2 * half),
                    "--save-interval", str(half), "--autohet-local-ckpt-dir", str(ckpt),
                    "--load", str(ckpt), "--autohet-keep-ckpts", "2",
                    "--metrics-jsonl", str(metrics),
                    # dropout draws from every RNG a rank has (the CUDA generator on a GPU): the
                    # resumed losses equal the killed run's only if the checkpoint restores them
                    "--hidden-dropout", "0.1", "--attention-dropout", "0.1",
                    "--data-dir", self.data_dir(), *(["--bf16"] if self.on_gpu else [])]

        killed, reached = self.kill_during_save(
            argv(killed_jsonl), ckpt / f"{step_dir_name(2 * half)}.partial")
        expected = f"step {half} committed, step {2 * half} not"
        if not reached:
            self.add(Row(check_e, FAIL, f"no save of step {2 * half} to kill", expected,
                         killed.why()))
            return
        steps = self.committed_steps(ckpt)
        self.figures["checkpoint"] = {"model": s.ckpt_model.stem, "committed_after_kill": steps,
                                      "save_seconds": save_seconds(killed.text)}
        if steps == [half, 2 * half]:
            # The save finished between seeing its directory and the kill: nothing was
            # interrupted, so nothing can be resumed from the step before. Only a tiny model's
            # save on a loaded CPU is that quick.
            self.add(Row(check_e, FAIL if self.on_gpu else SKIP, f"committed: {steps}",
                         expected, f"the kill landed after step {2 * half} was written"))
            self.verify(ckpt, steps, check_f)
            return
        if steps != [half]:
            self.add(Row(check_e, FAIL, f"committed: {steps}", expected,
                         "checkpoint ls failed" if steps is None else
                         (save_failures(killed.text) or ["a save did not commit"])[0]))
            return
        killed_records = iteration_records(killed_jsonl)
        resumed = self.autohet("e-resume", argv(resumed_jsonl)[2:], 300)
        resumed_records = iteration_records(resumed_jsonl)
        loaded = re.search(r"successfully loaded checkpoint: recovered iteration (\d+)",
                           resumed.text)
        failures = save_failures(killed.text) + save_failures(resumed.text)
        if resumed.rc != 0 or not loaded or failures or not resumed_records:
            self.add(Row(check_e, FAIL, "no resume", "resumes from the committed step",
                         failures[0] if failures else
                         ("nothing loaded" if resumed.rc == 0 else resumed.why())))
            return
        # Every resumed iteration against the killed run's: the first checks the weights, the
        # later ones the Adam state, the learning-rate schedule and the data position too.
        before = {r["iteration"]: r["lm_loss"] for r in killed_records}
        iterations = [r["iteration"] for r in resumed_records]
        if iterations != list(range(half + 1, 2 * half + 1)) or not set(iterations) <= set(before):
            self.add(Row(check_e, FAIL, f"resumed iterations {iterations}",
                         f"iterations {half + 1}-{2 * half}, as the killed run logged them"))
            return
        # What the job's log says it trained in (--bf16 on a GPU, the default fp32 on a CPU).
        precision = training_precision(resumed.text) or ("bf16" if self.on_gpu else "fp32")
        diffs = {r["iteration"]: abs(r["lm_loss"] - before[r["iteration"]])
                 for r in resumed_records}
        tolerances = {i: loss_tolerance(before[i], precision) for i in iterations}
        worst = max(iterations, key=lambda i: diffs[i] - tolerances[i])
        self.figures["checkpoint"].update(
            loaded_iteration=int(loaded.group(1)), precision=precision,
            resumed_losses=[r["lm_loss"] for r in resumed_records],
            uninterrupted_losses=[before[i] for i in iterations],
            diffs=list(diffs.values()), tolerances=list(tolerances.values()))
        first = iterations[0]
        self.add(Row(
            check_e, PASS if all(diffs[i] <= tolerances[i] for i in iterations) else FAIL,
            f"loaded step {loaded.group(1)}; iteration {first} loss "
            f"{resumed_records[0]['lm_loss']:.6f} vs {before[first]:.6f} uninterrupted; largest "
            f"difference {diffs[worst]:.2g} (iteration {worst})",
            f"losses of iterations {first}-{iterations[-1]} "
            + ("equal" if precision != "bf16" else f"within {BF16_ULPS} bf16 ulps"),
            f"{s.ckpt_model.stem}, {precision}, killed while writing step {2 * half}"))
        self.verify(ckpt, [half, 2 * half], check_f)

    def kill_during_save(self, argv: list[str], partial: Path) -> tuple[Command, bool]:
        """Start the job; SIGKILL it (launcher and ranks) as soon as ``partial`` (the directory
        of the step being written) exists. The flag says whether that happened, rather than the
        job ending or its time running out first."""
        log = self.logs / "e-killed.log"
        started = time.monotonic()
        deadline = started + max(1.0, min(300.0, self.remaining()))
        with open(log, "w") as out:
            out.write("$ " + " ".join(argv) + "\n")
            out.flush()
            job = subprocess.Popen([sys.executable, *argv], cwd=ROOT, stdout=out,
                                   stderr=subprocess.STDOUT, env=child_environment())
            while not (reached := partial.exists()):
                if job.poll() is not None or time.monotonic() >= deadline:
                    break
                time.sleep(0.002)
            ended = job.poll()
            kill_tree(job.pid)
            job.wait()
        return Command(ended, log, time.monotonic() - started), reached

    def committed_steps(self, ckpt: Path) -> list[int] | None:
        command = self.autohet("e-ls", ["checkpoint", "ls", str(ckpt), "--json"], 60)
        if command.rc != 0:
            return None
        listing = json.loads(command.text.split("\n", 1)[1])
        return [step["iteration"] for step in listing if step["complete"]]

    def verify(self, ckpt: Path, steps: list[int], check: str) -> None:
        results = []
        for step in steps:
            command = self.autohet(f"f-verify-{step}", ["checkpoint", "verify", str(ckpt),
                                                        "--iteration", str(step)], 120)
            # "> DIR/iter_N: OK; checked C chunks in F files (M MiB)"
            summary = re.search(r": (OK|\d+ problem\(s\)); checked (\d+) chunks in \d+ files "
                                r"\(([\d.]+) MiB\)", command.text)
            results.append((step, command, f"{summary[1]}, {summary[2]} chunks, {summary[3]} MiB"
                            if summary else command.why()))
        self.add(Row(check, PASS if all(c.rc == 0 for _, c, _ in results) else FAIL,
                     "; ".join(f"step {step}: {line}" for step, _, line in results),
                     "every chunk's checksum matches"))

    def snapshot(self) -> None:
        check = "g. snapshot stall per GB"
        out = self.work / "bench_snapshot.json"
        command = self.run("g-bench-snapshot", ["scripts/bench_snapshot.py", "--gb", "2",
                                                "--json", str(out)], 300)
        if command.rc != 0 or not out.is_file():
            self.add(Row(check, FAIL, "bench_snapshot failed", "a measurement", command.why()))
            return
        modes = json.loads(out.read_text())["modes"]
        measured = ", ".join(f"{mode} {m['stall_s_per_gb']:.3f} s/GB" for mode, m in modes.items())
        pinned, pageable = modes.get("pinned, reused"), modes.get("pageable")
        self.add(self.gpu_row(check, bool(pinned and pageable and pinned["stall_s_per_gb"]
                                          <= pageable["stall_s_per_gb"]), measured,
                              "reused pinned buffers <= pageable copies"))

    def data_dir(self) -> str:
        return str(self.work / "data")

    def run_all(self) -> int:
        s = self.settings
        if not self.probe():
            print(self.table())
            return 1
        self.cluster_path = self.cluster()
        if self.cluster_path is None:
            print(self.table())
            return 1
        gpu = self.figures["cluster"]["gpu"]
        rows = s.rows
        profile = plan = None
        if "a" in rows and self.has_time("a. autohet profile"):
            profile = self.profile(gpu)
        if "b" in rows and profile is not None and self.has_time("b. autohet plan"):
            plan = self.plan("b-plan", s.model, profile, s.micro_batch_size,
                             s.global_batch_size, "b. autohet plan")
        if "c" in rows and plan is not None and self.has_time("c. autohet train"):
            self.train(plan)
        if "d" in rows and plan is not None and self.has_time("d. ours / stock megatron-core"):
            self.bench(plan)
        if "e" in rows and self.has_time("e. kill -9 during a save, resume"):
            self.checkpoint()
            # The checkpointer's own logs (a failed save's traceback) outlive the work directory.
            for log in sorted((self.work / "ckpt").glob("*.log")):
                shutil.copy(log, self.logs / f"e-ckpt-{log.name}")
        if "g" in rows and self.has_time("g. snapshot stall per GB"):
            self.snapshot()
        # Last: a measurement that explains the MFU row, not a target, so it runs only where it
        # leaves the check within its 7 minutes (it builds and trains the model as c did, for
        # fewer iterations: c's time bounds it).
        train_s = self.figures.get("train", {}).get("command_seconds")
        if "h" in rows and train_s is not None and self.has_time("h. time by kernel kind"):
            if not self.on_gpu or self.wall() + train_s <= WALL_TARGET_S:
                self.kernels(plan)
            else:
                self.add(Row("h. time by kernel kind", SKIP, "not run", "a breakdown",
                             f"{self.wall():.0f} s gone and c's training took {train_s:.0f} s: "
                             f"it would end past the {WALL_TARGET_S} s target"))
        wall = self.wall()
        if rows == ALL_ROWS:
            self.add(self.gpu_row("total time", wall <= WALL_TARGET_S, f"{wall:.0f} s",
                                  f"<= {WALL_TARGET_S} s on one GPU"))
        else:
            self.add(Row("total time", SKIP, f"{wall:.0f} s", f"<= {WALL_TARGET_S} s on one GPU",
                         f"rows {rows} only (--rows): the target is for the whole check"))
        print()
        print(self.header())
        print(self.table())
        failed = [r.check for r in self.rows if r.result == FAIL]
        print(f"> {'FAILED: ' + ', '.join(failed) if failed else 'every row passed or skipped'};"
              f" wrote {s.json_path} (command logs in {self.logs})")
        return 1 if failed else 0


# ---- reading what the commands write -----------------------------------------------------------

def iteration_records(path: Path) -> list[dict]:
    """The training iterations of a --metrics-jsonl file (validation lines left out)."""
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if "lm_loss" in r]


def log_field(records: list[dict], name: str) -> list[float] | None:
    """The records' values of ``name``; None when a record lacks it or has null."""
    values = [r.get(name) for r in records]
    return None if not values or None in values else [float(v) for v in values]


def training_precision(log: str) -> str | None:
    found = re.search(r"training in (\w+)", log)
    return found.group(1) if found else None


def save_failures(log: str) -> list[str]:
    """The checkpointer's one line per failed save (its root cause)."""
    return [line.strip()[:300] for line in log.splitlines()
            if re.search(r"checkpoint of iteration \d+ failed", line)]


def save_seconds(log: str) -> list[float]:
    return [float(s) for s in re.findall(r"written in ([\d.]+) s", log)]


def attention_note(log: str) -> str:
    """What the training log says about its attention implementation (first such line)."""
    for line in log.splitlines():
        if "attention" in line.lower():
            return line.strip()[:160]
    return ""


def time_meets_target(predicted_s: float, measured_s: float) -> bool:
    """The predicted iteration time within 10% of the measured one."""
    return abs(predicted_s / measured_s - 1) <= TIME_TOLERANCE


def memory_vs_plan(plan_peak_gib: float, allocated_gib: float) -> tuple[bool, str]:
    """Row c's memory check and what it shows. Like with like: torch's allocator peak never
    sees the CUDA context and NCCL's buffers, which the plan's peak reserves beside what the
    allocator holds (cost_model.MEMORY_RESERVED_GIB), so that reserve is taken off the plan's."""
    predicted = plan_peak_gib - MEMORY_RESERVED_GIB
    return memory_meets_target(predicted, allocated_gib), (
        f"{predicted:.1f} GiB predicted (the plan's {plan_peak_gib:.1f} less its "
        f"{MEMORY_RESERVED_GIB:g} GiB for the CUDA context and NCCL) / {allocated_gib:.1f} "
        f"measured = {predicted / allocated_gib:.3f}")


def memory_meets_target(predicted_gib: float, measured_gib: float) -> bool:
    """The predicted peak memory within 10% of the measured one and never more than 5%
    below it (a plan that under-predicts memory runs out of it)."""
    ratio = predicted_gib / measured_gib
    return abs(ratio - 1) <= MEMORY_TOLERANCE and ratio >= 1 - MEMORY_UNDER_TOLERANCE


def no_cuda_device(torch_cuda: str | None) -> str:
    """The device line without CUDA: ``torch_cuda`` is torch.version.cuda (None on a CPU-only
    build of torch, else the CUDA version it was built for and cannot use here)."""
    if torch_cuda is None:
        return "no CUDA device (CPU-only torch build)"
    return f"no CUDA device (torch built for CUDA {torch_cuda})"


def loss_tolerance(reference: float, precision: str | None) -> float:
    """How far a resumed loss may be from the uninterrupted run's: BF16_ULPS bf16 ulps in
    bf16, nothing in fp32 (the same plan on the same device computes the same numbers)."""
    return BF16_ULPS * bf16_ulp(reference) if precision == "bf16" else 0.0


def bf16_ulp(value: float) -> float:
    """The spacing of bf16 numbers (8 significant bits) at ``value``."""
    return 2.0 ** (math.floor(math.log2(abs(value))) - 7) if value else 2.0 ** -133


def one_gpu_cluster(device_name: str, memory_gib: float) -> dict | None:
    """A cluster file's content: one node with one GPU of the catalog type of ``device_name``
    (as torch names it), or None when no type matches."""
    gpu = catalog_name_for_device(device_name, memory_gib, load_gpu_catalog())
    if gpu is None:
        return None
    # One GPU: nothing crosses the network, the bandwidth is a required field only.
    return {"name": f"one-{gpu.lower()}", "inter_node_bandwidth_gbs": 25,
            "nodes": [{"name": gpu.lower(), "gpu": gpu, "gpus": 1}]}


def cluster_gpu(path: Path) -> str:
    cluster = load_cluster(path, load_gpu_catalog())
    types = sorted({node.gpu for node in cluster.nodes})
    if cluster.world_size != 1:
        raise ConfigError(str(path), "nodes", f"{cluster.world_size} GPUs", "one node with one GPU")
    return types[0]


def child_environment() -> dict:
    """This environment with the repository on PYTHONPATH (the package is not installed)."""
    env = dict(os.environ)
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(ROOT) not in parts:
        parts.append(str(ROOT))
    env["PYTHONPATH"] = os.pathsep.join(parts)
    return env


def pack(logs: Path, archive: Path) -> None:
    """``logs`` as a gzipped tar at ``archive``, replaced atomically."""
    packed = io.BytesIO()
    with tarfile.open(fileobj=packed, mode="w:gz") as tar:
        tar.add(logs, arcname=logs.name)
    write_atomic(archive, packed.getvalue())


@functools.cache
def git_commit() -> str:
    """$GPU_CHECK_COMMIT when set (a copy of the working tree, a device machine's, may come
    without its git history), else the checkout's commit."""
    if os.environ.get("GPU_CHECK_COMMIT"):
        return os.environ["GPU_CHECK_COMMIT"]
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if out.returncode != 0:
        return "unknown"
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain",
                            "--untracked-files=no"],
                           capture_output=True, text=True, timeout=10).stdout.strip()
    return out.stdout.strip() + ("+changes" if dirty else "")


# ---- command line ------------------------------------------------------------------------------

def parse_settings(argv: list[str] | None) -> Settings:
    default_json = (Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "bench-out") \
        / "gpu_check.json"
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:]))
    p.add_argument("--model", default=str(ROOT / "configs/models/gpt3-1.3b.yaml"),
                   help="model profiled, planned, trained and compared (default GPT-3 1.3B)")
    p.add_argument("--cluster", default=None,
                   help="the one-GPU cluster to plan for (default: one GPU of the local device's "
                        "type in configs/gpus.yaml; without CUDA "
                        "configs/clusters/one-h100.yaml, the CPU standing in for it)")
    p.add_argument("--profile-micro-batch-sizes", type=int, nargs="+", default=[1, 2, 4],
                   metavar="B", help="micro-batch sizes profiled (default 1 2 4)")
    p.add_argument("--micro-batch-size", type=int, default=2, help="planned (default 2)")
    p.add_argument("--global-batch-size", type=int, default=16, help="planned (default 16)")
    p.add_argument("--seq-length", type=int, default=None,
                   help="tokens per sequence (default: the model's, 2048 for GPT-3)")
    p.add_argument("--iters", type=int, default=12, help="iterations trained (default 12)")
    p.add_argument("--warmup", type=int, default=4,
                   help="iterations left out of the median (default 4)")
    p.add_argument("--bench-iters", type=int, default=12,
                   help=f"iterations of each trainer in the ours-vs-stock comparison (default 12,"
                        f" at least {BENCH_MIN_ITERS}: bench_runtime drops its first 3)")
    p.add_argument("--ckpt-model", default=str(ROOT / "configs/models/gpt3-350m.yaml"),
                   help="model of the save / kill / resume check (default GPT-3 350M)")
    p.add_argument("--ckpt-micro-batch-size", type=int, default=2, help="(default 2)")
    p.add_argument("--ckpt-global-batch-size", type=int, default=16, help="(default 16)")
    p.add_argument("--ckpt-interval", type=int, default=3,
                   help="save interval; the kill lands in the second save (default 3)")
    p.add_argument("--json", default=str(default_json),
                   help="where the rows go as JSON (default $OUT/gpu_check.json when OUT is set, "
                        "else bench-out/gpu_check.json); the README section (gpu_check.md) and "
                        "the command logs go beside it (with OUT set: the logs packed, "
                        "gpu_check-logs.tar.gz)")
    p.add_argument("--work-dir", default=None,
                   help="profile, plans, corpus and checkpoints (default: a temporary directory,"
                        " removed at the end)")
    p.add_argument("--rows", default=ALL_ROWS, metavar="LETTERS",
                   help="run only these rows' steps and those they need (b needs a; c and d "
                        "need b; h needs c; f is part of e), e.g. --rows e to check a save, kill "
                        "and resume again; the 7-minute target is judged only on the whole "
                        f"check (default {ALL_ROWS}: all)")
    p.add_argument("--time-budget", type=float, default=540.0, metavar="SECONDS",
                   help="steps that would start after this are not run, and each command is "
                        "stopped by then (default 540: inside a 10-minute session)")
    args = p.parse_args(argv)

    def existing(flag: str, value: str) -> Path:
        path = Path(value).absolute()
        if not path.is_file():
            raise ConfigError("<command line>", flag, f"{value}: no such file", "an existing file")
        return path

    for flag in ("micro_batch_size", "global_batch_size", "iters", "ckpt_micro_batch_size",
                 "ckpt_global_batch_size", "ckpt_interval", "seq_length", "time_budget"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise ConfigError("<command line>", "--" + flag.replace("_", "-"), f"got {value}",
                              "a number > 0")
    if any(b <= 0 for b in args.profile_micro_batch_sizes):
        raise ConfigError("<command line>", "--profile-micro-batch-sizes",
                          f"got {args.profile_micro_batch_sizes}", "numbers > 0")
    if args.micro_batch_size not in args.profile_micro_batch_sizes:
        raise ConfigError("<command line>", "--micro-batch-size", f"{args.micro_batch_size} is "
                          "not profiled", "one of --profile-micro-batch-sizes")
    if not 0 <= args.warmup < args.iters:
        raise ConfigError("<command line>", "--warmup", f"got {args.warmup} with --iters "
                          f"{args.iters}", "0 <= warm-up < --iters")
    if args.bench_iters < BENCH_MIN_ITERS:
        raise ConfigError("<command line>", "--bench-iters", f"got {args.bench_iters}",
                          f"at least {BENCH_MIN_ITERS}")
    rows = requested_rows(args.rows)
    json_path = Path(args.json).absolute()
    if not json_path.parent.is_dir():
        json_path.parent.mkdir(parents=True, exist_ok=True)
    return Settings(
        model=existing("--model", args.model),
        cluster=args.cluster and existing("--cluster", args.cluster),
        profile_micro_batch_sizes=args.profile_micro_batch_sizes,
        micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
        seq_length=args.seq_length, iters=args.iters, warmup=args.warmup,
        bench_iters=args.bench_iters, ckpt_model=existing("--ckpt-model", args.ckpt_model),
        ckpt_micro_batch_size=args.ckpt_micro_batch_size,
        ckpt_global_batch_size=args.ckpt_global_batch_size, ckpt_interval=args.ckpt_interval,
        json_path=json_path, work_dir=Path(args.work_dir).absolute() if args.work_dir else None,
        time_budget_s=args.time_budget, rows=rows,
        logs_archive=json_path.parent / "gpu_check-logs.tar.gz" if os.environ.get("OUT") else None)


def requested_rows(letters: str) -> str:
    """The steps ``--rows`` asks for with the ones they need, in ALL_ROWS' order."""
    if not letters or set(letters) - set(ALL_ROWS + "f"):
        raise ConfigError("<command line>", "--rows", f"got {letters!r}",
                          "letters of the rows a-h, e.g. 'e' or 'abc'")
    wanted = set(letters.replace("f", "e"))
    for row in reversed(ALL_ROWS):          # each row needs an earlier one
        if row in wanted and row in ROW_NEEDS:
            wanted.add(ROW_NEEDS[row])
    return "".join(row for row in ALL_ROWS if row in wanted)


def main(argv: list[str] | None = None) -> int:
    try:
        settings = parse_settings(argv)
        load_model(settings.model)
        load_model(settings.ckpt_model)
        if settings.cluster is not None:
            cluster_gpu(settings.cluster)
    except ConfigError as exc:
        print(f"gpu_check: error: {exc}", file=sys.stderr)
        return 2
    work = settings.work_dir or Path(tempfile.mkdtemp(prefix="gpu_check-"))
    work.mkdir(parents=True, exist_ok=True)
    # Beside the JSON, or (OUT set: $OUT's files are few) in the work directory, packed.
    logs = (work if settings.logs_archive else settings.json_path.parent) / "gpu_check-logs"
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True)
    try:
        return GpuCheck(settings, work, logs).run_all()
    finally:
        if settings.logs_archive is not None:
            pack(logs, settings.logs_archive)
        if settings.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
