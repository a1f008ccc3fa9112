"""The CUDA device of a process: which GPU, the same GPU in its background threads, and its memory
between the generations of an elastic job.

torchrun's ``LOCAL_RANK`` counts the processes of a node; it is a device index only when every
process sees all of the node's GPUs. With one GPU per task (Slurm ``--gpus-per-task=1``, a
Kubernetes pod per GPU, any ``CUDA_VISIBLE_DEVICES`` per process) a process sees one GPU,
device 0, whatever its ``LOCAL_RANK``, and ``set_device(LOCAL_RANK)`` fails with "invalid
device ordinal". So the device is ``LOCAL_RANK`` modulo the GPUs the process sees
(:func:`device_index`), which is ``LOCAL_RANK`` itself when it sees them all.

A process that trains one plan after another (an elastic job's in-process re-plan) drops the
old generation's objects, then :func:`free_memory` collects what reference cycles still hold
and hands CUDA's cached blocks back, before the next generation's communicators and model.

CUDA's current device is per thread, and a new thread starts on device 0: a background thread
that touches CUDA (the checkpoint writer, recovery's loader) enters the device of the thread
that made it (:func:`thread_device` there, :func:`enter_device` in the thread), or its
allocations land on GPU 0 and its copies cross devices.
"""

from __future__ import annotations

import gc

import torch

from megatron_autohet.runtime.cpu_mode import cpu_mode_enabled


def device_index(local_rank: int, visible_gpus: int) -> int:
    """The index, among the GPUs this process sees, of the GPU of local rank ``local_rank``."""
    if visible_gpus < 1:
        raise ValueError(f"no visible GPU for local rank {local_rank}")
    if local_rank < 0:
        raise ValueError(f"local rank {local_rank} < 0")
    return local_rank % visible_gpus


def select_device(local_rank: int) -> int:
    """Make this process's GPU the current device (before its process group); its index."""
    index = device_index(local_rank, torch.cuda.device_count())
    torch.cuda.set_device(index)
    return index


def thread_device() -> int | None:
    """The calling thread's CUDA device, for a background thread it starts to enter; None when
    the process trains on the CPU."""
    if cpu_mode_enabled() or not torch.cuda.is_available():
        return None
    return torch.cuda.current_device()


def enter_device(device: int | None) -> None:
    """In a background thread: make ``device`` (:func:`thread_device`) current; None: nothing."""
    if device is not None:
        torch.cuda.set_device(device)


def free_memory() -> None:
    """After dropping a generation's trainer: collect the reference cycles that may still hold
    its tensors (an exception's traceback frames, hooks that point back at their module), and
    on a GPU release the allocator's cached blocks (NCCL's buffers of the next process group
    are allocated outside the cache)."""
    gc.collect()
    if torch.cuda.is_available() and not cpu_mode_enabled():
        torch.cuda.empty_cache()
