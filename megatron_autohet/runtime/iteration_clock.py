"""Where one rank's iterations go, measured in the run at no cost to it.

Every iteration of :class:`~megatron_autohet.runtime.trainer.HeteroTrainer` is cut into four
phases: ``compute`` (forward and backward of the rank's micro-batches: the schedule less its P2P
waits), ``p2p_wait`` (blocked on receives from the neighbouring stages and on its sends' ends),
``grad_sync`` (the layer-wise gradient sync and the global loss / norm reduction) and
``optimizer`` (clipping, the AdamW step, the weights written back from the masters).

No synchronisation is added to the hot path. On a CPU the phases are host clock readings
(``time.perf_counter``; gloo's waits block the host, so a wait is what the host spent in it). On
CUDA each boundary records an event on the current stream and each P2P wait a pair around it
(NCCL's ``wait`` makes the stream wait, so the pair spans the stream's blocked time); the events of
an iteration are read at the end of the next one, when the host has synchronised with the stream
anyway (the loss reduction's ``tolist``), so :meth:`IterationClock.lap` returns the previous
iteration's times there and the current one's on a CPU.

``IterationClock(device)``: ``begin()`` at an iteration's start, ``phase_done(name)`` after the
schedule, the gradient sync and the optimizer step, ``p2p_wait()`` (a context manager) around
each blocking P2P wait inside the schedule, then ``lap() -> IterationTimes | None``.
``IterationTimes``: one iteration's seconds per phase (``<phase>_s`` for each of
runtime/stage_drift.py's ``PHASES``), ``total_s``.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

# The boundaries an iteration marks after its start, in order; compute is the schedule's span
# less the P2P waits inside it.
_BOUNDARIES = ("schedule", "grad_sync", "optimizer")


@dataclass(frozen=True)
class IterationTimes:
    compute_s: float
    p2p_wait_s: float
    grad_sync_s: float
    optimizer_s: float

    @property
    def total_s(self) -> float:
        return self.compute_s + self.p2p_wait_s + self.grad_sync_s + self.optimizer_s


def _times(marks: dict[str, float], waits: float) -> IterationTimes:
    """From seconds since the iteration's start at each boundary and the P2P waits' sum."""
    schedule = marks["schedule"]
    return IterationTimes(compute_s=max(0.0, schedule - waits), p2p_wait_s=waits,
                          grad_sync_s=marks["grad_sync"] - schedule,
                          optimizer_s=marks["optimizer"] - marks["grad_sync"])


class IterationClock:
    """One rank's phase clock (module doc)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._start = None
        self._marks: dict = {}
        self._waits: list = []          # CPU: seconds; CUDA: (start event, end event) pairs
        self._pending = None            # CUDA: the last iteration's events, read one lap late

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def begin(self) -> None:
        self._start, self._marks, self._waits = self._now(), {}, []

    def phase_done(self, boundary: str) -> None:
        self._marks[boundary] = self._now()

    @contextmanager
    def p2p_wait(self):
        if self._start is None:          # outside a timed iteration (evaluation)
            yield
            return
        start = self._now()
        try:
            yield
        finally:
            end = self._now()
            self._waits.append(end - start if not self.cuda else (start, end))

    def lap(self) -> IterationTimes | None:
        """The times of the iteration just ended (a CPU) or of the one before it (CUDA; None
        after the first); ends the timed iteration."""
        if set(self._marks) != set(_BOUNDARIES):
            raise RuntimeError(f"an iteration marked {sorted(self._marks)}, not {_BOUNDARIES}")
        start, marks, waits = self._start, self._marks, self._waits
        self._start, self._marks, self._waits = None, {}, []
        if not self.cuda:
            return _times({b: marks[b] - start for b in _BOUNDARIES}, sum(waits))
        previous, self._pending = self._pending, (start, marks, waits)
        if previous is None:
            return None
        start, marks, waits = previous
        marks["optimizer"].synchronize()        # done long ago: the host synced since
        return _times({b: start.elapsed_time(marks[b]) / 1e3 for b in _BOUNDARIES},
                      sum(a.elapsed_time(b) for a, b in waits) / 1e3)
