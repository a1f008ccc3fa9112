#!/usr/bin/env python
"""Benchmark the HAPT warm-up over a genuinely slow link: standard vs deeper 1F1B warm-up.

Setup (needs root and iproute2; never part of the test suite): two Linux network namespaces
joined by a veth pair, shaped on both ends with a token-bucket filter (``tc qdisc ... tbf rate
R``: each direction of the link gets the rate; its queue is long enough never to drop). netem
(which could add propagation delay too) is not in every kernel (not in this development VM's),
tbf is. So the link is slow in bandwidth, not in latency. Rank 0 (stage 0 of a two-stage pipeline)
runs in one namespace, rank 1 (stage 1) in the other; gloo talks TCP over the veth addresses
(``GLOO_SOCKET_IFNAME``, the rendezvous on rank 0's address). Every byte between the stages,
activations, gradients and the per-iteration loss/grad-norm all-reduce, crosses the shaped link.

Each rank builds one :class:`~megatron_autohet.runtime.trainer.HeteroTrainer` per warm-up
variant (the same plan except stage 0's ``warmup_microbatches``; the standard depth is 1), all
from the same seed, and trains them on the same global batches, taking turns iteration by
iteration (the order rotates every iteration, so no variant always runs first). The schedules
differ only in timing, so the variants must report bit-identical grad norms every iteration;
a mismatch aborts the run. An iteration's time is the slowest rank's wall time of
``train_step`` from a barrier; the first WARMUP iterations are dropped; reported: the median
and quartiles per variant, and per deeper variant the median of its paired ratios to the
standard variant's time in the same round; next to them the planner's prediction for the same
pipeline, ``cost_model.simulate_1f1b`` over each stage's measured compute per micro-batch (timed
on both ranks at once after the run) and the link's rate, so model and measurement can be
compared. The 1-minute load average before and after is recorded (other jobs on the machine
show up there).

    sudo python scripts/bench_hapt.py [--iters 30] [--microbatches 8] [--rate-mbit 20]
        [--queue-ms 20] [--warmups 1,2,4,8] [--json bench-out/bench_hapt.json]

``--rate-mbit 0`` runs the same over an unshaped veth (the control).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _netns
from _bench import silence_known_megatron_warnings, write_json

ROOT = Path(__file__).resolve().parents[1]
NAMESPACES = ("autohet-hapt0", "autohet-hapt1")
DEVICES = ("hapt0", "hapt1")
ADDRESSES = ("10.213.0.1", "10.213.0.2")
PORT = 29517
SEED = 1234
WARMUP = 3
# Big enough that a micro-batch's compute is visible next to the link (a few ms per stage on
# one CPU core), small enough for a 2-core machine: 4 layers of hidden 256, sequence 128.
MODEL = dict(name="hapt-bench", num_layers=4, hidden_size=256, num_attention_heads=4,
             ffn_hidden_size=1024, vocab_size=1024, seq_length=128, num_query_groups=4,
             gated_linear_unit=False, position_embedding_type="learned_absolute",
             tie_embeddings=True)
MICRO_BATCH_SIZE = 2


def plan_dict(num_microbatches: int, warmup: int) -> dict:
    """Two stages (layers split evenly), one rank each, stage 0 with the given warm-up depth."""
    half = MODEL["num_layers"] // 2
    return {
        "cluster": "netns-pair", "model": MODEL, "micro_batch_size": MICRO_BATCH_SIZE,
        "global_batch_size": MICRO_BATCH_SIZE * num_microbatches,
        "seq_length": MODEL["seq_length"],
        "ranks": [{"rank": 0, "node": "a", "local_rank": 0, "gpu": "cpu"},
                  {"rank": 1, "node": "b", "local_rank": 0, "gpu": "cpu"}],
        "pipelines": [{"num_microbatches": num_microbatches, "stages": [
            {"ranks": [0], "layers": [0, half], "warmup_microbatches": warmup},
            {"ranks": [1], "layers": [half, MODEL["num_layers"]], "warmup_microbatches": 0}]}]}


# ---- the slow link ------------------------------------------------------------------------------

def link_up(rate_mbit: float, queue_ms: float) -> None:
    """Namespaces, the veth pair between them, addresses, and the rate limit on both ends."""
    link_down()
    for ns in NAMESPACES:
        _netns.add_namespace(ns)
    _netns.add_veth(DEVICES[0], NAMESPACES[0], DEVICES[1], NAMESPACES[1])
    for ns, dev, addr in zip(NAMESPACES, DEVICES, ADDRESSES):
        _netns.address_up(dev, ns, addr)
        if rate_mbit > 0:
            # A short queue (packets wait at most queue_ms, TCP's congestion control keeps it
            # there): gloo runs both directions over one TCP connection, so in a deep queue the
            # ACKs and gloo's receive-ready notes of one direction would wait behind whole
            # messages of the other (bufferbloat), coupling the directions the link should
            # carry concurrently.
            _netns.shape(dev, ns, rate_mbit, queue_ms, burst_bytes=32 * 1024)


def link_down() -> None:
    for ns in NAMESPACES:   # deleting a namespace deletes its end of the veth, and so the pair
        _netns.delete_namespace(ns)


# ---- one rank (runs inside its namespace) --------------------------------------------------------

def worker(args) -> None:
    silence_known_megatron_warnings()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from megatron_autohet.data.batches import DataOptions, build_global_batches
    from megatron_autohet.plan import plan_from_dict
    from megatron_autohet.runtime.cpu_mode import cpu_mode_required, enable_cpu_mode
    from megatron_autohet.runtime.optimizer import OptimizerSettings
    from megatron_autohet.runtime.trainer import HeteroTrainer

    if cpu_mode_required():
        enable_cpu_mode()
    rank = args.rank
    dist.init_process_group("gloo", init_method=f"tcp://{ADDRESSES[0]}:{PORT}", rank=rank,
                            world_size=2)
    warmups = [int(w) for w in args.warmups.split(",")]
    plans = [plan_from_dict(plan_dict(args.microbatches, w)) for w in warmups]
    data = build_global_batches(DataOptions(
        seq_length=MODEL["seq_length"], global_batch_size=plans[0].global_batch_size,
        num_iterations=args.iters, seed=SEED, data_dir=args.data_dir), MODEL["vocab_size"])
    batches = [data.batch(i).tensors() for i in range(args.iters)]
    settings = OptimizerSettings(lr=1e-4, clip_grad=1.0, lr_decay_style="constant")
    trainers = [HeteroTrainer(p, rank=rank, seed=SEED, optimizer=settings) for p in plans]
    wall = [[] for _ in warmups]
    norms = [[] for _ in warmups]
    for i in range(args.iters):
        for v in [(i + k) % len(warmups) for k in range(len(warmups))]:
            dist.barrier()
            start = time.perf_counter()
            metrics = trainers[v].train_step(batches[i])
            wall[v].append(time.perf_counter() - start)
            norms[v].append(metrics.grad_norm)
    stage_s = stage_compute_s(trainers[0], batches[0], plans[0].micro_batch_size)
    dist.destroy_process_group()
    Path(args.result).write_text(json.dumps({"wall_s": wall, "grad_norm": norms,
                                             "stage_s": stage_s}))


def stage_compute_s(trainer, batch: dict, micro_batch_size: int, repeats: int = 10
                    ) -> tuple[float, float]:
    """Median (forward, backward) seconds of one micro-batch through this rank's stage, both
    ranks computing at the same time as in the schedule, with no link in between: stage 1 takes
    a random activation, stage 0 a random output gradient. What the simulation is given."""
    import torch
    import torch.distributed as dist

    model, first = trainer.model, trainer.state.is_first_stage
    mb = {k: v[:micro_batch_size] for k, v in batch.items()}
    shape = (MODEL["seq_length"], micro_batch_size, MODEL["hidden_size"])
    forward, backward = [], []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        if first:
            out = model(mb["tokens"], mb["position_ids"], None)
        else:
            model.set_input_tensor(torch.randn(shape, requires_grad=True))
            out = model(mb["tokens"], mb["position_ids"], None, labels=mb["labels"]).mean()
        middle = time.perf_counter()
        out.backward(torch.randn_like(out) if first else None)
        forward.append(middle - start)
        backward.append(time.perf_counter() - middle)
    return statistics.median(forward), statistics.median(backward)


# ---- the driver ----------------------------------------------------------------------------------

def simulate_pipeline(stage_s: list[tuple[float, float]], num_microbatches: int, warmup: int,
                      rate_mbit: float) -> float:
    """The planner's prediction for this pipeline: cost_model.simulate_1f1b over the measured
    per-stage compute and the link's rate (activation and gradient each one message per
    micro-batch; an unshaped veth counts as free). Only the schedule: the loss/grad-norm
    all-reduce and the optimizer step of an iteration are not in it."""
    from megatron_autohet.cost_model import StageCost, simulate_1f1b

    activation_bits = MICRO_BATCH_SIZE * MODEL["seq_length"] * MODEL["hidden_size"] * 4 * 8
    p2p_s = 2 * activation_bits / (rate_mbit * 1e6) if rate_mbit > 0 else 0.0
    stages = [StageCost(pipeline=0, stage=s, gpu="cpu", tp=1, layers=(0, 0), forward_s=f,
                        backward_s=b, p2p_s=p2p_s if s == 0 else 0.0, p2p_bandwidth_gbs=None,
                        in_flight_microbatches=0, param_count=0, memory_gib=0.0,
                        memory_limit_gib=0.0, sync_s=0.0, optimizer_s=0.0)
              for s, (f, b) in enumerate(stage_s)]
    return simulate_1f1b(stages, num_microbatches, [warmup, 0])


def _quartiles(values: list[float]) -> list[float]:
    return statistics.quantiles(values, n=4, method="inclusive")


def run(args) -> dict:
    warmups = [int(w) for w in args.warmups.split(",")]
    if warmups[0] != 1:
        raise SystemExit("--warmups must start with 1, the standard depth of a 2-stage pipeline")
    if any(not 1 <= w <= args.microbatches for w in warmups):
        raise SystemExit(f"--warmups: each depth in 1..{args.microbatches} (--microbatches)")
    load_before = os.getloadavg()[0]
    tmp = Path(tempfile.mkdtemp(prefix="bench-hapt-"))
    try:
        from megatron_autohet.data.batches import DataOptions, resolve_data_path
        resolve_data_path(DataOptions(MODEL["seq_length"], 1, 1, data_dir=str(tmp / "data")))
        link_up(args.rate_mbit, args.queue_ms)
        procs = []
        for rank in (0, 1):
            env = dict(os.environ, GLOO_SOCKET_IFNAME=DEVICES[rank], MASTER_ADDR=ADDRESSES[0])
            cmd = ["ip", "netns", "exec", NAMESPACES[rank], sys.executable, __file__, "--worker",
                   "--rank", str(rank), "--result", str(tmp / f"rank{rank}.json"),
                   "--iters", str(args.iters), "--microbatches", str(args.microbatches),
                   "--warmups", args.warmups, "--data-dir", str(tmp / "data")]
            procs.append(subprocess.Popen(cmd, env=env))
        deadline = time.monotonic() + args.timeout
        for p in procs:
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                raise SystemExit(f"workers did not finish within {args.timeout} s")
        if any(p.returncode for p in procs):
            raise SystemExit(f"a worker failed: exit codes {[p.returncode for p in procs]}")
        per_rank = [json.loads((tmp / f"rank{r}.json").read_text()) for r in (0, 1)]
    finally:
        link_down()
        shutil.rmtree(tmp, ignore_errors=True)
    for r, result in enumerate(per_rank):
        for v, norms in enumerate(result["grad_norm"]):
            if norms != result["grad_norm"][0]:
                raise SystemExit(f"rank {r}: warm-up {warmups[v]} gave other grad norms than the "
                                 f"standard schedule ({norms[:3]} vs {result['grad_norm'][0][:3]})")
    stage_s = [r["stage_s"] for r in per_rank]
    predicted_ms = [1000 * simulate_pipeline(stage_s, args.microbatches, w, args.rate_mbit)
                    for w in warmups]
    wall_ms = [[1000 * max(pair) for pair in zip(per_rank[0]["wall_s"][v], per_rank[1]["wall_s"][v])
                ][WARMUP:] for v in range(len(warmups))]
    variants = []
    for v, w in enumerate(warmups):
        paired = [x / s for x, s in zip(wall_ms[v], wall_ms[0])]
        saved = [s - x for x, s in zip(wall_ms[v], wall_ms[0])]
        variants.append({"warmup_stage0": w, "wall_ms": wall_ms[v],
                         "median_ms": statistics.median(wall_ms[v]),
                         "quartiles_ms": _quartiles(wall_ms[v]),
                         "paired_ratio_to_standard": statistics.median(paired),
                         "paired_ratio_quartiles": _quartiles(paired),
                         "paired_saving_ms": statistics.median(saved),
                         "simulated_pipeline_ms": predicted_ms[v],
                         "simulated_ratio_to_standard": predicted_ms[v] / predicted_ms[0],
                         "simulated_saving_ms": predicted_ms[0] - predicted_ms[v]})
    return {"link": {"shaping": "tbf" if args.rate_mbit > 0 else "none",
                     "rate_mbit": args.rate_mbit, "queue_ms": args.queue_ms,
                     "activation_transfer_ms": (MICRO_BATCH_SIZE * MODEL["seq_length"]
                                                * MODEL["hidden_size"] * 4 * 8
                                                / (args.rate_mbit * 1e3) if args.rate_mbit
                                                else 0.0)},
            "model": MODEL, "micro_batch_size": MICRO_BATCH_SIZE,
            "num_microbatches": args.microbatches, "iters": args.iters, "dropped": WARMUP,
            "activation_bytes": MICRO_BATCH_SIZE * MODEL["seq_length"] * MODEL["hidden_size"] * 4,
            "grad_norms_identical": True,
            "stage_compute_ms": [[1000 * f, 1000 * b] for f, b in stage_s],
            "variants": variants,
            "load_average_1min": {"before": load_before, "after": os.getloadavg()[0]}}


def print_table(result: dict) -> None:
    link = result["link"]
    stage_ms = ", ".join(f"stage {s}: {f:.1f} + {b:.1f}"
                         for s, (f, b) in enumerate(result["stage_compute_ms"]))
    print(f"2-stage pipeline, {result['num_microbatches']} micro-batches, "
          f"{result['activation_bytes'] / 1024:.0f} KiB per activation; link: "
          f"{link['shaping']}, rate {link['rate_mbit']} Mbit/s "
          f"({link['activation_transfer_ms']:.1f} ms per activation at that rate); "
          f"load average {result['load_average_1min']}")
    print(f"measured compute per micro-batch (forward + backward ms): {stage_ms}; simulated = "
          "cost_model.simulate_1f1b of the schedule alone (no all-reduce, no optimizer step)")
    print("saved = the standard variant's time minus this one's (measured: median of the paired "
          "differences; simulated: of the schedule alone)")
    print(f"{'warm-up s0':>10} {'median ms':>10} {'IQR ms':>17} {'paired ratio':>13} {'IQR':>13} "
          f"{'saved ms':>9} {'simulated ms':>13} {'sim. ratio':>11} {'sim. saved':>11}")
    for v in result["variants"]:
        q = v["quartiles_ms"]
        r = v["paired_ratio_quartiles"]
        print(f"{v['warmup_stage0']:>10} {v['median_ms']:>10.1f} {q[0]:>8.1f}-{q[2]:<8.1f} "
              f"{v['paired_ratio_to_standard']:>13.3f} {r[0]:>6.3f}-{r[2]:<6.3f} "
              f"{v['paired_saving_ms']:>9.1f} {v['simulated_pipeline_ms']:>13.1f} "
              f"{v['simulated_ratio_to_standard']:>11.3f} {v['simulated_saving_ms']:>11.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--rate-mbit", type=float, default=20.0)
    parser.add_argument("--queue-ms", type=float, default=20.0,
                        help="longest a packet may wait in the shaped link's queue")
    parser.add_argument("--warmups", default="1,2,4,8",
                        help="stage-0 warm-up depths; the first must be the standard 1")
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--json", default=str(ROOT / "bench-out" / "bench_hapt.json"),
                        help="where to write the results (default bench-out/, gitignored)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--data-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        raise SystemExit("needs root and iproute2 (ip, tc) to build the shaped link")
    result = run(args)
    print_table(result)
    write_json(result, args.json)


if __name__ == "__main__":
    main()
