"""Known-benign warnings of megatron-core and Megatron-LM: the lists, and the filters to install.

megatron-core warns at import about every optional fused kernel it cannot find, its
``TransformerConfig`` warns about its own default, and 0.19 logs deprecations of what 0.16.1
offers no replacement for. Each process of a job repeats them (seven warnings, fourteen lines
per rank on a CPU), which buries the lines that matter. None of them says anything about this
job, for the reasons listed with each below, so every process the product starts ignores exactly
these, before megatron-core is imported:

* the ``autohet`` command and the torchrun workers it and ``autohet node`` start
  (cli/main.py ``main``; a worker is ``python -m megatron_autohet.cli.main``, or a fork of
  cli/warm.py's server, which calls it before its imports);
* the profiler's spawned tensor-parallel processes (profiling/measure.py ``_worker``);
* Megatron-LM's ``pretrain_gpt.py`` with the patch (patches/), first thing after its imports of
  the standard library.

Megatron-LM's own start-up warnings (its training package's, and megatron-core's that only its
start-up triggers) are a second pair of lists, ignored by the ranks of ``pretrain_gpt.py
--autohet-plan`` alone (megatron/hooks.py) and pinned by the Megatron-LM tests (tests/megatron)
rather than by megatron-core's (tests/cli/test_known_warnings.py).

Two kinds, as megatron-core emits them: Python warnings (``warnings.warn``: a filter matches one
message of megatron-core's own modules only, ``module="megatron\\."``, as a UserWarning) and
log records (``logger.warning`` on the module's logger: a filter on that one logger drops one
message). Any other warning or record, including another of megatron-core's, still shows.
"""

from __future__ import annotations

import logging
import re
import warnings

# (start of the message, as a regular expression; the megatron-core minor versions that give it
# in this product's processes; why it is benign here)
KNOWN_WARNINGS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    (r"Apex is not installed\. Falling back to Torch Norm", ("0.16", "0.19"),
     "megatron-core's layer-spec modules look for Apex's fused LayerNorm at import; without it "
     "the local spec normalises with torch's own LayerNorm / RMSNorm (WrappedTorchNorm), the "
     "same arithmetic unfused, and with Transformer Engine its spec uses TE's norm anyway"),
    (r"Transformer Engine and Apex are not installed\. Falling back to Torch optimizers",
     ("0.16", "0.19"),
     "megatron-core's optimizer package picks a fused Adam from TE or Apex at import; the "
     "runtime builds its own torch.optim.AdamW (runtime/optimizer.py) and never uses that "
     "choice"),
    (r"Transformer Engine and Apex are not installed\. Falling back to local implementations",
     ("0.16", "0.19"),
     "multi_tensor_applier / l2norm / scale (optimizer, clip_grads, megatron_fsdp) fall back to "
     "per-tensor torch loops: the same results, used only by gradient clipping here"),
    (r"full scope is deprecated\.", ("0.16", "0.19"),
     "megatron-core's own TransformerConfig default (0.16's cuda_graph_scope='full', 0.19's "
     "cuda_graph_modules) triggers it on every config built; the runtime captures no CUDA "
     "graphs"),
    (r"MimoModelConfig is experimental", ("0.19",),
     "0.19's get_megatron_optimizer imports the multimodal MiMo model to check whether it was "
     "given one, and that module warns as it defines its config class; nothing here builds a "
     "MiMo model (the stock baseline and pretrain_gpt.py build GPT models)"),
)

# megatron-core's log records of the same kind: (the emitting module's logger; start of the
# message, as a regular expression; versions; why it is benign here)
KNOWN_LOG_RECORDS: tuple[tuple[str, str, tuple[str, ...], str], ...] = (
    ("megatron.core.models.gpt.gpt_model", r"GPTModel IS DEPRECATED\.", ("0.19",),
     "0.19 asks GPT users to move to HybridModel, which 0.16.1 does not have; GPTModel still "
     "builds the same model in 0.19 (the equivalence tests pass on both), and setup.py's range "
     "ends before the release that would drop it"),
    ("megatron.core.dist_checkpointing.strategies.common", r"load_common is deprecated",
     ("0.19",),
     "a step's non-tensor state is in common.pt, the torch_dist layout 0.16.1 writes and reads "
     "(and checkpoint/writer.py writes); 0.19 still reads it (its legacy path, taken because "
     "the file is there), so steps stay readable by both versions; setup.py's range ends "
     "before the release that would drop it"),
)

# Megatron-LM's (training package and megatron-core, given by `pretrain_gpt.py --autohet-plan`
# only, core_v0.16.1): as above, ignored by megatron/hooks.py prepare_process, before Megatron-LM
# parses its flags.
MEGATRON_LM_WARNINGS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    (r"Overriding default arguments for tokenizer_type:GPT2BPETokenizer with tokenizer_type:",
     ("0.16",),
     "pretrain_gpt.py's own default tokenizer replaced by the --tokenizer-type the user gave: "
     "the warning repeats the command line"),
    (r"Constraints for invoking optimized fused softmax kernel are not met\.", ("0.16",),
     "Megatron-LM's start-up checks its fused-softmax constraints on its own flags; the plan "
     "runtime builds the stage models with masked_softmax_fusion off (runtime/stage_model.py), "
     "whatever the flags say"),
)
MEGATRON_LM_LOG_RECORDS: tuple[tuple[str, str, tuple[str, ...], str], ...] = (
    ("megatron.core.datasets.megatron_tokenizer", r"You're using the legacy tokenizer system",
     ("0.16",),
     "Megatron-LM core_v0.16.1's training package builds --tokenizer-type with the legacy "
     "tokenizer classes itself (megatron.training.tokenizer); the plan path only reads its "
     "vocabulary size and EOD token, and core_v0.16.1 offers no flag for the new system"),
    ("megatron.core.rerun_state_machine", r"RerunStateMachine initialized in mode",
     ("0.16",),
     "initialize_megatron sets up the state machine of Megatron's own train loop (its default "
     "mode, no --rerun-mode given); the plan path's runtime runs the iterations without it"),
)


class _DropMessage(logging.Filter):
    def __init__(self, pattern: str):
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.match(record.getMessage())

    def __eq__(self, other) -> bool:
        return isinstance(other, _DropMessage) and other.pattern == self.pattern

    def __hash__(self) -> int:
        return hash(self.pattern)


def ignore_known_warnings() -> None:
    """Ignore the warnings of :data:`KNOWN_WARNINGS` and the records of
    :data:`KNOWN_LOG_RECORDS` in this process (idempotent: ``warnings`` drops a filter equal to
    one it has, a logger one equal to a filter it holds)."""
    _ignore(KNOWN_WARNINGS, KNOWN_LOG_RECORDS)


def ignore_megatron_lm_warnings() -> None:
    """Ignore :data:`MEGATRON_LM_WARNINGS` and :data:`MEGATRON_LM_LOG_RECORDS` in this process
    (a rank of ``pretrain_gpt.py --autohet-plan``; idempotent)."""
    _ignore(MEGATRON_LM_WARNINGS, MEGATRON_LM_LOG_RECORDS)


def _ignore(known_warnings, known_log_records) -> None:
    for message, _versions, _why in known_warnings:
        warnings.filterwarnings("ignore", message=message, category=UserWarning,
                                module=r"megatron\.")
    for name, message, _versions, _why in known_log_records:
        logger = logging.getLogger(name)
        if _DropMessage(message) not in logger.filters:
            logger.addFilter(_DropMessage(message))
