#!/usr/bin/env python
"""Benchmark the heterogeneous runtime: overhead vs stock megatron-core, and each proof plan.

1. Homogeneous layout (configs/plans/tiny-homogeneous.yaml, TP1 x PP2 x DP2): in the SAME
   processes, alternating rounds of stock megatron-core (runtime/stock.py: its own
   parallel_state, GPTModel, 1F1B schedule, DistributedDataParallel grad all-reduce, megatron
   optimizer with clipping; our initial weights and loss) and of our runtime (HeteroTrainer: parallel state from the plan, hetero P2P, layer-wise grad sync, Adam).
   Alternating cancels drift of a shared machine; the ratio is ours / stock of the median
   iteration time (target <= 1.03).
2. Per-iteration time of every proof plan (configs/plans/tiny-*.yaml) with our runtime.

Every process gets the same global batches from the built-in corpus (megatron-core GPTDataset).
Times are rank 0's wall time per iteration, first iterations of each round dropped (warm-up).

    python scripts/bench_runtime.py [--iters 12] [--rounds 2] [--json bench-runtime.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLANS = ROOT / "configs/plans"
HOMOGENEOUS = "tiny-homogeneous.yaml"
WARMUP = 2
SEED, LR, CLIP = 1234, 1e-3, 1.0


def _stock_megatron_step_fn(plan, rank):
    """Stock megatron-core on the homogeneous plan (runtime/stock.py); returns step, teardown."""
    from megatron_autohet.runtime.stock import StockMegatronTrainer

    trainer = StockMegatronTrainer(plan, rank=rank, lr=LR, seed=SEED, clip_grad=CLIP)
    return trainer.train_step, trainer.close


def _ours_step_fn(plan, plan_path, rank):
    from megatron_autohet.runtime.trainer import HeteroTrainer

    trainer = HeteroTrainer(plan, plan.model, rank=rank, lr=LR, seed=SEED, clip_grad=CLIP,
                            plan_file=str(plan_path))
    return trainer.train_step, None


def _timed(step, batches, iters):
    import torch.distributed as dist

    times = []
    for i in range(iters):
        dist.barrier()
        start = time.perf_counter()
        step(batches.batch(i))
        times.append(time.perf_counter() - start)
    return times[WARMUP:]


def _rank_main(rank, world, port, plan_path, with_stock, iters, rounds, data_dir, results):
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        from megatron_autohet.data.batches import DataOptions, build_global_batches
        from megatron_autohet.plan import load_plan
        from megatron_autohet.runtime.cpu_mode import cpu_mode_required, enable_cpu_mode

        if cpu_mode_required():
            enable_cpu_mode()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
        plan = load_plan(plan_path)
        batches = build_global_batches(DataOptions(
            seq_length=plan.seq_length, global_batch_size=plan.global_batch_size,
            num_iterations=iters, seed=SEED, data_dir=data_dir), plan.model.vocab_size)
        times = {"ours": [], "stock": []}
        for _ in range(rounds if with_stock else 1):
            kinds = ("stock", "ours") if with_stock else ("ours",)
            for kind in kinds:
                if kind == "stock":
                    step, teardown = _stock_megatron_step_fn(plan, rank)
                else:
                    step, teardown = _ours_step_fn(plan, plan_path, rank)
                times[kind] += _timed(step, batches, iters)
                if teardown:
                    teardown()
        dist.destroy_process_group()
        results.put((rank, True, times))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        results.close()
        results.join_thread()
        os._exit(0)


def run_plan(plan_path: Path, *, with_stock: bool, iters: int, rounds: int, data_dir: str) -> dict:
    from megatron_autohet.plan import load_plan
    from megatron_autohet.runtime.launch import free_port

    world = load_plan(plan_path).world_size
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, plan_path, with_stock, iters,
                                                  rounds, data_dir, results))
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
    return out[0]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=12, help="iterations per measurement")
    parser.add_argument("--rounds", type=int, default=2,
                        help="alternating stock/ours rounds on the homogeneous plan")
    parser.add_argument("--json", default="bench-runtime.json", help="where to write the results")
    parser.add_argument("--data-dir", default=None, help="corpus cache (see autohet train)")
    args = parser.parse_args(argv)
    if args.iters <= WARMUP:
        parser.error(f"--iters must be > {WARMUP} (the first {WARMUP} are warm-up)")

    from tqdm import tqdm

    from megatron_autohet.data.batches import resolve_data_path, DataOptions
    resolve_data_path(DataOptions(64, 8, 1, data_dir=args.data_dir))    # build the corpus once

    plans = sorted(PLANS.glob("tiny-*.yaml"))
    rows, report = [], {"iters": args.iters, "warmup": WARMUP, "rounds": args.rounds,
                        "cpu_count": os.cpu_count(), "plans": {}}
    for plan_path in tqdm(plans, desc="plans", file=sys.stderr):
        homogeneous = plan_path.name == HOMOGENEOUS
        times = run_plan(plan_path, with_stock=homogeneous, iters=args.iters,
                         rounds=args.rounds, data_dir=args.data_dir)
        entry = {"ours_median_ms": 1000 * statistics.median(times["ours"]),
                 "ours_ms": [1000 * t for t in times["ours"]]}
        if homogeneous:
            entry["stock_median_ms"] = 1000 * statistics.median(times["stock"])
            entry["stock_ms"] = [1000 * t for t in times["stock"]]
            entry["ratio"] = entry["ours_median_ms"] / entry["stock_median_ms"]
            report["homogeneous_ratio"] = entry["ratio"]
        report["plans"][plan_path.name] = entry
        rows.append((plan_path.name, entry["ours_median_ms"], entry.get("stock_median_ms"),
                     entry.get("ratio")))

    print(f"{'plan':28s} {'ours ms/iter':>13s} {'stock ms/iter':>14s} {'ours/stock':>11s}")
    for name, ours, stock, ratio in rows:
        print(f"{name:28s} {ours:13.1f} {stock if stock else float('nan'):14.1f} "
              f"{ratio if ratio else float('nan'):11.3f}")
    ratio = report.get("homogeneous_ratio")
    if ratio is not None:
        print(f"homogeneous overhead ours/stock = {ratio:.3f} (target <= 1.03): "
              f"{'met' if ratio <= 1.03 else 'NOT met'}")
    Path(args.json).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
