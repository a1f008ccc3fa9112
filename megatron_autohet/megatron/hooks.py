"""What the Megatron-LM patch calls: run ``pretrain_gpt.py --autohet-plan plan.yaml`` on our runtime.

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
  different depth and TP degree. So after initialisation :func:`pretrain_from_plan` runs the
  plan's :class:`HeteroTrainer` (parallel_state from the plan, stage model, hetero P2P + 1F1B,
  layer-wise grad sync) on the same global batches ``autohet train`` uses, and logs Megatron's
  iteration line.

Before anything runs, :func:`check_megatron_args` checks Megatron's flags against the plan (model
dimensions, batch sizes, sequence length, world size, trivial Megatron grid) and raises
:class:`ConfigError` naming the flag.
"""

from __future__ import annotations

import sys
from pathlib import Path

from megatron_autohet.errors import ConfigError
from megatron_autohet.plan import Plan, load_plan
from megatron_autohet.runtime.optimizer import OptimizerSettings


def prepare_process(argv: list[str] | None = None) -> None:
    """Called at the top of ``pretrain_gpt.py``'s main: turn on the CPU mode for a plan job on a
    machine without a usable GPU (Megatron-LM then runs on gloo: ``--distributed-backend gloo``)."""
    argv = sys.argv if argv is None else argv
    if not any(a == "--autohet-plan" or a.startswith("--autohet-plan=") for a in argv):
        return
    from megatron_autohet.runtime.cpu_mode import cpu_mode_required, enable_cpu_mode

    if cpu_mode_required():
        enable_cpu_mode()
        _adapt_megatron_lm_initialization_to_cpu()


def _adapt_megatron_lm_initialization_to_cpu() -> None:
    """Two spots of ``initialize_megatron`` that the CPU mode's device mapping cannot reach:

    * ``_initialize_distributed`` creates Megatron's model-parallel groups only when
      ``torch.cuda.device_count() > 0``, but ``_set_random_seed`` right after it reads the
      pipeline rank: on CPU the same (trivial, TP1 x PP1: ``check_megatron_args``) groups are
      created after the original function;
    * ``_compile_dependencies`` builds the legacy fused CUDA kernels with nvcc: there is no CUDA
      toolkit, and nothing on the plan path uses them, so their loader is skipped.
    """
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
    from megatron_autohet.runtime.cpu_mode import cpu_mode_enabled

    return cpu_mode_enabled()


def check_megatron_args(args, plan: Plan, plan_path: str | Path) -> None:
    """Megatron's flags must describe the plan's model and batch (ConfigError naming the flag)."""
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
    expect("--position-embedding-type", args.position_embedding_type,
           model.position_embedding_type)
    expect("--untie-embeddings-and-output-weights", bool(args.untie_embeddings_and_output_weights),
           not model.tie_embeddings)
    expect("--seq-length", args.seq_length, plan.seq_length)
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
    if args.data_path and len(args.data_path) != 1:
        raise ConfigError(plan_path, "--data-path", f"got {args.data_path}",
                          "one indexed-dataset prefix (blends are not supported with a plan)")


def pretrain_from_plan(args) -> None:
    """Train ``args.train_iters`` iterations of the plan after ``initialize_megatron``."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from megatron.training.training import get_optimizer_param_scheduler

    from megatron_autohet.data.batches import DataOptions, open_global_batches
    from megatron_autohet.runtime.trainer import HeteroTrainer, train_iterations

    plan_path = args.autohet_plan
    plan = load_plan(plan_path)
    check_megatron_args(args, plan, plan_path)
    rank = dist.get_rank()
    data = DataOptions(seq_length=plan.seq_length, global_batch_size=plan.global_batch_size,
                       num_iterations=args.train_iters, seed=args.seed,
                       data_path=args.data_path[0] if args.data_path else None,
                       data_dir=args.autohet_data_dir)
    batches = open_global_batches(data, plan.model.vocab_size, args.local_rank or 0)
    # Megatron's homogeneous groups are replaced by the plan's (build_parallel_state installs
    # this rank's heterogeneous values in megatron.core.parallel_state).
    mpu.destroy_model_parallel()
    # The schedule fields of OptimizerSettings stay unused here: Megatron's scheduler runs it.
    optimizer = OptimizerSettings(lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
                                  adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2,
                                  adam_eps=args.adam_eps, clip_grad=args.clip_grad)
    trainer = HeteroTrainer(plan, plan.model, rank=rank, seed=args.seed, optimizer=optimizer,
                            plan_file=str(plan_path))
    # Megatron-LM's own warm-up/decay and weight-decay schedule, stepping our param_groups by
    # the samples of each iteration, as Megatron's train_step does.
    scheduler = get_optimizer_param_scheduler(trainer.optimizer)
    train_iterations(trainer, batches, scheduler, train_iters=args.train_iters,
                     scheduler_increment=plan.global_batch_size, log=rank == 0,
                     metrics_jsonl=args.autohet_metrics_jsonl)
