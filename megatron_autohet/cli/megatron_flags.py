"""Megatron-LM's flags that `autohet train` does not take: each refused with what decides it here.

A Megatron-LM user's command line carries flags whose decision `autohet train` leaves to the plan
(the layout, the batch, recompute) or the model file (the dimensions), or to a flag of its own.
:data:`INSTEAD` maps those of Megatron-LM core_v0.16.1's ``megatron/training/arguments.py`` that
such scripts set most to what to use instead, and :func:`refuse_unknown` turns any argument
`autohet train`'s parser did not take into one ConfigError naming the first of them: a
Megatron-LM flag with its replacement, any other as not a flag of `autohet train` (its ``--help``
lists them). The flags Megatron-LM and `autohet train` share are `autohet train`'s own (cli/
train.py); ``pretrain_gpt.py --autohet-plan`` takes every Megatron-LM flag (megatron/flags.py).
"""

from __future__ import annotations

from megatron_autohet.errors import ConfigError

_PLAN = "the plan decides it (`autohet plan`): "
_MODEL = "the model file's "
_NOT_HERE = "not available with autohet train; "

INSTEAD: dict[str, str] = {
    # ---- the layout: the plan's stages, ranks and pipelines
    "--tensor-model-parallel-size": _PLAN + "each stage's TP degree",
    "--pipeline-model-parallel-size": _PLAN + "each pipeline's stages",
    "--num-layers-per-virtual-pipeline-stage": _PLAN + "each stage's layers (no interleaving)",
    "--num-virtual-stages-per-pipeline-rank": _PLAN + "each stage's layers (no interleaving)",
    "--decoder-first-pipeline-num-layers": _PLAN + "each stage's layers",
    "--decoder-last-pipeline-num-layers": _PLAN + "each stage's layers",
    "--context-parallel-size": _NOT_HERE + "the plan's TP and pipelines split the work",
    "--expert-model-parallel-size": _NOT_HERE + "dense GPT models only",
    "--num-experts": _NOT_HERE + "dense GPT models only",
    "--sequence-parallel": _NOT_HERE + "plans are priced and trained without it",
    "--data-parallel-sharding-strategy": "--use-distributed-optimizer",
    "--use-torch-fsdp2": "--use-distributed-optimizer",
    "--use-megatron-fsdp": "--use-distributed-optimizer",
    "--overlap-param-gather": _NOT_HERE + "the distributed optimizer gathers after the step",
    # ---- the batch and the sequence: the plan's
    "--seq-length": _PLAN + "seq_length",
    "--train-samples": "--train-iters (the plan's global_batch_size samples each)",
    "--rampup-batch-size": _PLAN + "one global_batch_size for the whole run",
    "--lr-warmup-samples": "--lr-warmup-iters or --lr-warmup-fraction",
    "--lr-decay-samples": "--lr-decay-iters",
    "--recompute-granularity": _PLAN + "activation_recompute (full recompute of every layer)",
    "--recompute-method": _PLAN + "activation_recompute (full recompute of every layer)",
    "--recompute-num-layers": _PLAN + "activation_recompute (full recompute of every layer)",
    "--recompute-activations": _PLAN + "activation_recompute (full recompute; selective "
                                       "recompute is not priced)",
    # ---- the model's dimensions: the model file's (configs/models/*.yaml)
    "--num-layers": _MODEL + "num_layers",
    "--hidden-size": _MODEL + "hidden_size",
    "--ffn-hidden-size": _MODEL + "ffn_hidden_size",
    "--num-attention-heads": _MODEL + "num_attention_heads",
    "--group-query-attention": _MODEL + "num_query_groups",
    "--num-query-groups": _MODEL + "num_query_groups",
    "--kv-channels": _MODEL + "hidden_size / num_attention_heads",
    "--max-position-embeddings": _MODEL + "seq_length",
    "--position-embedding-type": _MODEL + "position_embedding_type",
    "--no-position-embedding": _MODEL + "position_embedding_type",
    "--rotary-base": _MODEL + "position_embedding_type: rope (base 10000)",
    "--rotary-percent": _MODEL + "position_embedding_type: rope (all of each head)",
    "--use-rotary-position-embeddings": _MODEL + "position_embedding_type",
    "--swiglu": _MODEL + "gated_linear_unit",
    "--normalization": _MODEL + "gated_linear_unit (RMSNorm with SwiGLU, else LayerNorm)",
    "--disable-bias-linear": _MODEL + "gated_linear_unit (no linear biases with SwiGLU)",
    "--untie-embeddings-and-output-weights": _MODEL + "tie_embeddings",
    "--init-method-std": _NOT_HERE + "the runtime's layout-independent initial weights "
                                     "(std 0.02, as Megatron-LM's default)",
    # ---- kernels and implementations the runtime chooses itself
    "--use-flash-attn": _NOT_HERE + "attention is torch's scaled_dot_product_attention, which "
                                    "takes the flash kernel where it can",
    "--attention-backend": _NOT_HERE + "attention is torch's scaled_dot_product_attention",
    "--transformer-impl": _NOT_HERE + "the runtime builds megatron-core's local layers",
    "--no-masked-softmax-fusion": _NOT_HERE + "the runtime never uses that fusion",
    "--no-gradient-accumulation-fusion": _NOT_HERE + "the runtime never uses that fusion",
    "--no-persist-layer-norm": _NOT_HERE + "the runtime never uses that fusion",
    "--no-rope-fusion": _NOT_HERE + "the runtime never uses that fusion",
    "--use-cpu-initialization": _NOT_HERE + "stages are always built on the CPU first",
    "--accumulate-allreduce-grads-in-fp32": "--bf16 (main gradients are always fp32)",
    "--optimizer": _NOT_HERE + "the runtime trains with AdamW (--adam-beta1/2, --adam-eps)",
    "--loss-scale": "--bf16 (fp16 and its loss scaling are not supported)",
    "--initial-loss-scale": "--bf16 (fp16 and its loss scaling are not supported)",
    # ---- data and tokenizer flags Megatron-LM has beyond those honoured
    "--mock-data": "no --data-path (the built-in corpus)",
    "--data-cache-path": "--data-dir",
    "--data-args-path": "--data-path",
    "--per-split-data-args-path": "--train-data-path, --valid-data-path, --test-data-path",
    "--num-workers": _NOT_HERE + "every rank reads its global batches in-process",
    "--legacy-tokenizer": _NOT_HERE + "megatron-core's tokenizer checks the vocabulary",
    "--tokenizer-metadata": _NOT_HERE + "--tokenizer-type with its file flags",
    # ---- launch, logging and checkpoints
    "--distributed-backend": _NOT_HERE + "gloo on CPU, NCCL on GPUs, as the ranks find them",
    "--local-rank": _NOT_HERE + "torchrun's LOCAL_RANK, checked against the plan",
    "--exit-duration-in-mins": "--exit-interval",
    "--save-retain-interval": "--autohet-keep-ckpts",
    "--non-persistent-save-interval": "--autohet-local-ckpt-dir (the node-local tier)",
    "--non-persistent-local-ckpt-dir": "--autohet-local-ckpt-dir (the node-local tier)",
    "--ckpt-format": _NOT_HERE + "checkpoints are always torch_dist",
    "--use-dist-ckpt": _NOT_HERE + "checkpoints are always torch_dist",
    "--no-save-optim": _NOT_HERE + "every step holds the Adam state",
    "--no-save-rng": _NOT_HERE + "every step holds the RNG states",
    "--pretrained-checkpoint": "--load with --finetune",
    "--use-checkpoint-args": _NOT_HERE + "the plan and the flags describe the job",
    "--log-throughput": _NOT_HERE + "the iteration line always shows throughput",
    "--timing-log-level": _NOT_HERE + "--autohet-measure-window gathers each stage's times",
}
_UNKNOWN = "`autohet train --help` lists its flags"


def refuse_unknown(extras: list[str]) -> None:
    """The arguments a parser of `autohet train` left over, as one ConfigError naming the
    first: a Megatron-LM flag with what to use instead (:data:`INSTEAD`), else not a flag of
    `autohet train`."""
    flag = next((arg for arg in extras if arg.startswith("-")), None)
    if flag is None:
        raise ConfigError("<command line>", extras[0], "an argument no flag takes", _UNKNOWN)
    name = flag.split("=", 1)[0]
    if name in INSTEAD:
        raise ConfigError("<command line>", name, "a Megatron-LM flag autohet train does not "
                          "take", INSTEAD[name])
    raise ConfigError("<command line>", name, "not a flag of autohet train", _UNKNOWN)
