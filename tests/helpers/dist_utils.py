"""Run a test function on N gloo processes and collect what each returns.

Public API
----------
``run_on_ranks(world_size, fn, *args, timeout=120, **kwargs) -> list``
    Starts ``world_size`` processes; in each, initialises ``torch.distributed`` (gloo, a free
    local port), enables the runtime's CPU mode when the machine has no GPU, and calls
    ``fn(rank, world_size, *args, **kwargs)``. Returns the results in rank order (they must be
    picklable). If a process raises, the others are stopped and a ``RankFailed`` carrying the
    formatted traceback of every failed child is raised here; a process that hangs past ``timeout``
    seconds of :class:`LoadClock` (e.g. a collective whose peer died) fails the same way instead
    of hanging the test suite.
``LoadClock()``: ``.seconds()`` since it was made, wall time scaled down by the load (below).

Design: processes are forked, not spawned, so children inherit the already-imported torch and
megatron-core (imported here, before any fork: an import costs ~5 s per process on 2 cores) and
``fn`` may be any callable, closures included. Each child uses one intra-op thread: N processes
share 2 cores, and oversubscription makes small runs several times slower.

The hang guard counts seconds of an unloaded machine, not wall seconds: a timeout sized for a quiet
machine held on one with two busy processes per core beside the suite too (CI runs on a shared
machine). Between two readings the clock advances by the wall time times the share of the CPUs the
runnable threads leave each (``cores / runnable``, at most 1; /proc/loadavg's instantaneous count,
less the reader itself). A hang still ends: hung ranks wait in a collective and run nothing, so
the clock runs at the rate the rest of the machine leaves (on a quiet one, the wall clock).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import time
import traceback

# Imported before forking so every child inherits them instead of paying ~5 s each on 2 cores.
import megatron.core.distributed
import megatron.core.models.gpt
import megatron.core.optimizer
import megatron.core.pipeline_parallel  # noqa: F401
import torch.distributed  # noqa: F401

from megatron_autohet.system.ports import free_port


class LoadClock:
    """Seconds of an unloaded machine since it was made (module doc); read it often (the load
    of each interval is sampled once, at its end)."""

    def __init__(self):
        self._last = time.monotonic()
        self._seconds = 0.0

    def seconds(self) -> float:
        now = time.monotonic()
        try:
            with open("/proc/loadavg") as f:
                runnable = int(f.read().split()[3].split("/")[0]) - 1
        except (OSError, ValueError, IndexError):       # no /proc: the wall clock
            runnable = 0
        share = min(1.0, (os.cpu_count() or 1) / max(1, runnable))
        self._seconds += (now - self._last) * share
        self._last = now
        return self._seconds


class RankFailed(RuntimeError):
    """A child process raised (or hung); the message holds its traceback."""


def _child(rank, world_size, port, results, fn, args, kwargs):
    try:
        import torch
        torch.set_num_threads(1)
        from megatron_autohet.runtime.cpu_mode import cpu_mode_required, enable_cpu_mode
        if cpu_mode_required():
            enable_cpu_mode()
        torch.distributed.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
        # torch adds no barrier to the init (TORCH_DIST_INIT_BARRIER=0): a rank whose side of
        # gloo's mesh is up may return while a peer still reads its handshake, and an ``fn``
        # that destroys the group at once (tests that make their own groups) closes that
        # socket under it ("connectFullMesh failed ... Connection closed by peer", 13 of 60
        # 4-rank runs at load 7). Every rank starts ``fn`` with the mesh complete everywhere.
        torch.distributed.barrier()
        try:
            value = fn(rank, world_size, *args, **kwargs)
        finally:
            torch.distributed.destroy_process_group()
        # Plain pickle (by value): the queue's ForkingPickler would share tensors through file
        # descriptors that die with this process.
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - report everything, then die
        results.put((rank, False, traceback.format_exc()))
    finally:
        results.close()
        results.join_thread()
        os._exit(0)                                  # skip atexit handlers inherited from pytest


def run_on_ranks(world_size: int, fn, *args, timeout: float = 120, **kwargs) -> list:
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(rank, world_size, port, results, fn, args, kwargs),
                         daemon=True) for rank in range(world_size)]
    for proc in procs:
        proc.start()
    values: dict[int, object] = {}
    failures: dict[int, str] = {}
    clock, start = LoadClock(), time.monotonic()
    deadline = timeout
    try:
        while len(values) + len(failures) < world_size:
            remaining = deadline - clock.seconds()
            if remaining <= 0:
                if failures:
                    break
                missing = sorted(set(range(world_size)) - set(values))
                raise RankFailed(f"ranks {missing} did not finish within {timeout:.0f} s "
                                 f"(of an unloaded machine; {time.monotonic() - start:.0f} s of "
                                 "wall time)")
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in values and r not in failures
                        and not p.is_alive() and p.exitcode not in (0, None)]
                for r in dead:
                    failures[r] = f"died with exit code {procs[r].exitcode} without a result"
                continue
            if ok:
                values[rank] = pickle.loads(value)
            else:
                # The first failure often makes peers fail in collectives ("connection closed by
                # peer"); wait briefly for theirs too so the root cause is in the report.
                failures[rank] = value
                deadline = min(deadline, clock.seconds() + 3.0)
        if failures:
            report = "\n".join(f"--- rank {r} of {world_size}:\n{failures[r]}"
                               for r in sorted(failures))
            raise RankFailed(f"ranks {sorted(failures)} failed:\n{report}")
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return [values[r] for r in range(world_size)]
