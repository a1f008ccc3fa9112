"""Where one GPU's iteration goes: device time by kind of kernel, for a one-GPU plan.

Builds the runtime's trainer for the plan (``autohet train``'s defaults: bf16 and megatron-core's
fused kernels on a GPU, fp32 on a CPU), trains ``--warmup`` iterations, then records
``--iters`` more with torch.profiler and sums each kernel's own time by kind: matrix multiplies,
attention, the optimizer's multi-tensor kernels, communication, and the elementwise, norm and
copy kernels around them. On a GPU the kernel (device) time is summed; on a CPU the operators'
own CPU time stands in for it. Whatever is not one of those kinds, host gaps included, is the
difference between the sum and the wall time.

    python scripts/bench_kernels.py --plan PLAN --model MODEL [--iters 3] [--warmup 3]

prints a table (kind, ms per iteration, share of the iteration) and writes
bench-out/bench_kernels.json (the kinds, the 15 longest kernels, the wall time).
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

from _bench import silence_known_megatron_warnings, write_json
from megatron_autohet.errors import ConfigError

# Kernel (GPU) and operator (CPU) names by kind, tried in this order.
KINDS = (
    ("attention", r"flash|fmha|attention|_efficient_attention|sdpa|scaled_dot_product"),
    ("communication", r"nccl|c10d|all_reduce|allreduce|broadcast"),
    ("optimizer", r"adam|multi_tensor|_foreach_|_fused_adamw"),
    ("matmul", r"gemm|cutlass|xmma|nvjet|cublas|sm\d+_|aten::(mm|addmm|bmm|baddbmm|matmul)$"),
    ("elementwise, norms, copies", r""),      # every other kernel
)
TOP = 15


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if re.search(pattern, name, re.IGNORECASE):
            return kind
    return KINDS[-1][0]


def profile_plan(plan_path: Path, model_path: Path, iters: int, warmup: int,
                 data_dir: str | None) -> dict:
    import torch
    import torch.distributed as dist
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from megatron_autohet.data.batches import DataOptions, build_global_batches
    from megatron_autohet.job import TrainOptions
    from megatron_autohet.plan import load_plan
    from megatron_autohet.runtime.cpu_mode import cpu_mode_required, enable_cpu_mode
    from megatron_autohet.runtime.optimizer import OptimizerSettings
    from megatron_autohet.system.ports import free_port
    from megatron_autohet.runtime.trainer import HeteroTrainer
    from megatron_autohet.spec import load_model
    from megatron_autohet.spec.precision import default_precision

    plan, model = load_plan(plan_path), load_model(model_path)
    if plan.world_size != 1:
        raise ConfigError(str(plan_path), "ranks", f"{plan.world_size} GPUs", "a one-GPU plan")
    on_gpu = not cpu_mode_required()
    if on_gpu:
        torch.cuda.set_device(0)
    else:
        enable_cpu_mode()
    dist.init_process_group("nccl" if on_gpu else "gloo", rank=0, world_size=1,
                            init_method=f"tcp://127.0.0.1:{free_port()}")
    # `autohet train`'s defaults (the learning rate does not change the time)
    defaults = TrainOptions(iters=1, seed=1234, optimizer=OptimizerSettings(lr=1e-3))
    trainer = HeteroTrainer(plan, model, rank=0, seed=defaults.seed, optimizer=defaults.optimizer,
                            precision=default_precision(on_gpu),
                            jit_fusions=defaults.jit_fusions)
    data = build_global_batches(DataOptions(
        seq_length=plan.seq_length, global_batch_size=plan.global_batch_size,
        num_iterations=warmup + iters, seed=defaults.seed, data_dir=data_dir), model.vocab_size)

    def step(i: int) -> None:
        trainer.train_step(data.batch(i).tensors())
        if on_gpu:
            torch.cuda.synchronize()

    for i in range(warmup):
        step(i)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) as prof:
        started = time.perf_counter()
        for i in range(warmup, warmup + iters):
            step(i)
        wall = (time.perf_counter() - started) / iters
    events = prof.key_averages()
    if on_gpu:
        # The kernels themselves; should a torch version not list them, the operators' own device
        # time (that of the kernels each launched) classifies by operator name the same way.
        kernels = [e for e in events if e.device_type == DeviceType.CUDA]
        timed = [(e.key, e.self_device_time_total) for e in kernels or events]
    else:
        timed = [(e.key, e.self_cpu_time_total) for e in events if e.device_type == DeviceType.CPU]
    own = {}                                        # kernel / operator -> own seconds per iteration
    for name, microseconds in timed:
        if microseconds > 0:
            own[name] = own.get(name, 0.0) + microseconds / 1e6 / iters
    by_kind = dict.fromkeys((k for k, _ in KINDS), 0.0)
    for name, seconds in own.items():
        by_kind[kind_of(name)] += seconds
    dist.destroy_process_group()
    return {"device": torch.cuda.get_device_name() if on_gpu else "CPU",
            "time": "kernel (device) time" if on_gpu else "operators' own CPU time",
            "plan": str(plan_path), "iterations": iters, "warmup": warmup,
            "wall_s_per_iteration": wall, "seconds_per_iteration": by_kind,
            "fusions": trainer.fusions.describe(),
            "longest": sorted(((name, kind_of(name), s) for name, s in own.items()),
                              key=lambda row: -row[2])[:TOP]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", required=True, help="a one-GPU plan (`autohet plan`)")
    parser.add_argument("--model", required=True, help="the plan's model YAML")
    parser.add_argument("--iters", type=int, default=3, help="iterations recorded (default 3)")
    parser.add_argument("--warmup", type=int, default=3,
                        help="iterations trained before, not recorded (default 3)")
    parser.add_argument("--data-dir", default=None, help="as `autohet train --data-dir`")
    parser.add_argument("--json", default="bench-out/bench_kernels.json")
    args = parser.parse_args(argv)
    for flag in ("iters", "warmup"):
        if getattr(args, flag) < (1 if flag == "iters" else 0):
            parser.error(f"--{flag}: got {getattr(args, flag)}")
    silence_known_megatron_warnings()
    try:
        result = profile_plan(Path(args.plan), Path(args.model), args.iters, args.warmup,
                              args.data_dir)
    except ConfigError as exc:
        print(f"bench_kernels: error: {exc}", file=sys.stderr)
        return 2
    wall = result["wall_s_per_iteration"]
    print(f"{result['device']}: {result['time']} per iteration, {result['iterations']} recorded "
          f"after {result['warmup']}; {result['fusions']}")
    print(f"{'kind':<28} {'ms/iter':>9} {'share':>7}")
    for kind, seconds in result["seconds_per_iteration"].items():
        print(f"{kind:<28} {1e3 * seconds:>9.1f} {seconds / wall:>7.1%}")
    print(f"{'wall time':<28} {1e3 * wall:>9.1f} {1:>7.0%}")
    write_json(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
