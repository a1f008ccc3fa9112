"""Which Megatron-LM flags ``pretrain_gpt.py --autohet-plan`` honours: one allow-list.

The plan path replaces Megatron-LM's training loop, so a Megatron flag does something only where
megatron-autohet reads it. :data:`FLAGS` says, for every flag the plan path accepts with a value
other than Megatron's default, how it is honoured:

* ``checked against the plan`` - the model, batch and layout flags; ``hooks.check_megatron_args``
  refuses a value that contradicts the plan (or the runtime: recompute, optimizer);
* ``drives Megatron's learning-rate scheduler`` - ``get_optimizer_param_scheduler`` reads it and
  steps the runtime's optimizer;
* ``honoured by the runtime`` - the runtime, its data or its checkpoints implement it;
* ``inert on this path because ...`` - harmless to accept (deprecated flags Megatron ignores
  itself, kernel fusions the runtime never uses);
* ``refused`` - listed only to say what to use instead (the checkpoint flags whose concept
  megatron-autohet provides otherwise) or that support is coming.

:func:`check_flags` compares the command line, parsed by Megatron-LM's own parser, with that
parser's defaults: a flag whose value differs and that is not honoured in :data:`FLAGS` is a
:class:`ConfigError` naming it. ``hooks.prepare_process`` runs it in every process before
Megatron-LM initialises anything, so a refused flag costs a second, not a start-up. Flags left at
Megatron's default are not checked here; ``hooks.check_megatron_args`` checks the defaults that
matter (e.g. the model shape) against the plan. Megatron's default dropout of 0.1 is honoured.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import NamedTuple

from megatron_autohet.errors import ConfigError
from megatron_autohet.megatron.args import add_autohet_args

CHECKED = "checked against the plan"
SCHEDULER = "drives Megatron's learning-rate scheduler"
RUNTIME = "honoured by the runtime"
INERT = "inert on this path"
REFUSED = "refused"


class FlagRule(NamedTuple):
    how: str          # one of the categories above
    detail: str       # how exactly; for REFUSED: what is allowed instead


_NOT_SET = "not set"
_NO_FP16 = ("not set (fp16 needs a dynamic loss scaler, which the plan runtime does not have; "
            "--bf16 trains in bf16 mixed precision)")
_LOCAL_TIER = "not set (--autohet-local-ckpt-dir DIR is the node-local tier)"
_RESUME = "not set (--load DIR resumes weights, Adam state and schedule from the newest step)"
_UNFUSED = "the runtime leaves this fusion off (runtime/stage_model.py)"
_DEPRECATED = "deprecated; Megatron-LM itself ignores it"
_VOCAB = ("read by Megatron's tokenizer, whose vocabulary size must be the plan's model's "
          "vocab_size")

FLAGS: dict[str, FlagRule] = {
    # ---- the model, batch and layout: hooks.check_megatron_args -------------------------------
    "--tensor-model-parallel-size": FlagRule(CHECKED, "1: the plan sets each stage's TP degree"),
    "--pipeline-model-parallel-size": FlagRule(CHECKED, "1: the plan sets each pipeline"),
    "--num-layers": FlagRule(CHECKED, "the plan's model"),
    "--hidden-size": FlagRule(CHECKED, "the plan's model"),
    "--num-attention-heads": FlagRule(CHECKED, "the plan's model"),
    "--ffn-hidden-size": FlagRule(CHECKED, "the plan's model"),
    "--group-query-attention": FlagRule(CHECKED, "with --num-query-groups: the plan's model"),
    "--num-query-groups": FlagRule(CHECKED, "the plan's model"),
    "--swiglu": FlagRule(CHECKED, "the plan's model's gated_linear_unit"),
    "--normalization": FlagRule(CHECKED, "the plan's model (RMSNorm with SwiGLU, else "
                                         "LayerNorm)"),
    "--disable-bias-linear": FlagRule(CHECKED, "the plan's model (no biases with SwiGLU)"),
    "--position-embedding-type": FlagRule(CHECKED, "the plan's model"),
    "--max-position-embeddings": FlagRule(CHECKED, "the plan's model's seq_length"),
    "--untie-embeddings-and-output-weights": FlagRule(CHECKED, "the plan's model"),
    "--seq-length": FlagRule(CHECKED, "the plan's seq_length"),
    "--micro-batch-size": FlagRule(CHECKED, "the plan's micro_batch_size"),
    "--global-batch-size": FlagRule(CHECKED, "the plan's global_batch_size"),
    "--vocab-size": FlagRule(CHECKED, _VOCAB),
    "--tokenizer-type": FlagRule(CHECKED, _VOCAB),
    "--tokenizer-model": FlagRule(CHECKED, _VOCAB),
    "--vocab-file": FlagRule(CHECKED, _VOCAB),
    "--merge-file": FlagRule(CHECKED, _VOCAB),
    "--recompute-granularity": FlagRule(CHECKED, "full, only with the plan's "
                                                 "activation_recompute"),
    "--recompute-method": FlagRule(CHECKED, "uniform, as the plan's activation_recompute"),
    "--recompute-num-layers": FlagRule(CHECKED, "1, as the plan's activation_recompute"),
    "--optimizer": FlagRule(CHECKED, "adam: the runtime trains with AdamW"),
    "--train-iters": FlagRule(RUNTIME, "the iterations trained (required)"),
    # ---- Megatron's scheduler on the runtime's optimizer --------------------------------------
    "--lr": FlagRule(SCHEDULER, "peak learning rate"),
    "--min-lr": FlagRule(SCHEDULER, "learning rate at the end of the decay"),
    "--lr-decay-style": FlagRule(SCHEDULER, "decay shape"),
    "--lr-decay-iters": FlagRule(SCHEDULER, "decay length"),
    "--lr-warmup-iters": FlagRule(SCHEDULER, "warm-up length"),
    "--lr-warmup-fraction": FlagRule(SCHEDULER, "warm-up length"),
    "--lr-warmup-init": FlagRule(SCHEDULER, "warm-up start"),
    "--lr-wsd-decay-style": FlagRule(SCHEDULER, "WSD decay shape"),
    "--lr-wsd-decay-iters": FlagRule(SCHEDULER, "WSD decay length"),
    "--weight-decay": FlagRule(SCHEDULER, "weight decay (constant style)"),
    "--start-weight-decay": FlagRule(SCHEDULER, "weight-decay schedule"),
    "--end-weight-decay": FlagRule(SCHEDULER, "weight-decay schedule"),
    "--weight-decay-incr-style": FlagRule(SCHEDULER, "weight-decay schedule"),
    "--override-opt-param-scheduler": FlagRule(SCHEDULER, "on --load: this run's schedule"),
    "--use-checkpoint-opt-param-scheduler": FlagRule(SCHEDULER, "on --load: the checkpoint's"),
    # ---- the runtime ---------------------------------------------------------------------------
    "--adam-beta1": FlagRule(RUNTIME, "AdamW beta1"),
    "--adam-beta2": FlagRule(RUNTIME, "AdamW beta2"),
    "--adam-eps": FlagRule(RUNTIME, "AdamW epsilon"),
    "--clip-grad": FlagRule(RUNTIME, "global grad-norm clipping"),
    "--bf16": FlagRule(RUNTIME, "bf16 mixed precision: bf16 weights and activations, fp32 main "
                                "gradients, master weights and Adam state"),
    "--use-distributed-optimizer": FlagRule(RUNTIME, "master weights and Adam state sharded "
                                                     "over each parameter's holders"),
    "--overlap-grad-reduce": FlagRule(RUNTIME, "each gradient bucket synced during the last "
                                               "micro-batch's backward"),
    "--seed": FlagRule(RUNTIME, "initial weights, data shuffle, dropout streams"),
    "--hidden-dropout": FlagRule(RUNTIME, "dropout of the hidden states, a probability in [0, 1)"),
    "--attention-dropout": FlagRule(RUNTIME, "dropout of the attention weights, in [0, 1)"),
    "--data-path": FlagRule(RUNTIME, "indexed-dataset prefixes, a weighted blend of them, "
                                     "blended by megatron-core"),
    "--train-data-path": FlagRule(RUNTIME, "the training split's own blend"),
    "--valid-data-path": FlagRule(RUNTIME, "the validation split's own blend"),
    "--test-data-path": FlagRule(RUNTIME, "the test split's own blend"),
    "--split": FlagRule(RUNTIME, "train/validation documents of --data-path or the built-in "
                                 "corpus"),
    "--eval-interval": FlagRule(RUNTIME, "forward-only validation every N iterations"),
    "--eval-iters": FlagRule(RUNTIME, "validation global batches per evaluation"),
    "--log-interval": FlagRule(RUNTIME, "the iteration line every N iterations (the "
                                        "--autohet-metrics-jsonl file gets every one)"),
    "--distributed-backend": FlagRule(RUNTIME, "Megatron's initialize_megatron starts "
                                               "torch.distributed with it"),
    "--distributed-timeout-minutes": FlagRule(RUNTIME, "Megatron's initialize_megatron"),
    "--exit-interval": FlagRule(RUNTIME, "stop (and save) after a multiple of N"),
    "--exit-signal-handler": FlagRule(RUNTIME, "SIGTERM: every rank stops after the same "
                                               "iteration and saves it"),
    "--save": FlagRule(RUNTIME, "megatron-autohet's torch_dist checkpoints"),
    "--save-interval": FlagRule(RUNTIME, "checkpoint interval"),
    "--load": FlagRule(RUNTIME, "resume the newest complete step"),
    "--exit-on-missing-checkpoint": FlagRule(RUNTIME, "stop when --load holds no step"),
    "--async-save": FlagRule(RUNTIME, "background checkpoint writer (with "
                                      "--use-persistent-ckpt-worker, as Megatron requires)"),
    "--use-persistent-ckpt-worker": FlagRule(RUNTIME, "the background checkpoint writer"),
    "--ckpt-step": FlagRule(RUNTIME, "resume this step"),
    "--no-load-optim": FlagRule(RUNTIME, "resume without Adam state and schedule"),
    "--no-load-rng": FlagRule(RUNTIME, "resume without RNG states"),
    "--finetune": FlagRule(RUNTIME, "load weights only, start at iteration 0"),
    # runtime/fusions.py: megatron-core's fused kernels on CUDA GPUs; the flag for the other
    # activation does nothing, in Megatron-LM as here
    "--no-bias-gelu-fusion": FlagRule(RUNTIME, "GELU models: the MLP's bias + GELU unfused"),
    "--no-bias-swiglu-fusion": FlagRule(RUNTIME, "SwiGLU models: the MLP's bias + SwiGLU "
                                                 "unfused"),
    "--no-bias-dropout-fusion": FlagRule(RUNTIME, "bias + dropout + residual add unfused"),
    # runtime/dashboard.py: from the rank that logs, Megatron-LM's scalar names
    "--tensorboard-dir": FlagRule(RUNTIME, "TensorBoard event files: Megatron-LM's scalars "
                                           "every iteration, the job's events as text"),
    "--wandb-project": FlagRule(RUNTIME, "W&B: the same scalars and events (wandb must be "
                                         "installed: refused in one line otherwise)"),
    "--wandb-exp-name": FlagRule(RUNTIME, "the W&B run's name"),
    "--wandb-save-dir": FlagRule(RUNTIME, "W&B's local files (default: --save's wandb/)"),
    # ---- inert ---------------------------------------------------------------------------------
    "--log-throughput": FlagRule(INERT, "the iteration line always shows throughput per GPU"),
    "--log-timers-to-tensorboard": FlagRule(INERT, "--tensorboard-dir always gets iteration-time "
                                                   "and throughput"),
    "--log-memory-to-tensorboard": FlagRule(INERT, "--tensorboard-dir always gets "
                                                   "mem-max-allocated-bytes (on GPUs)"),
    "--log-validation-ppl-to-tensorboard": FlagRule(INERT, "--tensorboard-dir always gets the "
                                                           "validation perplexity"),
    "--tensorboard-queue-size": FlagRule(INERT, "the job's writer flushes after every "
                                                "iteration"),
    "--use-dist-ckpt": FlagRule(INERT, _DEPRECATED),
    "--dist-ckpt-format": FlagRule(INERT, _DEPRECATED),
    "--ckpt-fully-parallel-save": FlagRule(INERT, _DEPRECATED),
    "--use-cpu-initialization": FlagRule(INERT, "the runtime always builds its stages on the "
                                                "CPU, then writes its layout-independent "
                                                "initial weights (runtime/init.py)"),
    "--no-masked-softmax-fusion": FlagRule(INERT, _UNFUSED),
    "--no-gradient-accumulation-fusion": FlagRule(INERT, _UNFUSED),
    "--no-persist-layer-norm": FlagRule(INERT, _UNFUSED),
    "--no-rope-fusion": FlagRule(INERT, _UNFUSED),
    "--num-workers": FlagRule(INERT, "every rank reads its global batches in-process "
                                     "(data/batches.py); no DataLoader workers exist"),
    # ---- refused, with what to use instead ----------------------------------------------------
    # Being implemented; flipped to honoured when they land.
    "--fp16": FlagRule(REFUSED, _NO_FP16),
    "--overlap-param-gather": FlagRule(REFUSED, "not set (the distributed optimizer gathers the "
                                                "weights after its step, not during the next "
                                                "forward)"),
    "--recompute-activations": FlagRule(REFUSED, "not set (selective recompute: the planner "
                                                 "does not price it; the plan's "
                                                 "activation_recompute turns full recompute on)"),
    # Megatron-LM core_v0.16.1's checkpoint and exit flags megatron-autohet does not implement.
    "--ckpt-format": FlagRule(REFUSED, "torch_dist, the format megatron-autohet writes"),
    "--auto-detect-ckpt-format": FlagRule(REFUSED, "not set (checkpoints are always "
                                                   "torch_dist)"),
    "--no-ckpt-fully-parallel-save": FlagRule(REFUSED, "not set (the plan's owner map spreads "
                                                       "the writes: each chunk once, by its "
                                                       "owner)"),
    "--ckpt-fully-parallel-load": FlagRule(REFUSED, "not set (each rank reads only the chunks "
                                                    "its shards need)"),
    "--ckpt-assume-constant-structure": FlagRule(REFUSED, _NOT_SET),
    "--dist-ckpt-strictness": FlagRule(REFUSED, "assume_ok_unexpected (a load checks every "
                                                "chunk against the step's manifest)"),
    "--dist-ckpt-save-pre-mcore-014": FlagRule(REFUSED, _NOT_SET),
    "--dist-ckpt-optim-fully-reshardable": FlagRule(REFUSED, "not set (the Adam state "
                                                             "reshards to any plan anyway)"),
    "--distrib-optim-fully-reshardable-mem-efficient": FlagRule(REFUSED, _NOT_SET),
    "--no-strict-fsdp-dtensor-load": FlagRule(REFUSED, _NOT_SET),
    "--ckpt-convert-format": FlagRule(REFUSED, _NOT_SET),
    "--ckpt-convert-save": FlagRule(REFUSED, _NOT_SET),
    "--ckpt-convert-update-legacy-dist-opt-format": FlagRule(REFUSED, _NOT_SET),
    "--no-save-optim": FlagRule(REFUSED, "not set (every step holds the Adam state)"),
    "--no-save-rng": FlagRule(REFUSED, "not set (every step holds the RNG states)"),
    "--load-main-params-from-ckpt": FlagRule(REFUSED, _RESUME),
    "--pretrained-checkpoint": FlagRule(REFUSED, _RESUME),
    "--use-checkpoint-args": FlagRule(REFUSED, "not set (the plan and the flags describe the "
                                               "job)"),
    "--use-mp-args-from-checkpoint-args": FlagRule(REFUSED, "not set (the plan sets the "
                                                            "layout)"),
    "--no-use-tokenizer-model-from-checkpoint-args": FlagRule(REFUSED, _NOT_SET),
    "--save-retain-interval": FlagRule(REFUSED, "not set (--autohet-keep-ckpts K keeps the K "
                                                "newest steps)"),
    "--save-wgrads-interval": FlagRule(REFUSED, _NOT_SET),
    "--save-dgrads-interval": FlagRule(REFUSED, _NOT_SET),
    "--non-persistent-save-interval": FlagRule(REFUSED, _LOCAL_TIER),
    "--non-persistent-ckpt-type": FlagRule(REFUSED, _LOCAL_TIER),
    "--non-persistent-global-ckpt-dir": FlagRule(REFUSED, _LOCAL_TIER),
    "--non-persistent-local-ckpt-dir": FlagRule(REFUSED, _LOCAL_TIER),
    "--non-persistent-local-ckpt-algo": FlagRule(REFUSED, _LOCAL_TIER),
    "--replication": FlagRule(REFUSED, _LOCAL_TIER),
    "--replication-jump": FlagRule(REFUSED, _LOCAL_TIER),
    "--replication-factor": FlagRule(REFUSED, _LOCAL_TIER),
    "--exit-duration-in-mins": FlagRule(REFUSED, "not set (--exit-interval N)"),
}

_NOT_HONOURED = ("its default (docs/megatron-lm.md, 'Megatron-LM flags with --autohet-plan', "
                 "lists the flags the plan path honours)")


def megatron_parser():
    """Megatron-LM's own parser with the ``--autohet-*`` flags, as ``pretrain_gpt.py`` builds it."""
    # Megatron-LM's training package: in a Megatron-LM tree only
    from megatron.training.arguments import add_megatron_arguments

    return add_autohet_args(add_megatron_arguments(
        argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)))


def check_flags(argv: list[str], parser=None) -> None:
    """Every flag of ``argv`` (without the program name) whose value differs from Megatron-LM's
    default must be honoured in :data:`FLAGS`; the first that is not is a ConfigError naming it.
    Arguments Megatron's parser does not know are left to it (it stops the job on them)."""
    parser = parser or megatron_parser()
    given = vars(parser.parse_known_args(argv)[0])
    defaults = vars(parser.parse_known_args([])[0])
    source = given.get("autohet_plan") or "<command line>"
    for action in parser._actions:
        dest = action.dest
        if not action.option_strings or dest.startswith("autohet_") or dest == "help":
            continue
        if given[dest] == defaults[dest]:
            continue
        flag = _flag_given(action, parser, argv)
        rule = FLAGS.get(flag)
        if rule is not None and rule.how != REFUSED:
            continue
        value = given[dest]
        problem = ("not yet supported with --autohet-plan" if isinstance(value, bool)
                   else f"{value!r} is not supported with --autohet-plan")
        raise ConfigError(source, flag, problem, rule.detail if rule else _NOT_HONOURED)


def _flag_given(action, parser, argv: list[str]) -> str:
    """The option string the user typed for ``action``'s destination (flags such as
    ``--foo``/``--no-foo`` share one), else the action's first."""
    typed = {arg.split("=", 1)[0] for arg in argv if arg.startswith("-")}
    for other in parser._actions:
        if other.dest == action.dest:
            for option in other.option_strings:
                if option in typed:
                    return option
    return action.option_strings[0]


def stop_before_start(err: ConfigError, prog: str) -> None:
    """End a process of the job before ``torch.distributed`` exists: the first rank prints the
    line, as argparse would, and every rank exits with status 2. The others wait a few seconds
    first, so that torchrun, which ends a job as soon as one of its processes exits, does not
    stop the first rank before it printed."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"{Path(prog).name}: error: {err}", file=sys.stderr, flush=True)
    else:
        time.sleep(5)
    sys.exit(2)
