"""``--autohet-*`` flags for Megatron-LM, added through ``pretrain(extra_args_provider=...)``.

Megatron-LM calls ``extra_args_provider(parser)`` while it builds its own parser, so these flags
land on Megatron's ``args`` namespace (``args.autohet_plan``...); ``pretrain_gpt.py --help`` lists
them through ``hooks.prepare_process``. :func:`chain` combines this provider with one Megatron-LM
already passes (``add_modelopt_args`` when NVIDIA ModelOpt is installed).

The checkpoint flags are Megatron's own (``--save``, ``--save-interval``, ``--load``,
``--exit-interval``, ``--async-save``); the concepts Megatron has no flag for (the node-local
tier, how many steps to keep, the S3 tier) are ``autohet train``'s, defined once for both
(checkpoint/options.py ``tier_flags``).
"""

from __future__ import annotations

from collections.abc import Callable

from megatron_autohet.checkpoint.options import tier_flags
from megatron_autohet.job import measure_flags


def add_autohet_args(parser):
    group = parser.add_argument_group(title="megatron-autohet (heterogeneous training from a plan)")
    group.add_argument("--autohet-plan", type=str, default=None,
                       help="Plan YAML from `autohet plan`. When given, the plan decides the "
                            "parallel layout (TP group, pipeline and layers of every rank, "
                            "micro-batches per pipeline) and megatron-autohet's runtime runs the "
                            "iterations: keep --tensor-model-parallel-size and "
                            "--pipeline-model-parallel-size at 1.")
    group.add_argument("--autohet-metrics-jsonl", type=str, default=None,
                       help="With --autohet-plan: also write one JSON object per iteration "
                            "(loss, grad norm, time, tokens/s) to this file.")
    group.add_argument("--autohet-data-dir", type=str, default=None,
                       help="With --autohet-plan and no --data-path: cache of the built-in corpus "
                            "(default $AUTOHET_DATA_DIR or ~/.cache/megatron-autohet).")
    for flags, kwargs in [*tier_flags(prefix="With --autohet-plan: "),
                          *measure_flags(prefix="With --autohet-plan: ")]:
        group.add_argument(*flags, **kwargs)
    return parser


def chain(*providers: Callable | None) -> Callable:
    """One extra_args_provider that calls each given provider (None entries are skipped)."""
    def provider(parser):
        for p in providers:
            if p is not None:
                parser = p(parser) or parser
        return parser
    return provider
