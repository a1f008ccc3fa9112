"""The training thread's stall while a save copies its state to host memory, per GB.

checkpoint/state.py ``snapshot`` is what a save blocks training for before the write (in the
background with --async-save) starts. This times it over tensors like a stage's state (many
weight-sized tensors, fp32 and bf16):

* on CUDA: pageable host copies (a fresh host tensor per save, the copy without
  ``SnapshotBuffers``), the first pinned save (pins its buffers) and the next pinned saves
  (reuse them: what every save after a job's first pays);
* on the CPU: the clone (a CPU job's state is live, so it is copied).

    .venv/bin/python scripts/bench_snapshot.py --gb 1 --repeats 3

prints a table (GB, seconds, GB/s per mode; the best of ``--repeats``) and writes
bench-out/bench_snapshot.json.
"""

from __future__ import annotations

import argparse
import time

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor

from _bench import write_json
from megatron_autohet.checkpoint.state import SnapshotBuffers, snapshot

TENSOR_MIB = 64          # about one weight matrix of a 2-4k hidden model


def stage_state(gb: float, device: torch.device) -> list[torch.Tensor]:
    """Tensors of ``gb`` GB in all: fp32 (masters, moments, gradients) and bf16 (weights)."""
    tensors, left = [], int(gb * 1e9)
    while left > 0:
        dtype = torch.bfloat16 if len(tensors) % 4 == 0 else torch.float32
        numel = min(TENSOR_MIB * 2**20, left) // (torch.finfo(dtype).bits // 8)
        tensors.append(torch.randn(max(numel, 1), device=device).to(dtype))
        left -= tensors[-1].numel() * tensors[-1].element_size()
    return tensors


def state_dict_of(tensors: list[torch.Tensor]) -> dict:
    """A fresh sharded state dict over the live tensors, as each save builds one."""
    return {f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", t, replica_id=0)
            for i, t in enumerate(tensors)}


def timed_snapshot(tensors, buffers: SnapshotBuffers | None) -> float:
    if tensors[0].is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    snapshot(state_dict_of(tensors), buffers)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.0, help="state size in GB (1e9 bytes)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default="bench-out/bench_snapshot.json")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    tensors = stage_state(args.gb, device)
    gb = sum(t.numel() * t.element_size() for t in tensors) / 1e9
    rows = {}
    if cuda:
        rows["pageable"] = min(timed_snapshot(tensors, None) for _ in range(args.repeats))
        buffers = SnapshotBuffers()
        rows["pinned, first save"] = timed_snapshot(tensors, buffers)
        rows["pinned, reused"] = min(timed_snapshot(tensors, buffers)
                                     for _ in range(args.repeats))
    else:
        rows["clone (CPU)"] = min(timed_snapshot(tensors, None) for _ in range(args.repeats))
    name = torch.cuda.get_device_name() if cuda else "CPU"
    print(f"snapshot of {gb:.2f} GB in {len(tensors)} tensors on {name} "
          f"(best of {args.repeats})")
    print(f"{'mode':<20} {'GB':>6} {'seconds':>8} {'GB/s':>7} {'s/GB':>7}")
    for mode, seconds in rows.items():
        print(f"{mode:<20} {gb:>6.2f} {seconds:>8.3f} {gb / seconds:>7.2f} {seconds / gb:>7.3f}")
    write_json({"device": name, "gb": gb, "tensors": len(tensors), "repeats": args.repeats,
                "modes": {mode: {"seconds": s, "gb_per_s": gb / s, "stall_s_per_gb": s / gb}
                          for mode, s in rows.items()}}, args.json)


if __name__ == "__main__":
    main()
