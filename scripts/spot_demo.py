#!/usr/bin/env python
"""A preemption on an emulated spot fleet, start to finish (the last part of the quick start).

Four one-GPU nodes of three types (configs/clusters/spot-4.yaml) run as local processes, each its
own `autohet node` (torchrun agent), `autohet watch` and checkpoint directory. They train the
tiny GPT; at iteration ``--preempt-at`` node2 gets a preemption notice (SIGTERM to its watcher,
as Kubernetes sends it). The job saves the iteration it just finished, copies node2's files to
the other nodes, lets node2 go, re-plans for the three that are left, recovers and trains on.
Then it prints what happened: the job's events, the bytes each tier served, and the losses
around the preemption.

    python scripts/spot_demo.py --out quickstart-out/spot
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "configs/models/tiny.yaml"
CLUSTER = ROOT / "configs/clusters/spot-4.yaml"
GPUS = {"node0": "A100-80GB", "node1": "A100-80GB", "node2": "H800", "node3": "H20"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="quickstart-out/spot", help="work directory (replaced)")
    parser.add_argument("--iters", type=int, default=24, help="training iterations (default 24)")
    parser.add_argument("--save-interval", type=int, default=5,
                        help="periodic checkpoints (default every 5 iterations)")
    parser.add_argument("--preempt-at", type=int, default=8,
                        help="send node2 its notice once this iteration is logged (default 8)")
    args = parser.parse_args()

    from megatron_autohet.testing.emulate import EmulatedFleet

    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    plan = out / "plan.yaml"
    subprocess.run([sys.executable, "-m", "megatron_autohet.cli.main", "plan", "--cluster",
                    str(CLUSTER), "--model", str(MODEL), "--global-batch-size", "8",
                    "--micro-batch-size", "1", "-o", str(plan)], check=True,
                   stdout=subprocess.DEVNULL)
    fleet = EmulatedFleet(out / "job", train_args=[
        "--plan", str(plan), "--model", str(MODEL), "--cluster", str(CLUSTER),
        "--iters", str(args.iters), "--save-interval", str(args.save_interval)])
    print(f"> 4 emulated nodes ({', '.join(f'{n}: {g}' for n, g in GPUS.items())}) train the "
          f"tiny GPT for {args.iters} iterations; logs in {fleet.workdir}")
    start = time.time()
    with fleet:
        for node, gpu in GPUS.items():
            fleet.add(node, gpu)
        fleet.wait_for(lambda: fleet.iteration() >= args.preempt_at, timeout=600,
                       what=f"iteration {args.preempt_at}")
        print(f"> iteration {fleet.iteration()}: preemption notice for node2")
        left = fleet.preempt("node2")
        print("> node2 " + ("left" if left else "did not leave before its deadline")
              + "; the others re-plan, recover and go on")
        codes = fleet.wait_all(timeout=900)
    if any(codes.values()):
        print(f"! a node failed: {codes}; see {fleet.workdir}/<node>.log")
        return 1

    print("\nwhat happened (the job's events, seconds since start):")
    for event in fleet.events():
        detail = {k: v for k, v in event.items() if k not in ("event", "time_unix", "nodes")}
        print(f"  {event['time_unix'] - start:7.1f}  {event['event']:<16} {_short(detail)}")
    stop = fleet.events("stop")[0]
    recovery = fleet.events("recovery")[0]
    mib = {tier: b / 2**20 for tier, b in recovery["bytes"].items()}
    print(f"\nrecovered iteration {recovery['iteration']} (the notice came after iteration "
          f"{stop['iteration']}: {stop['iteration'] - recovery['iteration']} iterations lost): "
          f"own disks {mib['own']:.1f} MiB, peers {mib['peer']:.1f} MiB, S3 {mib['s3']:.1f} MiB")
    by_iteration = {r["iteration"]: r for r in fleet.metrics()}
    it = stop["iteration"]
    for i in (it - 1, it, it + 1, it + 2):
        if i in by_iteration:
            print(f"  iteration {i:3d}: lm loss {by_iteration[i]['lm_loss']:.6f}"
                  + ("   <- notice" if i == it else "   <- after the re-plan" if i == it + 1
                     else ""))
    last = by_iteration[max(by_iteration)]
    print(f"  iteration {last['iteration']:3d}: lm loss {last['lm_loss']:.6f} (end)")
    return 0


def _short(detail: dict) -> str:
    text = ", ".join(f"{k}={v}" for k, v in detail.items() if not isinstance(v, dict))
    return text if len(text) < 110 else text[:107] + "..."


if __name__ == "__main__":
    sys.exit(main())
