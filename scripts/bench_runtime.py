#!/usr/bin/env python
"""Benchmark the heterogeneous runtime: overhead vs stock megatron-core, and each proof plan.

1. Homogeneous layout (configs/plans/tiny-homogeneous.yaml, TP1 x PP2 x DP2): stock megatron-core
   (testing/stock.py: its own parallel_state, GPTModel, 1F1B schedule and P2P,
   DistributedDataParallel grad all-reduce, megatron optimizer with clipping) and our runtime
   (HeteroTrainer: parallel state from the plan, hetero P2P, layer-wise grad sync, Adam) live in
   the SAME processes and take turns iteration by iteration (order ABBA, so neither always runs
   first), on the same plan, initial weights, global batches and micro-batches. A shared, noisy
   machine then slows both alike: each iteration of ours is paired with the adjacent one of stock,
   and the reported ratio is the median of these paired ratios (target <= 1.03), with its
   interquartile range; the ratio of the two medians is reported too. Fairness is checked, not
   assumed: both train the same model on the same data, so the grad norms of the first 5
   iterations must agree to 1e-5 (relative, as in the proofs) and later ones to 1e-2 (fp32
   rounding drifts apart over many Adam steps); a mismatch aborts the benchmark.
   Besides wall time, the CPU time of every rank is summed per iteration: with more processes than
   cores, the work each iteration costs is what competes for the CPU.
2. Per-iteration time of every proof plan (configs/plans/tiny-*.yaml) with our runtime.
3. The distributed optimizer (``--use-distributed-optimizer``): on the homogeneous plan stock
   megatron-core's DistributedOptimizer (it runs on gloo) and ours (runtime/
   distributed_optimizer.py) take turns with the two non-distributed trainers of 1., all four in
   the same processes; on tiny-two-pipelines ours with and without it. Same fairness check: the
   grad norms of stock and ours with it, and of ours with and without it, must agree as in 1.
   Reported: paired ratios ours/stock with the distributed optimizer, and ours with/without.
4. bf16 (Megatron's --bf16 mixed precision) on the homogeneous plan, with and without the
   distributed optimizer: stock megatron-core in bf16 (testing/stock.py: ``Float16Module``, DDP with
   ``grad_reduce_in_fp32``, ``Float16OptimizerWithFloat16Params`` or its DistributedOptimizer on
   fp32 master shards; all run on CPU and gloo) against ours in bf16, the same fairness check with
   the bf16 proofs' tolerance for the first iterations (the two systems round bf16 sums in another
   order). Reported: paired ratios ours/stock in bf16 and in bf16 with the distributed optimizer
   (target <= 1.03, as in 1.). On a CPU without bf16 units bf16 matmuls are emulated and slower than
   fp32; the rows show the systems' overhead, not a GPU speed-up. Every run of ours without the
   distributed optimizer (fp32 and bf16) also counts each rank's live state bytes (weights, fp32
   main-gradient buckets, masters, Adam moments) against the cost model's
   ``Precision.state_bytes_per_param() * stage_param_count``.

Timed: an iteration's time is the slowest rank's wall time of ``train_step``, each rank timing
from the barrier before it (the next iteration cannot start before the slowest rank is done);
batches are read before the clock starts; the first WARMUP iterations of each trainer are dropped.
Where the machine has a GPU per rank, each rank runs on its own GPU over NCCL (the clock stops
after a CUDA synchronize); elsewhere on the CPU mode over gloo. Both trainers build the same
layer (Transformer Engine's, or megatron's local layer with torch SDPA attention) and step the
same AdamW kernel (torch's fused one on CUDA, its default on a CPU: runtime/optimizer.py).
The ratio's 95% confidence interval is the distribution-free one of a median (order statistics).
The 1-minute load average before and after the run is recorded (other jobs on the machine show
up there).

    python scripts/bench_runtime.py [--iters 150] [--plan-iters 20] [--homogeneous-only]
                                    [--no-distributed-optimizer] [--no-bf16]
                                    [--json bench-out/bench_runtime.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import statistics
import sys
import time
import traceback
from pathlib import Path

from megatron_autohet.runtime.optimizer import OptimizerSettings
from megatron_autohet.spec.precision import BF16, FP32

from _bench import silence_known_megatron_warnings

ROOT = Path(__file__).resolve().parents[1]
PLANS = ROOT / "configs/plans"
HOMOGENEOUS = "tiny-homogeneous.yaml"
WARMUP = 3
SEED = 1234
# AdamW at Megatron's default weight decay, constant lr (no scheduler: timing only).
OPTIMIZER = OptimizerSettings(lr=1e-3, clip_grad=1.0, lr_decay_style="constant")
# Same model, same data: the grad norms agree like the proofs' (tests/runtime/test_equivalence.py:
# 1e-5 for 5 iterations); over many Adam steps fp32 rounding differences grow (Adam turns rounding
# in near-zero gradients into lr-sized steps), so later iterations only have to stay on the same
# trajectory.
SAME_NORM_ITERS, SAME_NORM_REL, DRIFT_NORM_REL = 5, 1e-5, 1e-2
# In bf16 the two systems round the same sums in another order from the first update on: two bf16
# units of roundoff, the grad-norm tolerance of the bf16 proofs (tests/runtime/test_bf16.py).
BF16_SAME_NORM_REL = 2 * 2.0 ** -9
_MEGATRON_GLOBAL = re.compile(r"^_[A-Z0-9_]+$")


class _MegatronGlobals:
    """The ``megatron.core.parallel_state`` globals one trainer installed. Both trainers of the
    homogeneous comparison live in one process and megatron code reads these globals at step time
    (finalize_model_grads, the optimizer's norm), so each step runs with its own trainer's."""

    def __init__(self):
        from megatron.core import parallel_state as mps
        self.values = {k: v for k, v in vars(mps).items() if _MEGATRON_GLOBAL.match(k)}

    def install(self):
        from megatron.core import parallel_state as mps
        for name, value in self.values.items():
            setattr(mps, name, value)


# The trainers a run can hold; "-bf16": in bf16, "-distopt": with the distributed optimizer.
STOCK_KINDS = ("stock", "stock-distopt", "stock-bf16", "stock-bf16-distopt")
KINDS = ("stock", "ours", "stock-distopt", "ours-distopt", "stock-bf16", "ours-bf16",
         "stock-bf16-distopt", "ours-bf16-distopt")
# (kind, baseline) pairs whose paired time ratios are reported, when a run holds both.
RATIOS = (("ours", "stock"), ("ours-distopt", "stock-distopt"), ("ours-distopt", "ours"),
          ("ours-bf16", "stock-bf16"), ("ours-bf16-distopt", "stock-bf16-distopt"))
DISTOPT_PLANS = (HOMOGENEOUS, "tiny-two-pipelines.yaml")


def _trainers(plan, plan_path, rank, kinds):
    """{kind: (step(batch) -> grad norm, megatron globals)}, stock first (it resets megatron's)."""
    from megatron_autohet.runtime.fusions import MEGATRON_LM_DEFAULTS
    from megatron_autohet.runtime.trainer import HeteroTrainer

    trainers = {}
    for kind in sorted(kinds, key=lambda k: k not in STOCK_KINDS):
        distributed = kind.endswith("-distopt")
        precision = BF16 if "-bf16" in kind else FP32
        if kind in STOCK_KINDS:
            from megatron_autohet.testing.stock import StockMegatronTrainer
            trainer = StockMegatronTrainer(plan, rank=rank, seed=SEED, optimizer=OPTIMIZER,
                                           distributed_optimizer=distributed,
                                           precision=precision,
                                           # fused kernels where they run, as `autohet train`
                                           jit_fusions=MEGATRON_LM_DEFAULTS)
            inner = trainer.megatron_optimizers
            if distributed != all(type(o).__name__ == "DistributedOptimizer" for o in inner):
                raise RuntimeError(f"{kind}: megatron built {[type(o).__name__ for o in inner]}")
        else:
            trainer = HeteroTrainer(plan, plan.model, rank=rank, seed=SEED, optimizer=OPTIMIZER,
                                    plan_file=str(plan_path), distributed_optimizer=distributed,
                                    precision=precision, jit_fusions=MEGATRON_LM_DEFAULTS)
        trainers[kind] = (lambda batch, t=trainer: t.train_step(batch).grad_norm,
                          _MegatronGlobals(), trainer)
    return trainers


def _state_bytes(trainer) -> dict:
    """This rank's live state bytes and the cost model's prediction for its stage."""
    from megatron_autohet.cost_model import stage_param_count
    from megatron_autohet.profiling.estimate import estimate_entry
    from megatron_autohet.spec.gpus import load_gpu_catalog

    def size(tensors):
        return sum(t.numel() * t.element_size() for t in tensors)

    params = list(trainer.model.parameters())
    stage, plan = trainer.state.role.stage, trainer.plan
    entry = estimate_entry(plan.model, load_gpu_catalog()["A100-80GB"], stage.tp_size,
                           plan.micro_batch_size, plan.seq_length, 300)
    count = stage_param_count(entry, plan.model, stage.layers[1] - stage.layers[0],
                              stage.is_first, stage.is_last)
    measured = (size(params) + size(b.grad_data for b in trainer.grad_sync.buckets)
                + size(m for m in trainer.masters.tensors if all(m is not p for p in params))
                + size(s[k] for s in trainer.optimizer.state.values()
                       for k in ("exp_avg", "exp_avg_sq")))
    return {"measured": measured,
            "predicted": trainer.precision.state_bytes_per_param() * count}


def _rank_main(rank, world, port, plan_path, kinds, iters, data_dir, results):
    silence_known_megatron_warnings()
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        from megatron_autohet.data.batches import DataOptions, build_global_batches
        from megatron_autohet.plan import load_plan
        from megatron_autohet.runtime.cpu_mode import cpu_mode_required, enable_cpu_mode

        # One GPU per rank with NCCL where the machine has enough, else the CPU mode on gloo.
        on_gpu = not cpu_mode_required() and torch.cuda.device_count() >= world
        if on_gpu:
            torch.cuda.set_device(rank)
        else:
            enable_cpu_mode()
        dist.init_process_group("nccl" if on_gpu else "gloo",
                                init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
        plan = load_plan(plan_path)
        data = build_global_batches(DataOptions(
            seq_length=plan.seq_length, global_batch_size=plan.global_batch_size,
            num_iterations=iters, seed=SEED, data_dir=data_dir), plan.model.vocab_size)
        batches = [data.batch(i).tensors() for i in range(iters)]
        trainers = _trainers(plan, plan_path, rank, kinds)
        kinds = list(trainers)
        out = {kind: {"wall": [], "cpu": [], "grad_norm": []} for kind in kinds}
        for i in range(iters):
            for kind in (kinds if i % 2 == 0 else kinds[::-1]):     # ABBA...
                step, megatron_globals, _ = trainers[kind]
                megatron_globals.install()
                dist.barrier()
                wall, cpu = time.perf_counter(), time.process_time()
                grad_norm = step(batches[i])
                if on_gpu:      # the optimizer's update may still be queued on the GPU
                    torch.cuda.synchronize()
                out[kind]["wall"].append(time.perf_counter() - wall)
                out[kind]["cpu"].append(time.process_time() - cpu)
                out[kind]["grad_norm"].append(grad_norm)
        for kind, (_, _, trainer) in trainers.items():
            if kind.startswith("ours") and not kind.endswith("-distopt"):
                out[kind]["state_bytes"] = _state_bytes(trainer)
        dist.destroy_process_group()
        results.put((rank, True, out))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the run
        results.put((rank, False, traceback.format_exc()))
    finally:
        results.close()
        results.join_thread()
        os._exit(0)


def run_plan(plan_path: Path, *, kinds: tuple[str, ...], iters: int,
             data_dir: str) -> list[dict]:
    """Every rank's {kind: {"wall", "cpu", "grad_norm": per-iteration lists}}, in rank order."""
    from megatron_autohet.plan import load_plan
    from megatron_autohet.system.ports import free_port

    world = load_plan(plan_path).world_size
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, plan_path, kinds, iters,
                                                  data_dir, results))
             for r in range(world)]
    for p in procs:
        p.start()
    out = {}
    for _ in range(world):
        rank, ok, value = results.get(timeout=900)
        if not ok:
            for p in procs:
                p.kill()
            raise RuntimeError(f"{plan_path.name}: rank {rank} failed:\n{value}")
        out[rank] = value
    for p in procs:
        p.join()
    return [out[r] for r in range(world)]


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def _median_ci95(values: list[float]) -> tuple[float, float]:
    """Distribution-free 95% confidence interval of the median: order statistics
    n/2 -+ 1.96 sqrt(n)/2 (normal approximation of the binomial)."""
    ordered, n = sorted(values), len(values)
    half = 1.96 * n ** 0.5 / 2
    return ordered[max(0, int(n / 2 - half))], ordered[min(n - 1, int(n / 2 + half))]


def summarize(per_rank: list[dict], plan_name: str) -> dict:
    """The slowest rank's wall time and all ranks' summed CPU time per kept iteration (ms); for
    the stock comparison also the paired ratios, after checking both trained the same model."""
    kept = slice(WARMUP, None)
    entry = {}
    for kind in per_rank[0]:
        wall = [1000 * max(w) for w in zip(*(r[kind]["wall"] for r in per_rank))][kept]
        cpu = [1000 * sum(c) for c in zip(*(r[kind]["cpu"] for r in per_rank))][kept]
        entry[kind] = {"wall_ms": wall, "wall_quartiles_ms": _quartiles(wall),
                       "cpu_all_ranks_ms": cpu, "cpu_quartiles_ms": _quartiles(cpu)}
        if "state_bytes" in per_rank[0][kind]:
            entry[kind]["state_bytes_per_rank"] = [r[kind]["state_bytes"] for r in per_rank]
    for kind, base in RATIOS:
        if kind in entry and base in entry:
            entry.update(_ratio_fields(per_rank, entry, kind, base, plan_name,
                                       prefix="" if base == "stock" else f"{kind}/{base} "))
    return entry


def _ratio_fields(per_rank, entry, kind, base, plan_name, prefix) -> dict:
    """Fairness check (same grad norms) and the paired time ratios of ``kind`` over ``base``;
    the keys start with ``prefix`` (empty for the main ours/stock comparison)."""
    worst = [0.0, 0.0]                  # the proof's first iterations, the rest
    same = BF16_SAME_NORM_REL if "-bf16" in kind else SAME_NORM_REL
    for rank, result in enumerate(per_rank):
        for i, (ours, other) in enumerate(zip(result[kind]["grad_norm"],
                                              result[base]["grad_norm"])):
            diff, strict = abs(ours - other) / abs(other), i < SAME_NORM_ITERS
            worst[not strict] = max(worst[not strict], diff)
            if diff > (same if strict else DRIFT_NORM_REL):
                raise RuntimeError(f"{plan_name}: unfair comparison - iteration {i} on rank "
                                   f"{rank}: grad norm {ours} ({kind}) vs {other} ({base})")
    paired = [o / s for o, s in zip(entry[kind]["wall_ms"], entry[base]["wall_ms"])]
    paired_cpu = [o / s for o, s in zip(entry[kind]["cpu_all_ranks_ms"],
                                        entry[base]["cpu_all_ranks_ms"])]
    quartiles = _quartiles(paired)
    return {f"{prefix}grad_norm_rel_diff_first": worst[0],
            f"{prefix}grad_norm_rel_diff_later": worst[1],
            f"{prefix}paired_ratios": paired, f"{prefix}ratio_quartiles": quartiles,
            f"{prefix}ratio": quartiles[1], f"{prefix}ratio_ci95": _median_ci95(paired),
            f"{prefix}ratio_of_medians": (entry[kind]["wall_quartiles_ms"][1]
                                          / entry[base]["wall_quartiles_ms"][1]),
            f"{prefix}cpu_ratio": _quartiles(paired_cpu)[1]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=150,
                        help="iterations of each trainer in the ours-vs-stock comparison "
                             f"(the first {WARMUP} are warm-up)")
    parser.add_argument("--plan-iters", type=int, default=20,
                        help="iterations of each other proof plan")
    parser.add_argument("--homogeneous-only", action="store_true",
                        help="only the ours-vs-stock comparison, not the other proof plans")
    parser.add_argument("--no-distributed-optimizer", action="store_true",
                        help="without the distributed-optimizer trainers (part 3)")
    parser.add_argument("--no-bf16", action="store_true",
                        help="without the bf16 trainers (part 4)")
    parser.add_argument("--json", default=str(ROOT / "bench-out" / "bench_runtime.json"),
                        help="where to write the results (default bench-out/, gitignored)")
    parser.add_argument("--data-dir", default=None, help="corpus cache (see autohet train)")
    args = parser.parse_args(argv)
    for name in ("iters", "plan_iters"):
        if getattr(args, name) < WARMUP + 4:
            parser.error(f"--{name.replace('_', '-')} must be >= {WARMUP + 4} (the first "
                         f"{WARMUP} are warm-up)")

    from tqdm import tqdm

    from megatron_autohet.data.batches import DataOptions, resolve_data_path
    resolve_data_path(DataOptions(64, 8, 1, data_dir=args.data_dir))    # build the corpus once

    plans = sorted(PLANS.glob("tiny-*.yaml"))
    if args.homogeneous_only:
        plans = [PLANS / HOMOGENEOUS]
    report = {"iters": args.iters, "plan_iters": args.plan_iters, "warmup": WARMUP,
              "cpu_count": os.cpu_count(), "load_average_1min_before": os.getloadavg()[0],
              "plans": {}}
    for plan_path in tqdm(plans, desc="plans", file=sys.stderr):
        kinds = ("stock", "ours") if plan_path.name == HOMOGENEOUS else ("ours",)
        if plan_path.name in DISTOPT_PLANS and not args.no_distributed_optimizer:
            kinds += tuple(f"{kind}-distopt" for kind in kinds)
        if plan_path.name == HOMOGENEOUS and not args.no_bf16:
            kinds += ("stock-bf16", "ours-bf16")
            if not args.no_distributed_optimizer:
                kinds += ("stock-bf16-distopt", "ours-bf16-distopt")
        per_rank = run_plan(plan_path, kinds=kinds,
                            iters=args.iters if plan_path.name == HOMOGENEOUS
                            else args.plan_iters, data_dir=args.data_dir)
        report["plans"][plan_path.name] = summarize(per_rank, plan_path.name)
    report["load_average_1min_after"] = os.getloadavg()[0]

    print(f"{'plan':27s} {'runtime':18s} {'wall ms/iter: q1  median   q3':>31s} "
          f"{'CPU ms/iter, all ranks: median':>31s}")
    for name, entry in report["plans"].items():
        for kind in KINDS:
            if kind in entry:
                q1, med, q3 = entry[kind]["wall_quartiles_ms"]
                print(f"{name:27s} {kind:18s} {q1:13.1f} {med:8.1f} {q3:8.1f} "
                      f"{entry[kind]['cpu_quartiles_ms'][1]:31.1f}")
    homogeneous = report["plans"].get(HOMOGENEOUS, {})
    if "ratio" in homogeneous:
        q1, ratio, q3 = homogeneous["ratio_quartiles"]
        low, high = homogeneous["ratio_ci95"]
        print(f"homogeneous ours/stock (median of {len(homogeneous['paired_ratios'])} paired "
              f"iterations) = {ratio:.3f} [95% CI {low:.3f}-{high:.3f}, IQR {q1:.3f}-{q3:.3f}], "
              f"ratio of medians "
              f"{homogeneous['ratio_of_medians']:.3f}, CPU {homogeneous['cpu_ratio']:.3f}; "
              f"target <= 1.03: {'met' if ratio <= 1.03 else 'NOT met'}")
        print(f"same model and data: grad norm rel diff ours vs stock "
              f"{homogeneous['grad_norm_rel_diff_first']:.1e} (first {SAME_NORM_ITERS} "
              f"iterations), {homogeneous['grad_norm_rel_diff_later']:.1e} (later)")
    for name, entry in report["plans"].items():
        for kind, base in RATIOS[1:]:
            prefix = f"{kind}/{base} "
            if f"{prefix}ratio" in entry:
                q1, ratio, q3 = entry[f"{prefix}ratio_quartiles"]
                print(f"{name}: {kind}/{base} wall time (median of paired iterations) = "
                      f"{ratio:.3f} [IQR {q1:.3f}-{q3:.3f}], CPU {entry[f'{prefix}cpu_ratio']:.3f};"
                      f" grad norm rel diff {entry[f'{prefix}grad_norm_rel_diff_first']:.1e} "
                      f"(first {SAME_NORM_ITERS}), "
                      f"{entry[f'{prefix}grad_norm_rel_diff_later']:.1e} (later)")
    print("live state bytes per rank (weights, fp32 main grads, masters, Adam) vs the cost model:")
    for name, entry in report["plans"].items():
        for kind, stats in entry.items():
            if isinstance(stats, dict) and "state_bytes_per_rank" in stats:
                pairs = ", ".join(f"{b['measured']}/{b['predicted']:.0f}"
                                  for b in stats["state_bytes_per_rank"])
                print(f"  {name:27s} {kind:10s} measured/predicted: {pairs}")
    print(f"load average (1 min) before/after: {report['load_average_1min_before']:.2f} / "
          f"{report['load_average_1min_after']:.2f} on {os.cpu_count()} CPUs")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
