"""megatron-core's kernel fusions that need neither Apex nor Transformer Engine, on CUDA GPUs.

Public API
----------
``JIT_FUSIONS``
    The TransformerConfig fields: ``bias_activation_fusion`` (the MLP's bias add and its GELU or
    SwiGLU in one kernel) and ``bias_dropout_fusion`` (bias add, dropout and residual add after
    the attention and after the MLP, in one kernel).
``MEGATRON_LM_DEFAULTS``
    Both requested, as Megatron-LM's flags default (``autohet train``'s ``TrainOptions`` too).
``jit_fusion_problem() -> str | None``
    Why this process cannot run them (no CUDA device, no Triton, ``torch.compile`` failing on a
    probe), None when it can. Computed once per process.
``local_jit_fusions(requested) -> JitFusions``
    What this process alone can run of ``requested`` (field -> wanted): the profiler's choice (it
    measures one process's layer).
``agree_jit_fusions(requested, device) -> JitFusions``
    Collective over the default group: the fields a job's stage models are built with. A requested
    fusion is on where every rank can run it; otherwise off on every rank.
``priced_on_other_fusions(priced, trained) -> str | None``
    Why a plan priced on a profile whose layers ran the fusions ``priced`` (the profile's record;
    None: not recorded) predicts another layer than ``trained``; None when they agree.

Design (why)
------------
* Megatron-LM fuses both by default on GPUs (``--no-bias-gelu-fusion``, ``--no-bias-swiglu-fusion``
  and ``--no-bias-dropout-fusion`` turn them off); the runtime follows, and ``autohet train``
  and ``autohet profile`` take the same flags. Unfused, each elementwise op of the MLP and of the
  residual path reads and writes a [tokens, hidden] (or [tokens, ffn]) tensor in device memory
  on its own: for GPT-3 1.3B at seq 2048 that traffic is estimated at about a seventh of an
  H100's iteration time.
  megatron-core compiles the fused functions with its ``jit_fuser``, ``torch.compile`` (Triton
  kernels on a GPU, built on first use: Triton and a C compiler must be there at run time). A
  probe compiles a two-op function on the device once, so a machine where that fails trains
  unfused, saying why in one line, instead of failing in its first micro-batch.
* Numerics: megatron-core's fused GELU is the tanh approximation (``fusions/fused_bias_gelu.py``),
  as Megatron-LM trains GPT by default; the unfused MLP computes torch's exact GELU. One job runs
  one of them on every rank (``agree_jit_fusions``), so replicas compute the same function, and a
  checkpoint loads either way. CPU runs - the proofs against the single-process reference -
  never fuse (the fused functions compute the same as the unfused path with the tanh GELU:
  tests/runtime/test_fusions.py).
* The profiler builds its layer with the same fields (profiling/measure.py), so a profile prices
  the layer the runtime trains.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from megatron_autohet.runtime.cpu_mode import cpu_mode_enabled

logger = logging.getLogger(__name__)

JIT_FUSIONS = ("bias_activation_fusion", "bias_dropout_fusion")
MEGATRON_LM_DEFAULTS = dict.fromkeys(JIT_FUSIONS, True)
NO_CUDA = "no CUDA device"        # nothing to say: a CPU run never fuses


@dataclass(frozen=True)
class JitFusions:
    """The TransformerConfig fields a job builds with (``config_fields()``: the overrides) and why
    the requested ones are off (None: each is as requested)."""

    bias_activation_fusion: bool = False
    bias_dropout_fusion: bool = False
    off_because: str | None = None

    def config_fields(self) -> dict[str, bool]:
        return {k: v for k, v in asdict(self).items() if k in JIT_FUSIONS}

    def describe(self) -> str:
        """What a job's log says (one line)."""
        on = [name for name, field in (("bias + activation", "bias_activation_fusion"),
                                       ("bias + dropout + residual add", "bias_dropout_fusion"))
              if getattr(self, field)]
        text = ("fused " + ", ".join(on) + " (megatron-core's, torch.compile)") if on else \
            "no kernel fusions"
        return text + (f"; fusions off: {self.off_because}" if self.off_because else "")


@functools.cache
def jit_fusion_problem() -> str | None:
    if cpu_mode_enabled() or not torch.cuda.is_available():
        return NO_CUDA
    if importlib.util.find_spec("triton") is None:      # torch.compile's GPU code generator
        return "Triton is not installed"
    try:
        probe = torch.compile(lambda x: torch.tanh(x) * x + 1)
        probe(torch.ones(8, device=torch.cuda.current_device()))
    except Exception as exc:  # noqa: BLE001 - what torch.compile raises depends on the failure
        return f"torch.compile failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return None


def local_jit_fusions(requested: dict[str, bool]) -> JitFusions:
    wanted = {field: bool(requested.get(field)) for field in JIT_FUSIONS}
    if not any(wanted.values()):
        return JitFusions()
    problem = jit_fusion_problem()
    return JitFusions(off_because=problem) if problem else JitFusions(**wanted)


def agree_jit_fusions(requested: dict[str, bool], device) -> JitFusions:
    """``requested``: field -> wanted (JIT_FUSIONS); ``device``: where the default group's
    tensors live (CUDA for NCCL). Collective: every rank of the default group calls it."""
    mine = local_jit_fusions(requested)
    able = torch.tensor([0 if mine.off_because else 1], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(able) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, able)
    unable = [rank for rank, flag in enumerate(torch.cat(gathered).tolist()) if not flag]
    if not unable:
        return mine
    if mine.off_because not in (None, NO_CUDA):
        logger.warning("rank %d cannot run megatron-core's fused kernels: %s", dist.get_rank(),
                       mine.off_because)
    why = mine.off_because if len(unable) == dist.get_world_size() else \
        f"ranks {unable} cannot run them ({mine.off_because or 'see their log'})"
    return JitFusions(off_because=why)


def priced_on_other_fusions(priced: dict[str, bool] | None, trained: JitFusions) -> str | None:
    if priced is None:
        return None
    measured = JitFusions(**{field: bool(priced.get(field)) for field in JIT_FUSIONS})
    if measured.config_fields() == trained.config_fields():
        return None
    runs = JitFusions(**trained.config_fields()).describe() + (
        f" ({trained.off_because})" if trained.off_because else "")
    return (f"the plan's predicted times are for other layers: its profile measured "
            f"{measured.describe()}, this job runs {runs}; profile with this job's "
            "--no-bias-*-fusion flags on a machine like this one, then plan again")
