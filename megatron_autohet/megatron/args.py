"""``--autohet-*`` flags for Megatron-LM, added through ``pretrain(extra_args_provider=...)``.

Megatron-LM calls ``extra_args_provider(parser)`` while it builds its own parser, so these flags
land on Megatron's ``args`` namespace (``args.autohet_plan``...); ``pretrain_gpt.py --help`` lists
them through ``hooks.prepare_process``. :func:`chain` combines this provider with one Megatron-LM
already passes (``add_modelopt_args`` when NVIDIA ModelOpt is installed).

The checkpoint flags are Megatron's own (``--save``, ``--save-interval``, ``--load``,
``--exit-interval``, ``--async-save``); the concepts Megatron has no flag for (the node-local
tier, how many steps to keep, the S3 tier) are added here with the meaning and defaults of
``autohet train`` (checkpoint/options.py).
"""

from __future__ import annotations

from collections.abc import Callable

from megatron_autohet.checkpoint.options import DEFAULT_KEEP, DEFAULT_MAX_FAILED_SAVES


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
    group.add_argument("--autohet-local-ckpt-dir", type=str, default=None,
                       help="With --autohet-plan: node-local checkpoint directory; each node "
                            "writes what its ranks hold there instead of --save ('{node}' in the "
                            "path becomes the plan's node name, for emulated nodes on one "
                            "machine). Needs --save-interval.")
    group.add_argument("--autohet-keep-ckpts", type=int, default=DEFAULT_KEEP,
                       help="With --autohet-plan: committed checkpoints kept per directory and in "
                            f"S3 (default {DEFAULT_KEEP}).")
    group.add_argument("--autohet-max-failed-saves", type=int, default=DEFAULT_MAX_FAILED_SAVES,
                       help="With --autohet-plan: a failed save prints one line with its root "
                            "cause (the traceback goes to autohet-checkpoint-errors.log in the "
                            "checkpoint directory) and training goes on, unless it is the K-th "
                            "failed save in a row or the last save of the run: then the job stops "
                            "with status 1, saying which steps are complete and where. A failed "
                            "S3 upload of a complete local step is a warning only (default "
                            f"{DEFAULT_MAX_FAILED_SAVES}).")
    group.add_argument("--autohet-s3-uri", type=str, default=None,
                       help="With --autohet-plan: S3 tier s3://BUCKET/PREFIX; each checkpoint is "
                            "uploaded in the background and recovery downloads from it only what "
                            "no surviving disk holds (credentials: boto3's standard chain).")
    group.add_argument("--autohet-s3-endpoint-url", type=str, default=None,
                       help="With --autohet-s3-uri: endpoint of an S3-compatible store.")
    return parser


def chain(*providers: Callable | None) -> Callable:
    """One extra_args_provider that calls each given provider (None entries are skipped)."""
    def provider(parser):
        for p in providers:
            if p is not None:
                parser = p(parser) or parser
        return parser
    return provider
