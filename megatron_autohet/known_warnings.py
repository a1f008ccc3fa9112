"""megatron-core's known-benign warnings: the one list, and the filter every process installs.

megatron-core warns at import about every optional fused kernel it cannot find, and its
``TransformerConfig`` warns about its own default. Each process of a job repeats them (seven
warnings, fourteen lines per rank on a CPU), which buries the lines that matter. None of them
says anything about this job, for the reasons listed with each below, so every process the
product starts ignores exactly these, before megatron-core is imported:

* the ``autohet`` command and the torchrun workers it and ``autohet node`` start
  (cli/main.py ``main``; a worker is ``python -m megatron_autohet.cli.main``);
* the profiler's spawned tensor-parallel processes (profiling/measure.py ``_worker``);
* Megatron-LM's ``pretrain_gpt.py`` with the patch (patches/), first thing after its imports of
  the standard library.

A filter matches one message of megatron-core's own modules only (``module="megatron\\."``), as
a UserWarning: any other warning, including another of megatron-core's, still shows.
"""

from __future__ import annotations

import warnings

# (start of the message, as a regular expression; why it is benign here)
KNOWN_WARNINGS: tuple[tuple[str, str], ...] = (
    (r"Apex is not installed\. Falling back to Torch Norm",
     "megatron-core's layer-spec modules look for Apex's fused LayerNorm at import; without it "
     "the local spec normalises with torch's own LayerNorm / RMSNorm (WrappedTorchNorm), the "
     "same arithmetic unfused, and with Transformer Engine its spec uses TE's norm anyway"),
    (r"Transformer Engine and Apex are not installed\. Falling back to Torch optimizers",
     "megatron-core's optimizer package picks a fused Adam from TE or Apex at import; the "
     "runtime builds its own torch.optim.AdamW (runtime/optimizer.py) and never uses that "
     "choice"),
    (r"Transformer Engine and Apex are not installed\. Falling back to local implementations",
     "multi_tensor_applier / l2norm / scale (optimizer, clip_grads, megatron_fsdp) fall back to "
     "per-tensor torch loops: the same results, used only by gradient clipping here"),
    (r"full scope is deprecated\.",
     "megatron-core 0.16's own TransformerConfig default (cuda_graph_scope='full') triggers it on "
     "every config built; the runtime captures no CUDA graphs"),
)


def ignore_known_warnings() -> None:
    """Ignore the warnings of :data:`KNOWN_WARNINGS` in this process (idempotent: ``warnings``
    drops a filter equal to one it has)."""
    for message, _why in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning,
                                module=r"megatron\.")
