"""Each stage's measured times against its plan's predictions, once per window of iterations.

A plan is only as right as the profile it was priced on (an analytic estimate, another machine's
measurement) and a GPU can turn slow in the middle of a run. The job therefore measures itself:
every rank times its phases every iteration (runtime/iteration_clock.py) and every ``window``
iterations (``--autohet-measure-window``, default :data:`DEFAULT_WINDOW`) the ranks' medians
over the window are gathered once: one all-gather of four numbers per rank per window, never a
collective per iteration. The medians make a window robust to a single slow iteration (a
checkpoint save, a garbage collection, the first iteration's warm-up).

A stage's measured time is its compute (forward and backward, P2P waits excluded) per
micro-batch, the slowest of its TP ranks' medians (the group runs in lock step; each rank's own
is kept too, ``StageMeasure.rank_compute_s``, for straggler detection), compared with
the plan's ``predicted_time_s`` (forward + backward of one micro-batch). A stage more than
:data:`DRIFT_THRESHOLD` off it has *drifted*: the job logs one line for it per window (predicted,
measured, ratio) and the window's record names it. Stages of a plan without predictions (a
hand-written plan) are measured and reported, never called drifted.

``WindowMeter(plan, rank, device, window)``: ``add(iteration, times)`` after every iteration;
at every window's end (every rank at the same iteration) it gathers and returns the
:class:`WindowReport`, else None.
``window_report(plan, first, last, medians)``: the report from every rank's phase medians (pure,
no torch).
``WindowReport``: ``stages`` (:class:`StageMeasure`), ``drifted(threshold)``, ``lines()``,
``to_dict()`` (the JSON form a job writes), ``event()`` (the window as an elastic job's ``drift``
event: a message and its JSON fields).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatron_autohet.plan import Plan

if TYPE_CHECKING:
    from megatron_autohet.runtime.iteration_clock import IterationTimes

# The phases of runtime/iteration_clock.py, whose module imports torch: this one does not at
# import (job.py reads DEFAULT_WINDOW at `autohet` start-up).
PHASES = ("compute", "p2p_wait", "grad_sync", "optimizer")

DEFAULT_WINDOW = 20
DRIFT_THRESHOLD = 0.10


@dataclass(frozen=True)
class StageMeasure:
    pipeline: int
    stage: int
    gpu: str
    ranks: tuple[int, ...]
    layers: tuple[int, int]
    num_microbatches: int
    compute_s: float            # per iteration: forward + backward of its micro-batches
    p2p_wait_s: float
    grad_sync_s: float
    optimizer_s: float
    predicted_s: float | None   # the plan's forward + backward of one micro-batch
    # each of its ranks' own compute median per iteration, in ``ranks`` order (the stage's is
    # the slowest; profiling/from_run.py ``find_stragglers`` compares GPUs by them)
    rank_compute_s: tuple[float, ...] = ()
    # the layer range of each of its model chunks (an interleaved pipeline's stage has several;
    # ``layers`` is the first's)
    chunks: tuple[tuple[int, int], ...] = ()

    def layers_label(self) -> str:
        """Its layers, first and last of each chunk (``0-1+4-5``)."""
        return "+".join(f"{start}-{end - 1}" for start, end in self.chunks or (self.layers,))

    @property
    def per_microbatch_s(self) -> float:
        return self.compute_s / self.num_microbatches

    @property
    def ratio(self) -> float | None:
        """Measured over predicted; None without a prediction."""
        if not self.predicted_s:
            return None
        return self.per_microbatch_s / self.predicted_s


@dataclass(frozen=True)
class WindowReport:
    first_iteration: int            # the window: iterations [first, last], both included
    last_iteration: int
    iteration_s: float              # the slowest rank's median iteration
    predicted_iteration_s: float | None
    stages: list[StageMeasure]

    def drifted(self, threshold: float = DRIFT_THRESHOLD) -> list[StageMeasure]:
        return [s for s in self.stages
                if s.ratio is not None and abs(s.ratio - 1) > threshold]

    def lines(self, threshold: float = DRIFT_THRESHOLD) -> list[str]:
        """One line per drifted stage (none when every stage is within ``threshold``)."""
        head = f"iterations {self.first_iteration}-{self.last_iteration}"
        return [f"{head}: pipeline {s.pipeline} stage {s.stage} ({s.gpu} x{len(s.ranks)}, "
                f"layers {s.layers_label()}): forward+backward "
                f"{s.per_microbatch_s:.4g} s per micro-batch measured, {s.predicted_s:.4g} s "
                f"predicted ({s.ratio:.2f}x)" for s in self.drifted(threshold)]

    def to_dict(self, threshold: float = DRIFT_THRESHOLD) -> dict:
        drifted = {(s.pipeline, s.stage) for s in self.drifted(threshold)}
        return {"window": [self.first_iteration, self.last_iteration],
                "iteration_s": round(self.iteration_s, 6),
                "predicted_iteration_s": self.predicted_iteration_s,
                "stages": [{"pipeline": s.pipeline, "stage": s.stage, "gpu": s.gpu,
                            "ranks": list(s.ranks), "layers": list(s.layers),
                            **({"chunks": [list(c) for c in s.chunks]}
                               if len(s.chunks) > 1 else {}),
                            "num_microbatches": s.num_microbatches,
                            **{f"{phase}_s": round(getattr(s, f"{phase}_s"), 6)
                               for phase in PHASES},
                            "per_microbatch_s": round(s.per_microbatch_s, 6),
                            "predicted_s": s.predicted_s,
                            "ratio": None if s.ratio is None else round(s.ratio, 4),
                            "drifted": (s.pipeline, s.stage) in drifted}
                           for s in self.stages]}

    def event(self, threshold: float = DRIFT_THRESHOLD) -> tuple[str, dict]:
        """The window as one event of an elastic job (elastic/events.py ``drift``, every
        window): a message naming each drifted stage and its ratio, and the JSON fields - the
        window, the iteration's measured and predicted seconds and the drifted stages (predicted
        and measured seconds per micro-batch, ratio)."""
        drifted = self.drifted(threshold)
        head = f"iterations {self.first_iteration}-{self.last_iteration}: "
        if drifted:
            message = head + f"{len(drifted)} of {len(self.stages)} stages more than " \
                f"{threshold:.0%} off their predictions: " + ", ".join(
                    f"pipeline {s.pipeline} stage {s.stage} ({s.gpu} x{len(s.ranks)}) "
                    f"{s.ratio:.2f}x" for s in drifted)
        elif any(s.ratio is not None for s in self.stages):
            message = head + f"every stage within {threshold:.0%} of its prediction"
        else:
            message = head + "no stage has a prediction (measured only)"
        return message, {
            "window": [self.first_iteration, self.last_iteration],
            "iteration_s": round(self.iteration_s, 6),
            "predicted_iteration_s": self.predicted_iteration_s,
            "drifted": [{"pipeline": s.pipeline, "stage": s.stage, "gpu": s.gpu,
                         "predicted_s": s.predicted_s,
                         "measured_s": round(s.per_microbatch_s, 6),
                         "ratio": round(s.ratio, 4)} for s in drifted]}


def window_report(plan: Plan, first: int, last: int, medians: list[list[float]]
                  ) -> WindowReport:
    """``medians[rank]``: that rank's median seconds per phase (``PHASES`` order) over the
    window; a stage takes its slowest TP rank's."""
    stages = []
    for p, pipe in enumerate(plan.pipelines):
        for s, stage in enumerate(pipe.stages):
            phase = [max(medians[r][i] for r in stage.ranks) for i in range(len(PHASES))]
            stages.append(StageMeasure(
                pipeline=p, stage=s, gpu=plan.ranks[stage.ranks[0]].gpu,
                ranks=tuple(stage.ranks), layers=tuple(stage.layers),
                num_microbatches=pipe.num_microbatches, compute_s=phase[0], p2p_wait_s=phase[1],
                grad_sync_s=phase[2], optimizer_s=phase[3], predicted_s=stage.predicted_time_s,
                rank_compute_s=tuple(medians[r][0] for r in stage.ranks),
                chunks=stage.chunks))
    return WindowReport(first_iteration=first, last_iteration=last,
                        iteration_s=max(sum(m) for m in medians),
                        predicted_iteration_s=plan.predicted.get("iteration_time_s"),
                        stages=stages)


class WindowMeter:
    """A rank's side of the windows (module doc); every rank of the plan makes one."""

    def __init__(self, plan: Plan, rank: int, device, window: int = DEFAULT_WINDOW):
        self.plan, self.rank, self.device, self.window = plan, rank, device, window
        self._times: list[IterationTimes] = []
        self._first: int | None = None

    def add(self, iteration: int, times: IterationTimes | None) -> WindowReport | None:
        """``times``: the clock's lap after ``iteration`` (None: none yet, CUDA's first)."""
        if self._first is None:
            self._first = iteration
        if times is not None:
            self._times.append(times)
        if iteration % self.window:
            return None
        # torch: in a running job only (module doc: the report is torch-free)
        import torch
        import torch.distributed as dist

        mine = torch.tensor([statistics.median(getattr(t, f"{phase}_s") for t in self._times)
                             if self._times else 0.0 for phase in PHASES],
                            dtype=torch.float64, device=self.device)
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        report = window_report(self.plan, self._first, iteration,
                               [t.tolist() for t in every])
        self._times, self._first = [], None
        return report
