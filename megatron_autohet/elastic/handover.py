"""Moving checkpoint files from nodes that will not train to nodes that will.

Recovery (checkpoint/recovery.py) reads from the disks of the ranks that train, and a chunk with
no data-parallel copy has one holder. Two moments leave such chunks on a node that will not
train, and both move them first, so recovery finds them on a peer's disk instead of downloading
them from S3 - or losing them:

* a node with a preemption notice, right after the emergency save (:func:`move_files` on a gloo
  group of the training ranks): its files of that step go to the nodes that stay, each one
  that can arrive before the notice's deadline (checkpoint/deadline.py; what cannot is left to
  the S3 upload after it, elastic/worker.py);
* a re-plan that leaves a whole node idle (:func:`hand_over`, every worker of the job on one
  short-lived group before the training group exists).

:func:`transfers` is the pure plan: each file of the newest step that no receiving node holds is
sent once, to the receiving node that got the fewest bytes so far. One worker per node (the one
on its first GPU) speaks for the node's disk. Received files are written atomically; a receiver
without the step gets its small files and manifest too and commits it. Recovery verifies every
chunk's checksum as usual, so nothing here is trusted blindly.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from megatron_autohet.checkpoint.deadline import Deadline, Throughput
from megatron_autohet.checkpoint.manifest import (MANIFEST_FILE, commit_step_dir,
                                                  committed_steps, partial_dir, read_manifest,
                                                  step_dir_name, write_atomic)

_CHUNK = 64 << 20          # bytes per message: a file is sent in pieces of at most this size


@dataclass(frozen=True)
class NodeDisk:
    """What one node's disk holds of its newest steps: iteration -> {file name: size}."""
    rank: int                       # the rank that speaks for the node in the handover group
    receives: bool                  # the node trains next (it receives, the others send)
    steps: dict[int, dict[str, int]]


@dataclass(frozen=True)
class Transfer:
    src: int
    dst: int
    iteration: int
    name: str
    size: int


def transfers(disks: list[NodeDisk]) -> list[Transfer]:
    """The files of the newest step that only sending nodes hold, each sent once to a receiving
    node; when no receiving node has the step at all, the first one gets all of its files (small
    files and manifest included)."""
    every = [it for disk in disks for it in disk.steps]
    if not every:
        return []
    iteration = max(every)
    trainers = [d for d in disks if d.receives]
    holders = [d for d in disks if iteration in d.steps]
    if not trainers or not holders:
        return []
    with_step = [d for d in trainers if iteration in d.steps]
    receivers = with_step or trainers[:1]
    received = {d.rank: 0 for d in receivers}
    out: list[Transfer] = []
    names: dict[str, int] = {}
    for disk in holders:
        for name, size in disk.steps[iteration].items():
            names.setdefault(name, size)
    for name, size in sorted(names.items()):
        if any(name in d.steps.get(iteration, {}) for d in trainers):
            continue
        if with_step and not name.endswith(".distcp"):
            continue                # the small files and manifest are on every receiver
        src = next(d for d in holders if name in d.steps[iteration])
        dst = min(received, key=lambda r: (received[r], r))
        received[dst] += size
        out.append(Transfer(src.rank, dst, iteration, name, size))
    return out


def node_disk(root: Path | None, rank: int, receives: bool, newest: int = 2) -> NodeDisk:
    """This node's newest committed steps under ``root`` and their files (sizes as on disk)."""
    steps: dict[int, dict[str, int]] = {}
    if root is not None:
        for iteration in committed_steps(root)[-newest:]:
            step = root / step_dir_name(iteration)
            try:
                manifest = read_manifest(step)
            except ValueError:
                continue
            files = {name: rec.size for name, rec in manifest.files.items()
                     if (step / name).is_file() and (step / name).stat().st_size == rec.size}
            files[MANIFEST_FILE] = (step / MANIFEST_FILE).stat().st_size
            steps[iteration] = files
    return NodeDisk(rank, receives, steps)


@dataclass(frozen=True)
class Moved:
    bytes: int                      # sent, all nodes together
    skipped: list[Transfer]         # not started: they could not end before the deadline


def move_files(root: Path | None, *, rank: int, speaks_for_node: bool, receives: bool,
               group, deadline: Deadline | None = None) -> Moved:
    """A collective over ``group``, a gloo group whose ranks are the global ranks (the bytes
    travel as CPU tensors, which NCCL - the default group on GPUs - refuses): nodes that do not
    ``receive`` send the files of the newest step that no receiving node holds to receiving
    nodes. With ``deadline`` (a notice's) a sender does not start a file that cannot end
    before it, by the bandwidth its sends measured so far; every rank learns what was
    skipped."""
    # torch: on first use, not with this module
    import torch
    import torch.distributed as dist

    world_size = dist.get_world_size(group)
    mine = node_disk(root, rank, receives) if speaks_for_node else None
    disks: list = [None] * world_size
    dist.all_gather_object(disks, mine, group=group)
    plan = transfers([d for d in disks if d is not None])
    staged: dict[int, Path] = {}
    meter, skipped = Throughput(), []
    for t in plan:
        # One integer first: whether the file follows (the receiver cannot tell otherwise).
        go = torch.ones(1, dtype=torch.int64)
        if rank == t.src:
            go[0] = deadline is None or deadline.fits(t.size, meter.rate)
            dist.send(go, dst=t.dst, group=group)
            if not go[0]:
                skipped.append(t)
                continue
            start = time.monotonic()
            data = (root / step_dir_name(t.iteration) / t.name).read_bytes()
            for offset in range(0, max(len(data), 1), _CHUNK):
                piece = torch.frombuffer(bytearray(data[offset:offset + _CHUNK])
                                         or bytearray(1), dtype=torch.uint8)
                dist.send(piece, dst=t.dst, group=group)
            meter.add(t.size, time.monotonic() - start)
        elif rank == t.dst:
            dist.recv(go, src=t.src, group=group)
            if not go[0]:
                continue
            buf = bytearray()
            for offset in range(0, max(t.size, 1), _CHUNK):
                piece = torch.empty(max(min(_CHUNK, t.size - offset), 1), dtype=torch.uint8)
                dist.recv(piece, src=t.src, group=group)
                buf += piece.numpy().tobytes()[:max(0, t.size - offset)]
            step = root / step_dir_name(t.iteration)
            if not (step / MANIFEST_FILE).is_file():
                step = staged.setdefault(t.iteration, partial_dir(root, t.iteration))
                step.mkdir(parents=True, exist_ok=True)
            write_atomic(step / t.name, bytes(buf))
    for iteration, step in staged.items():
        if (step / MANIFEST_FILE).is_file():
            commit_step_dir(root, iteration)
        else:               # the manifest was skipped: without it the files are no step
            shutil.rmtree(step)
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, skipped, group=group)
    skipped = [t for rank_skipped in everyone for t in rank_skipped]
    return Moved(sum(t.size for t in plan) - sum(t.size for t in skipped), skipped)


def hand_over(store, *, rank: int, world_size: int, speaks_for_node: bool, training: bool,
              root: Path | None, timeout: timedelta) -> int:
    """:func:`move_files` from idle to training nodes, on a gloo group of every worker of the
    job (made from the workers' store, before the training group exists)."""
    # torch: on first use, not with this module
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.PrefixStore("autohet/handover/", store),
                            rank=rank, world_size=world_size, timeout=timeout)
    try:
        return move_files(root, rank=rank, speaks_for_node=speaks_for_node, receives=training,
                          group=dist.group.WORLD).bytes
    finally:
        dist.destroy_process_group()
