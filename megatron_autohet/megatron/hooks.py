"""What the Megatron-LM patch calls to run ``pretrain_gpt.py --autohet-plan`` on our runtime.

Division of labour (patches/README.md has the line-by-line patch):

* Megatron-LM keeps: its command line (every flag it knows plus ours, via
  ``extra_args_provider``), argument validation, ``initialize_megatron`` (torch.distributed
  with ``--distributed-backend``, global args/timers/tokenizer, seeds, the dataset helper build)
  and its learning-rate / weight-decay schedule: ``get_optimizer_param_scheduler`` (every
  ``--lr-*`` and ``--*weight-decay*`` flag) drives our optimizer's ``param_groups``, stepped by
  the global batch size after each iteration as Megatron's ``train_step`` does. The optimizer
  is Megatron's: AdamW with decoupled weight decay and megatron-core's no-decay rule (biases and
  1-D parameters), ``--adam-beta1/2``, ``--adam-eps``, ``--clip-grad`` (runtime/optimizer.py),
  the groups carrying ``wd_mult`` as Megatron's scheduler expects.
* megatron-autohet takes over the iteration: Megatron's ``train_step`` assumes one homogeneous
  TP x PP x DP grid (it wraps the model in DDP over one DP group, calls the schedule without a
  communicator, and its optimizer clips over mpu groups), none of which can describe pipelines of
  different depth and TP degree. So after initialisation :func:`pretrain_from_plan` translates
  Megatron's flags into the job's options (:func:`train_options`: job.TrainOptions) and runs the
  job ``autohet train`` runs (job.train_job: the plan's :class:`HeteroTrainer` - parallel_state
  from the plan, stage model, hetero P2P + 1F1B, layer-wise grad sync - on the same global
  batches, with the same checkpoints), with Megatron's scheduler, logging Megatron's iteration
  line.

Checkpoints are megatron-autohet's (checkpoint/: torch_dist, layout-independent), driven by
Megatron's own flags: ``--save``, ``--save-interval``, ``--load``, ``--exit-interval``,
``--exit-on-missing-checkpoint``, ``--ckpt-format torch_dist`` (the default and the only format),
``--async-save`` (Megatron keeps it only with ``--use-persistent-ckpt-worker``; the background
writer of checkpoint/checkpointer.py is that worker), ``--use-checkpoint-opt-param-scheduler`` /
``--override-opt-param-scheduler`` (Megatron's scheduler applies them itself when it loads its
state; a different schedule without either is refused in one line before it asserts on every
rank), ``--ckpt-step``, ``--no-load-optim``, ``--no-load-rng``, ``--finetune``
(checkpoint/options.py), plus ``--autohet-local-ckpt-dir``, ``--autohet-keep-ckpts``,
``--autohet-max-failed-saves``, ``--autohet-s3-uri`` and ``--autohet-s3-endpoint-url``
(``autohet train``'s, checkpoint/options.py ``tier_flags``; added by megatron/args.py).

Flags are checked twice. Before Megatron-LM initialises anything, :func:`prepare_process` refuses
every flag set to a value other than Megatron's default that the plan path does not honour
(megatron/flags.py: the one table of honoured flags and how). After ``initialize_megatron``,
:func:`check_megatron_args` checks the honoured model, batch and runtime flags against the plan
(model dimensions, vocabulary, normalization, biases, recompute, batch sizes, sequence length,
world size, trivial Megatron grid, optimizer), and :func:`train_options` validates the job's
options as ``autohet train``'s are (job.TrainOptions.validate: iterations, dropout, optimizer,
checkpoint and resume flags, intervals); each raises :class:`ConfigError` naming the flag. Every
rank raises the same one, so :func:`stop_job` prints it once and every rank exits with status 2.

Evaluation: ``--eval-interval`` / ``--eval-iters`` run the runtime's forward-only evaluation
(runtime/trainer.py) on the validation documents of ``--split`` (data/batches.py), logged in
Megatron's format.

megatron-core's known-benign warnings (known_warnings.py: Apex or Transformer Engine missing, its
own deprecated default) are ignored on every rank from the top of the patched ``pretrain_gpt.py``;
once :func:`prepare_process` runs, so are Megatron-LM's own start-up ones (the same module's
second lists), and ranks other than the first ignore all Python warnings.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import subprocess
import sys
import sysconfig
import warnings
from pathlib import Path
from typing import NoReturn

from megatron_autohet.checkpoint.options import CheckpointOptions, tier_fields
from megatron_autohet.data.indexed import check_datasets
from megatron_autohet.errors import ConfigError
from megatron_autohet.job import TrainOptions, init_backend, measure_fields, train_job
from megatron_autohet.known_warnings import ignore_megatron_lm_warnings
from megatron_autohet.launch import signal_stop_check
from megatron_autohet.megatron.flags import check_flags, megatron_parser, stop_before_start
from megatron_autohet.plan import Plan, load_plan
from megatron_autohet.runtime.dashboard import dashboard_options
from megatron_autohet.runtime.optimizer import MEGATRON_SCHEDULE_FLAGS, OptimizerSettings


def prepare_process(argv: list[str] | None = None) -> None:
    """Called at the top of ``pretrain_gpt.py``'s main: answer ``--help`` with the ``--autohet-*``
    flags listed, and turn on the CPU mode for a plan job on a machine without a usable GPU
    (Megatron-LM then runs on gloo: ``--distributed-backend gloo``)."""
    argv = sys.argv if argv is None else argv
    if "-h" in argv or "--help" in argv:
        _print_help_with_autohet_flags(Path(argv[0]).name)
    if not any(a == "--autohet-plan" or a.startswith("--autohet-plan=") for a in argv):
        return
    # torch: in the ranks of pretrain_gpt.py only
    from megatron_autohet.runtime.cpu_mode import cpu_mode_required

    _quiet_other_ranks()
    ignore_megatron_lm_warnings()
    try:
        check_flags(argv[1:])
    except ConfigError as err:
        stop_before_start(err, argv[0])
    _size_megatron_batch_calculator_for_plans()
    _leave_dashboards_to_the_job()
    _build_dataset_helpers_for_this_python()
    on_cpu = cpu_mode_required()
    # as an `autohet train` rank: one CUDA work queue, the CPU mode without a GPU
    init_backend(on_cpu)
    if on_cpu:
        _adapt_megatron_lm_initialization_to_cpu()


def check_before_launch(argv: list[str], world_size: int) -> tuple[Plan, TrainOptions]:
    """What the ranks of ``pretrain_gpt.py --autohet-plan`` would refuse before training, decided
    by the launcher (``autohet torchrun``) before any of them starts: the same checks, in one
    process, on the same parse. ``argv``: the script's arguments; ``world_size``: the job's
    processes. Needs Megatron-LM's ``megatron`` package importable (the script's tree on
    ``sys.path``). In the ranks' order: the allow-list (:func:`check_flags`), Megatron-LM's
    own parse and ``validate_args`` (its asserts, one line each here instead of a traceback per
    rank), its tokenizer, :func:`check_megatron_args` against the plan, the job's options
    (:func:`train_options`) and the data prefixes. Returns the plan and the options (the
    launcher checks ``--load`` with them)."""
    # Megatron-LM's training package: in a Megatron-LM tree only
    from megatron.training.arguments import validate_args
    from megatron.training.tokenizer import build_tokenizer

    ignore_megatron_lm_warnings()      # as in the ranks: the tokenizer's legacy-system line
    check_flags(argv)
    parser = megatron_parser()
    parser.error = _refuse_in_one_line
    args = parser.parse_args(argv)
    plan_path = args.autohet_plan
    plan = load_plan(plan_path)
    args.rank, args.world_size = 0, world_size
    # What Megatron-LM prints and warns while it validates is said again by the ranks.
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            validate_args(args, PRETRAIN_GPT_ARGS_DEFAULTS)
        except AssertionError as err:
            raise ConfigError(plan_path, "Megatron-LM's validate_args", str(err) or "refused",
                              "arguments Megatron-LM's own checks accept") from None
        try:
            vocab_size = build_tokenizer(args).vocab_size
        except (AssertionError, OSError, ValueError) as err:
            raise ConfigError(plan_path, "--tokenizer-type", f"Megatron-LM's "
                              f"{args.tokenizer_type} cannot be built: {err}",
                              "a tokenizer with its files (--vocab-file, --merge-file, "
                              "--tokenizer-model), or NullTokenizer") from None
    check_megatron_args(args, plan, plan_path, tokenizer_vocab_size=vocab_size)
    options = train_options(args, plan_path)
    check_datasets(options, plan.model.vocab_size)
    return plan, options


# pretrain_gpt.py's initialize_megatron(args_defaults=...): its tokenizer where none is given.
PRETRAIN_GPT_ARGS_DEFAULTS = {"tokenizer_type": "GPT2BPETokenizer"}


def _refuse_in_one_line(message: str) -> NoReturn:
    """Megatron-LM's parser's own error (an unknown flag, a bad value): one line, not argparse's
    usage block."""
    raise ConfigError("<command line>", "pretrain_gpt.py's arguments", message,
                      "pretrain_gpt.py --help lists them")


def _quiet_other_ranks() -> None:
    """Every process of a job runs the same code, which warns (Python ``warnings``: a missing
    Apex or Transformer Engine, deprecated options) and logs (this package's INFO lines, e.g.
    the CPU mode's): from here on ranks other than 0 ignore Python warnings and this package's
    INFO logging, so each line appears once per job. The warnings megatron-core gives while
    ``pretrain_gpt.py`` imports it are already once per job: stock ``pretrain_gpt.py`` ignores
    ``UserWarning``/``FutureWarning`` on ranks other than 0 before its imports."""
    if int(os.environ.get("RANK", "0")) > 0:
        warnings.simplefilter("ignore")
        logging.getLogger("megatron_autohet").setLevel(logging.WARNING)


def _size_megatron_batch_calculator_for_plans() -> None:
    """Megatron-LM's micro-batch calculator (``set_global_variables``) assumes its own grid:
    data-parallel size = world size / (TP x PP), and asserts ``global batch % (micro batch x
    data-parallel size) == 0``. With a plan the pipelines share the global batch by their
    ``num_microbatches`` (plan validation: global batch = micro batch x all micro-batches), so a
    plan ``autohet train`` runs - global batch 4, micro-batch 2 on 4 ranks - would be refused.
    The calculator is used only by Megatron's own loop, which the plan path replaces: it is given
    a data-parallel size of 1, and counts the plan's micro-batches of all pipelines together."""
    # megatron-core: in the ranks of pretrain_gpt.py only
    import megatron.training.global_vars as global_vars

    original = global_vars.init_num_microbatches_calculator

    def init_for_plan(rank, rampup_batch_size, global_batch_size, micro_batch_size,
                      data_parallel_size, decrease_batch_size_if_needed):
        original(rank, rampup_batch_size, global_batch_size, micro_batch_size, 1,
                 decrease_batch_size_if_needed)

    global_vars.init_num_microbatches_calculator = init_for_plan


def _leave_dashboards_to_the_job() -> None:
    """Megatron-LM's ``set_global_variables`` opens its TensorBoard writer and W&B run on the
    last rank (and imports wandb there, a traceback where it is missing); the plan path's job
    writes both from the rank that logs (runtime/dashboard.py: Megatron's scalar names, the
    flags checked in one line by job.TrainOptions.validate), so Megatron's are not opened: no
    second, empty event file, no second W&B run."""
    # megatron-core: in the ranks of pretrain_gpt.py only
    import megatron.training.global_vars as global_vars

    global_vars._set_tensorboard_writer = lambda args: None
    global_vars._set_wandb_writer = lambda args: None
    # one_logger times Megatron's own train loop, which the plan path replaces; without the
    # package its set-up prints a WARNING line naming NVIDIA's internal package index.
    global_vars._set_one_logger = lambda args: None


def _build_dataset_helpers_for_this_python() -> None:
    """Megatron's first rank builds its dataset helpers at start-up (``compile_helpers``: make in
    megatron/core/datasets), and the Makefile names the library by ``python3-config`` on PATH. A
    venv has no ``python3-config``, so pyenv's answers, from Megatron-LM's ``.python-version``
    (3.12): every run rebuilt a helper for that Python, one this interpreter never imports. The
    build is given this interpreter's extension suffix and include flags instead, as
    scripts/setup_megatron_lm.sh gives them: a no-op once that script has built the helper."""
    # megatron-core: in the ranks of pretrain_gpt.py only
    import megatron.core.datasets.utils as dataset_utils

    def compile_helpers() -> None:
        includes = subprocess.run([sys.executable, "-m", "pybind11", "--includes"],
                                  capture_output=True, text=True, check=True).stdout.strip()
        make = ["make", "-C", str(Path(dataset_utils.__file__).parent),
                f"LIBEXT={sysconfig.get_config_var('EXT_SUFFIX')}", f"CPPFLAGS={includes}"]
        if subprocess.run(make).returncode != 0:
            logging.getLogger(dataset_utils.__name__).error(
                "Failed to compile the C++ dataset helper functions")
            sys.exit(1)

    dataset_utils.compile_helpers = compile_helpers


def _print_help_with_autohet_flags(prog: str) -> None:
    """``pretrain_gpt.py --help`` is answered by the first parse of the command line, the one
    ``maybe_wrap_for_inprocess_restart`` makes without ``extra_args_provider``, so it would not
    list ``--autohet-*``: print Megatron's help with them instead, and exit as argparse does."""
    parser = megatron_parser()
    parser.prog = prog
    parser.print_help()
    sys.exit(0)


def _adapt_megatron_lm_initialization_to_cpu() -> None:
    """Two spots of ``initialize_megatron`` that the CPU mode's device mapping cannot reach:

    * ``_initialize_distributed`` creates Megatron's model-parallel groups only when
      ``torch.cuda.device_count() > 0``, but ``_set_random_seed`` right after it reads the
      pipeline rank: on CPU the same (trivial, TP1 x PP1: ``check_megatron_args``) groups are
      created after the original function;
    * ``_compile_dependencies`` builds the legacy fused CUDA kernels with nvcc: there is no CUDA
      toolkit, and nothing on the plan path uses them, so their loader is skipped.
    """
    # megatron-core: in the ranks of pretrain_gpt.py only
    import megatron.legacy.fused_kernels as fused_kernels
    import megatron.training.initialize as initialize
    from megatron.core import parallel_state as mpu
    from megatron.training import get_args

    original = initialize._initialize_distributed

    def initialize_distributed(get_embedding_ranks, get_position_embedding_ranks, store):
        original(get_embedding_ranks, get_position_embedding_ranks, store)
        if not mpu.model_parallel_is_initialized():
            args = get_args()
            mpu.initialize_model_parallel(
                args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                distributed_timeout_minutes=args.distributed_timeout_minutes,
                get_embedding_ranks=get_embedding_ranks,
                get_position_embedding_ranks=get_position_embedding_ranks)

    initialize._initialize_distributed = initialize_distributed
    fused_kernels.load = lambda args: None


def cpu_mode_on() -> bool:
    """``initialize_megatron(allow_no_cuda=...)``: CUDA is optional once the CPU mode is on."""
    # torch: in the ranks of pretrain_gpt.py only
    from megatron_autohet.runtime.cpu_mode import cpu_mode_enabled

    return cpu_mode_enabled()


def check_megatron_args(args, plan: Plan, plan_path: str | Path,
                        tokenizer_vocab_size: int | None = None) -> None:
    """Megatron's validated flags must describe the plan's model and batch, and ask the runtime
    only for what it does (ConfigError naming the flag). ``tokenizer_vocab_size``: the size of
    the tokenizer Megatron built from ``--tokenizer-type``/``--vocab-size`` (None: not checked)."""
    model = plan.model

    def expect(flag: str, got, want, why: str = "the plan's value") -> None:
        if got != want:
            raise ConfigError(plan_path, flag, f"Megatron-LM was given {got!r} but the plan has "
                              f"{want!r}", f"{want!r} ({why})")

    expect("--tensor-model-parallel-size", args.tensor_model_parallel_size, 1,
           "the plan sets each stage's TP degree")
    expect("--pipeline-model-parallel-size", args.pipeline_model_parallel_size, 1,
           "the plan sets each pipeline's stages")
    expect("WORLD_SIZE", args.world_size, plan.world_size, "one process per planned GPU")
    expect("--num-layers", args.num_layers, model.num_layers)
    expect("--hidden-size", args.hidden_size, model.hidden_size)
    expect("--num-attention-heads", args.num_attention_heads, model.num_attention_heads)
    expect("--ffn-hidden-size", args.ffn_hidden_size, model.ffn_hidden_size)
    query_groups = args.num_query_groups if args.group_query_attention else args.num_attention_heads
    expect("--num-query-groups", query_groups, model.num_query_groups)
    expect("--swiglu", bool(args.swiglu), model.gated_linear_unit)
    expect("--normalization", args.normalization, model.normalization,
           "the plan's model: RMSNorm with SwiGLU, LayerNorm without")
    expect("--disable-bias-linear", not args.add_bias_linear, not model.linear_biases,
           "the plan's model: no linear biases with SwiGLU, biases without")
    expect("--position-embedding-type", args.position_embedding_type,
           model.position_embedding_type)
    expect("--untie-embeddings-and-output-weights", bool(args.untie_embeddings_and_output_weights),
           not model.tie_embeddings)
    expect("--seq-length", args.seq_length, plan.seq_length)
    expect("--max-position-embeddings", args.max_position_embeddings, model.seq_length,
           "the plan's model's seq_length, the rows of its position embedding")
    if tokenizer_vocab_size is not None and tokenizer_vocab_size != model.vocab_size:
        flag = "--vocab-size" if args.vocab_size is not None else "--tokenizer-type"
        raise ConfigError(plan_path, flag, f"Megatron-LM's {args.tokenizer_type} has "
                          f"{tokenizer_vocab_size} tokens but the plan's model has "
                          f"vocab_size {model.vocab_size}",
                          f"a tokenizer of {model.vocab_size} tokens (NullTokenizer: --vocab-size "
                          f"{model.vocab_size - 1}, the EOD token is added)")
    check_recompute_args(args, plan, plan_path)
    expect("--micro-batch-size", args.micro_batch_size, plan.micro_batch_size)
    expect("--global-batch-size", args.global_batch_size, plan.global_batch_size)
    expect("--optimizer", args.optimizer, "adam", "the plan runtime trains with AdamW")
    # --decoupled-lr lives in megatron's own param groups (max_lr of embedding/output groups),
    # which the runtime's two weight-decay groups do not reproduce: refuse, don't ignore it.
    for flag, value in (("--decoupled-lr", args.decoupled_lr),
                        ("--decoupled-min-lr", args.decoupled_min_lr)):
        if value is not None:
            raise ConfigError(plan_path, flag, f"got {value}",
                              "not set (one learning rate for all parameters with a plan)")
    if not args.train_iters:
        raise ConfigError(plan_path, "--train-iters", "missing",
                          "an iteration count (--train-samples is not supported with a plan)")
    if args.lr is None:
        raise ConfigError(plan_path, "--lr", "missing", "a peak learning rate > 0")


# What the plan's activation_recompute means in megatron-core's TransformerConfig
# (runtime/stage_model.py recompute_config): full recompute of every layer.
_FULL_RECOMPUTE = {"--recompute-granularity": ("recompute_granularity", "full"),
                   "--recompute-method": ("recompute_method", "uniform"),
                   "--recompute-num-layers": ("recompute_num_layers", 1)}


def check_recompute_args(args, plan: Plan, plan_path: str | Path) -> None:
    """Megatron's recompute flags either say nothing (the plan decides) or say what the plan's
    ``activation_recompute`` does; selective recompute (``--recompute-activations``) is not
    priced by the planner and is refused."""
    given = {flag: getattr(args, attr) for flag, (attr, _) in _FULL_RECOMPUTE.items()}
    if all(value is None for value in given.values()):
        return
    for flag, (_, want) in _FULL_RECOMPUTE.items():
        if not plan.activation_recompute:
            if given[flag] is not None:
                raise ConfigError(plan_path, flag, f"{given[flag]!r}, but the plan has "
                                  "activation_recompute false", "not set (the plan decides "
                                  "recompute: autohet plan --recompute on)")
        elif given[flag] not in (None, want):
            raise ConfigError(plan_path, flag, f"{given[flag]!r}, but the plan's "
                              "activation_recompute is megatron-core's full recompute of every "
                              f"layer", f"{want!r} or not set")


# TrainOptions fields whose Megatron-LM flag is spelled unlike `autohet train`'s (job.FLAGS).
MEGATRON_FLAGS = {"iters": "--train-iters", "metrics_jsonl": "--autohet-metrics-jsonl"}


def train_options(args, plan_path: str | Path) -> TrainOptions:
    """Megatron-LM's validated flags as the job's options, validated as ``autohet train``'s are
    (job.TrainOptions.validate, errors naming Megatron's flag and the plan file). Megatron's
    ``--lr-*`` schedule flags are not among them: its own scheduler reads them
    (:func:`pretrain_from_plan`)."""
    checkpoint = CheckpointOptions(save=args.save, save_interval=args.save_interval,
                                   load=args.load, async_save=bool(args.async_save),
                                   ckpt_step=args.ckpt_step,
                                   no_load_optim=bool(args.no_load_optim),
                                   no_load_rng=bool(args.no_load_rng),
                                   finetune=bool(args.finetune),
                                   exit_on_missing_checkpoint=bool(
                                       args.exit_on_missing_checkpoint),
                                   **tier_fields(args))
    optimizer = OptimizerSettings(
        lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
        clip_grad=args.clip_grad,
        # Megatron's scheduler applies these two itself; here they are checked against --load
        override_opt_param_scheduler=bool(args.override_opt_param_scheduler),
        use_checkpoint_opt_param_scheduler=bool(args.use_checkpoint_opt_param_scheduler))
    return TrainOptions(
        iters=args.train_iters, seed=args.seed, optimizer=optimizer,
        metrics_jsonl=args.autohet_metrics_jsonl, data_path=args.data_path or None,
        train_data_path=args.train_data_path or None,
        valid_data_path=args.valid_data_path or None,
        test_data_path=args.test_data_path or None,
        data_dir=args.autohet_data_dir, checkpoint=checkpoint, exit_interval=args.exit_interval,
        exit_signal_handler=bool(args.exit_signal_handler),
        distributed_timeout_minutes=args.distributed_timeout_minutes,
        eval_interval=args.eval_interval, eval_iters=args.eval_iters,
        # With --data-path, Megatron's validate_args has already set its default --split.
        split=args.split, distributed_optimizer=bool(args.use_distributed_optimizer),
        overlap_grad_reduce=bool(args.overlap_grad_reduce),
        # fp32 without --bf16, as Megatron-LM (--fp16 never gets here: megatron/flags.py
        # refuses it before Megatron starts)
        precision="bf16" if getattr(args, "bf16", False) else "fp32",
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        # As Megatron-LM's core_transformer_config_from_args: the activation's own flag.
        bias_activation_fusion=bool(args.bias_swiglu_fusion if args.swiglu
                                    else args.bias_gelu_fusion),
        bias_dropout_fusion=bool(args.bias_dropout_fusion),
        log_interval=args.log_interval, **measure_fields(args),
        dashboard=dashboard_options(args)
    ).validate(str(plan_path), MEGATRON_FLAGS,
               # plan_switch.train_adapting's switch stops the iteration loop: Megatron-LM's here
               no_replan="with pretrain_gpt.py --autohet-plan: Megatron-LM's training loop "
                         "owns the iterations (autohet train switches plans)")


def recorded_args(args) -> dict:
    """What a checkpoint records of the job (plain values; ``autohet checkpoint ls`` shows them):
    Megatron's schedule flags, which its scheduler reads, rather than the options'."""
    return {"train_iters": args.train_iters, "seed": args.seed, "data_path": args.data_path,
            "lr": args.lr, "min_lr": args.min_lr, "lr_decay_style": args.lr_decay_style,
            "lr_warmup_iters": args.lr_warmup_iters, "lr_decay_iters": args.lr_decay_iters,
            "weight_decay": args.weight_decay}


def stop_job(err: ConfigError) -> NoReturn:
    """End the job on an error that every rank reached alike (the same flags and plan, a resume
    step the ranks agreed on): rank 0 prints its one line as argparse would, and every rank exits
    with status 2 - not one traceback per rank. The barrier keeps the others alive until rank 0
    has printed: torchrun kills the rest of a job as soon as one rank has exited."""
    # torch: in the ranks of pretrain_gpt.py only
    import torch.distributed as dist

    if dist.get_rank() == 0:
        print(f"{Path(sys.argv[0]).name}: error: {err}", file=sys.stderr, flush=True)
    dist.barrier()
    sys.exit(2)


def pretrain_from_plan(args) -> None:
    """Train ``args.train_iters`` iterations of the plan after ``initialize_megatron``: the job
    ``autohet train`` runs (job.train_job), with Megatron's learning-rate scheduler."""
    # torch, megatron-core: in the ranks of pretrain_gpt.py only
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from megatron.training import get_tokenizer
    from megatron.training.training import get_optimizer_param_scheduler

    plan_path = args.autohet_plan
    try:
        plan = load_plan(plan_path)
        check_megatron_args(args, plan, plan_path, tokenizer_vocab_size=get_tokenizer().vocab_size)
        options = train_options(args, plan_path)
        check_datasets(options, plan.model.vocab_size)
    except ConfigError as err:
        stop_job(err)
    # Megatron's homogeneous groups are replaced by the plan's (build_parallel_state installs
    # this rank's heterogeneous values in megatron.core.parallel_state).
    mpu.destroy_model_parallel()
    try:
        # Megatron-LM's own warm-up/decay and weight-decay schedule steps our param_groups by
        # the samples of each iteration, as Megatron's train_step does; its state (in samples)
        # is what a checkpoint saves and a resume loads back.
        train_job(plan, str(plan_path), plan.model, options, rank=dist.get_rank(),
                  local_rank=args.local_rank or 0, make_stop_check=signal_stop_check(options),
                  make_scheduler=get_optimizer_param_scheduler,
                  schedule_flags=MEGATRON_SCHEDULE_FLAGS, recorded_args=recorded_args(args))
    except ConfigError as err:
        # The same on every rank: a --split without the documents it needs, a resume no step
        # can serve (JobConfigError) - one line, every rank exits 2.
        stop_job(err)
