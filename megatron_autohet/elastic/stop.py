"""Stopping a job cleanly between iterations: on a signal or a preemption notice.

Megatron-LM's ``--exit-signal-handler`` semantics, extended to spot notices. A rank that
receives SIGTERM (torchrun stopping its workers for a restart, Kubernetes, Slurm's ``--signal``)
or finds its node's notice file (written by ``autohet watch``) does not stop on its own: after
every iteration all ranks reduce their flags, so they stop after the same iteration, save it, and
exit. A rebalance notice (an early warning) only asks for a checkpoint of the current iteration;
training goes on. A stop for a notice carries the earliest deadline of the leaving nodes' notices
(None when none says one): it bounds what the job does before they go (elastic/worker.py).

``StopRequests.check()`` is one small all-reduce per iteration on the process group it is given:
the job's :func:`stop_group`, a gloo group of its own. Of its own because with ``--async-save``
the checkpoint writer runs collectives on the checkpointer's group in a background thread, and
two threads' collectives on one group pair up in a different order on different ranks (a
mismatch or a hang, for as long as a write lasts); gloo because the flags are CPU tensors, which
NCCL - the default group on GPUs - refuses.
"""

from __future__ import annotations

import math
import signal
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_autohet.elastic.notices import read_notice

SAVE, STOP = "save", "stop"


@dataclass
class StopDecision:
    iteration: int
    signalled: bool           # some rank got a signal
    leaving: bool             # THIS rank's node has a preemption notice
    deadline_unix: float | None = None    # the earliest notice deadline of the leaving nodes


def stop_group(timeout: timedelta):
    """The stop check's gloo group of every rank of the default group. A collective call: every
    rank makes it at the same point (right after the job's Checkpointer, or where that would
    be)."""
    return dist.new_group(backend="gloo", timeout=timeout)


class StopRequests:
    def __init__(self, group, *, notice_file: str | Path | None,
                 signals: tuple[int, ...] = (signal.SIGTERM,)):
        if group is None:       # the default group: NCCL on GPUs, which refuses the CPU flags
            raise ValueError("StopRequests needs a gloo group of its own (stop_group)")
        self.group = group
        self.notice_file = Path(notice_file) if notice_file else None
        self.signal_received: int | None = None
        self.decision: StopDecision | None = None
        self._rebalance_seen: float | None = None
        self._deadline: float | None = None       # of this node's preempt notice
        for sig in signals:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.signal_received = signum

    def _notice(self) -> tuple[bool, bool]:
        """(preempt notice on this node, rebalance notice not yet acted on)."""
        if self.notice_file is None or not self.notice_file.exists():
            return False, False
        notice = read_notice(self.notice_file)
        if notice is None:
            return False, False
        if notice.kind == "preempt":
            self._deadline = notice.deadline_unix
            return True, False
        fresh = notice.received_unix != self._rebalance_seen
        self._rebalance_seen = notice.received_unix
        return False, fresh

    def check(self, iteration: int) -> str | None:
        """After ``iteration``: STOP, SAVE or None, the same on every rank of the group."""
        preempt, rebalance = self._notice()
        flags = torch.tensor([self.signal_received is not None, preempt, rebalance],
                             dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        signalled, any_preempt, any_rebalance = (bool(v) for v in flags.tolist())
        if signalled or any_preempt:
            # Once per job: the earliest deadline (inf: this rank knows none).
            deadline = torch.tensor([self._deadline if preempt and self._deadline is not None
                                     else math.inf], dtype=torch.float64)
            dist.all_reduce(deadline, op=dist.ReduceOp.MIN, group=self.group)
            self.decision = StopDecision(iteration, signalled, preempt,
                                         None if math.isinf(deadline.item()) else deadline.item())
            return STOP
        if any_rebalance:
            return SAVE
        return None
