"""`autohet train`: train a GPT from a plan.

Run directly, it checks the plan against the model, then starts one local process per planned GPU
(the same command with RANK/WORLD_SIZE/LOCAL_RANK set; gloo on CPU, NCCL when this machine has a
GPU per rank). Started by torchrun (RANK and WORLD_SIZE already set), it is one rank of the job::

    torchrun --nnodes N --node-rank K --nproc-per-node G --master-addr HOST --master-port PORT \\
        -m megatron_autohet.cli.main train --plan plan.yaml --model model.yaml
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from megatron_autohet.checkpoint.inspect import existing_dirs
from megatron_autohet.checkpoint.manifest import (MODEL_FIELDS, committed_steps, model_mismatch,
                                                  read_manifest, step_dir_name)
from megatron_autohet.checkpoint.options import CheckpointOptions, tier_fields, tier_flags
from megatron_autohet.cli._common import (FUSION_FLAGS, check_activation_fusion_flag,
                                          requested_fusions)
from megatron_autohet.cli.megatron_flags import refuse_unknown
from megatron_autohet.data.indexed import check_datasets
from megatron_autohet.data.vocabulary import TokenizerFlags, check_vocabulary
from megatron_autohet.errors import ConfigError
from megatron_autohet.job import (ElasticOptions, TrainOptions, job_precision, measure_fields,
                                  measure_flags)
from megatron_autohet.launch import (DistEnv, job_gpus, launch_local, load_job,
                                     report_to_launcher, run_worker)
from megatron_autohet.plan import check_bf16_support, check_overlap_grad_reduce
from megatron_autohet.runtime.dashboard import dashboard_flags, dashboard_options
from megatron_autohet.spec.cluster import load_cluster
from megatron_autohet.spec.gpus import load_gpu_catalog
from megatron_autohet.system.parent_death import die_with_launcher
from megatron_autohet.runtime.optimizer import (LR_DECAY_STYLES, SCHEDULE_CHOICE, SCHEDULE_FLAGS,
                                                OptimizerSettings, schedule_fields,
                                                schedule_mismatch)

# (dest, option string, default) of every option but --plan/--model: a rank that reads its
# options from --job-file takes no other (it would be ignored).
_OPTIONS: list[tuple[str, str, object]] = []
DEFAULT_ITERS = 10
# The most ranks one machine runs as CPU processes when it has no GPU for each (the local-8
# cluster's plans, the most the quick start and the tests train on one machine): a plan of more
# is a fleet's, to be started on its nodes.
MAX_CPU_RANKS = 8


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "train", help="train a GPT from a plan (one process per planned GPU)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    opts = [
        (("--plan",), dict(required=True, help="plan YAML (from `autohet plan`)")),
        (("--model",), dict(required=True, help="model YAML the plan was made for")),
        (("--train-iters",), dict(type=int, default=None,
                                  help=f"training iterations, as Megatron-LM's flag (default "
                                       f"{DEFAULT_ITERS})")),
        (("--iters",), dict(type=int, default=None,
                            help="the same as --train-iters (its older name here)")),
        (("--log-interval",), dict(type=int, default=1,
                                   help="print the iteration line after every N iterations, as "
                                        "Megatron-LM (default 1; --metrics-jsonl gets every one)")),
        # The plan decides the batch; Megatron-LM's flags are accepted when they say the same.
        (("--micro-batch-size",), dict(type=int, default=None,
                                       help="accepted when equal to the plan's micro_batch_size "
                                            "(the plan decides it)")),
        (("--global-batch-size",), dict(type=int, default=None,
                                        help="accepted when equal to the plan's "
                                             "global_batch_size (the plan decides it)")),
        (("--seed",), dict(type=int, default=1234,
                           help="seed of the initial weights and the data shuffle (default 1234)")),
        # Optimizer and schedule: Megatron-LM's flag names and defaults (runtime/optimizer.py).
        (("--lr",), dict(type=float, default=1e-3,
                         help="peak learning rate, reached after the warm-up (default 1e-3)")),
        (("--min-lr",), dict(type=float, default=0.0,
                             help="learning rate at the end of the decay (default 0.0)")),
        (("--lr-warmup-iters",), dict(type=int, default=0,
                                      help="iterations of linear warm-up from 0 to --lr "
                                           "(default 0)")),
        (("--lr-warmup-fraction",), dict(type=float, default=None,
                                         help="the warm-up as a fraction of --lr-decay-iters "
                                              "(default: of the training iterations), as "
                                              "Megatron-LM; not with --lr-warmup-iters")),
        (("--lr-decay-iters",), dict(type=int, default=None,
                                     help="iterations over which the learning rate decays to "
                                          "--min-lr, warm-up included (default: --iters)")),
        (("--lr-decay-style",), dict(default="linear", choices=list(LR_DECAY_STYLES),
                                     help="decay after the warm-up (default linear, as "
                                          "Megatron-LM)")),
        (("--weight-decay",), dict(type=float, default=0.01,
                                   help="AdamW decoupled weight decay; biases and 1-D parameters "
                                        "(norms) are not decayed, as in Megatron (default 0.01)")),
        (("--clip-grad",), dict(type=float, default=1.0,
                                help="global grad-norm clipping threshold, 0: off (default 1.0)")),
        (("--adam-beta1",), dict(type=float, default=0.9, help="AdamW beta1 (default 0.9)")),
        (("--adam-beta2",), dict(type=float, default=0.999, help="AdamW beta2 (default 0.999)")),
        (("--adam-eps",), dict(type=float, default=1e-8, help="AdamW epsilon (default 1e-8)")),
        (("--use-distributed-optimizer",), dict(
            action="store_true",
            help="shard the fp32 master weights and Adam moments over the replicas holding each "
                 "parameter (reduce-scatter of gradients, all-gather of weights), as "
                 "Megatron-LM's flag; a plan made with it (`autohet plan "
                 "--use-distributed-optimizer`) always trains with it")),
        (("--overlap-grad-reduce",), dict(
            action="store_true",
            help="start each gradient bucket's sync during the last micro-batch's backward, as "
                 "soon as its gradients are final, as Megatron-LM's flag (default off); a plan "
                 "with overlap_grad_reduce always trains with it")),
        # Megatron-LM's precision flags (spec/precision.py, runtime/mixed_precision.py).
        (("--bf16",), dict(action="store_true",
                           help="bf16 mixed precision as Megatron-LM's --bf16: bf16 weights and "
                                "activations, fp32 main gradients (accumulated and all-reduced "
                                "in fp32), fp32 master weights and Adam state. Default on CUDA "
                                "GPUs (the planner prices plans for it); without a GPU the "
                                "default is fp32 (exact comparisons with the reference)")),
        (("--fp16",), dict(action="store_true",
                           help="refused: fp16 needs a dynamic loss scaler, which this runtime "
                                "does not have; use --bf16")),
        # Megatron-LM's dropout flags; off by default here (Megatron's default is 0.1), as
        # LLaMA-style and most large-scale GPT pre-training runs train.
        (("--hidden-dropout",), dict(type=float, default=0.0,
                                     help="dropout probability of the hidden states (after "
                                          "attention and MLP, and of the embeddings), as "
                                          "Megatron-LM's flag (default 0: off)")),
        (("--attention-dropout",), dict(type=float, default=0.0,
                                        help="dropout probability of the attention weights, as "
                                             "Megatron-LM's flag (default 0: off)")),
        *FUSION_FLAGS,
        (("--metrics-jsonl",), dict(default=None,
                                    help="also write one JSON object per iteration to this file")),
        *dashboard_flags(),
        *measure_flags(),
        (("--data-path",), dict(nargs="+", default=None, metavar="[WEIGHT] PREFIX",
                                help="megatron indexed datasets (PREFIX.bin/.idx, token ids < "
                                     "the model's vocab_size, EOD = 0), as Megatron-LM's flag: "
                                     "one prefix, prefixes, or weights and prefixes alternating "
                                     "(0.5 A 0.5 B), blended by megatron-core and cut by "
                                     "--split; default: the built-in corpus (Python "
                                     "standard-library docstrings, byte-level tokens)")),
        *[((f"--{split}-data-path",), dict(nargs="+", default=None, metavar="[WEIGHT] PREFIX",
                                          help=f"the {split} split's own blend, as "
                                               "Megatron-LM's flag (instead of --data-path and "
                                               "--split)"))
          for split in ("train", "valid", "test")],
        (("--split",), dict(default=None,
                             help="Megatron-LM's --split: train,valid,test proportions of the "
                                  "documents (default 100,0,0; 969,30,1 with --eval-interval)")),
        # Megatron-LM's tokenizer flags: the data is tokenized already, they are checked
        # against the model file's vocabulary (data/vocabulary.py).
        (("--tokenizer-type",), dict(default=None, help="the tokenizer the data was written "
                                                        "with; its vocabulary (megatron-core "
                                                        "builds it) must be the model file's "
                                                        "vocab_size")),
        (("--vocab-file",), dict(default=None, help="with --tokenizer-type GPT2BPETokenizer")),
        (("--merge-file",), dict(default=None, help="with --tokenizer-type GPT2BPETokenizer")),
        (("--tokenizer-model",), dict(default=None,
                                      help="with the SentencePiece, HuggingFace and TikToken "
                                           "tokenizer types")),
        (("--vocab-size",), dict(type=int, default=None,
                                 help="with --tokenizer-type NullTokenizer: the vocabulary "
                                      "before the EOD (the model file's vocab_size - 1)")),
        (("--make-vocab-size-divisible-by",), dict(
            type=int, default=None,
            help="accepted when it pads the vocabulary as the runtime does (to a multiple of "
                 "128 x TP, Megatron-LM's default)")),
        (("--eval-interval",), dict(type=int, default=None,
                                    help="evaluate on the validation split after every N "
                                         "iterations, as Megatron-LM (default: never)")),
        (("--eval-iters",), dict(type=int, default=100,
                                 help="validation global batches per evaluation (default 100, "
                                      "as Megatron-LM)")),
        (("--data-dir",), dict(default=None,
                               help="cache of the built-in corpus and the dataset indices "
                                    "(default $AUTOHET_DATA_DIR or ~/.cache/megatron-autohet)")),
        # Checkpoints: Megatron-LM's flag names (checkpoint/options.py explains each).
        (("--save",), dict(default=None,
                           help="checkpoint directory of the job (a filesystem every node "
                                "shares): DIR/iter_NNNNNNN in megatron's torch_dist format")),
        (("--save-interval",), dict(type=int, default=None,
                                    help="save every N iterations (and after the last one)")),
        (("--load",), dict(default=None,
                           help="resume from the newest complete checkpoint in this directory "
                                "(and the local tier); none there: start from scratch")),
        (("--async-save",), dict(action="store_true",
                                 help="write (and upload) checkpoints in the background; "
                                      "training waits only for the copy to host memory, and a "
                                      "save due while the previous one is still being written "
                                      "is skipped (the next interval saves; never the last)")),
        *tier_flags(),
        (("--exit-on-missing-checkpoint",), dict(
            action="store_true",
            help="with --load: stop (one line, status 2) when no complete checkpoint is found, "
                 "instead of training from scratch, as Megatron-LM's flag")),
        (("--ckpt-step",), dict(type=int, default=None,
                                help="with --load: resume from this step (iteration) instead "
                                     "of the newest")),
        (("--no-load-optim",), dict(action="store_true",
                                    help="with --load: do not load the Adam state and the "
                                         "learning-rate schedule (both start fresh; iteration "
                                         "and data position continue)")),
        (("--no-load-rng",), dict(action="store_true",
                                  help="with --load: keep this run's RNG states")),
        (("--finetune",), dict(action="store_true",
                               help="with --load: load the weights only and start at iteration 0 "
                                    "(fresh Adam state, schedule, data position and RNG)")),
        (("--override-opt-param-scheduler",), dict(
            action="store_true",
            help="with --load: a checkpoint whose learning-rate schedule differs continues with "
                 "this run's schedule flags, from its sample count on")),
        (("--use-checkpoint-opt-param-scheduler",), dict(
            action="store_true",
            help="with --load: continue the checkpoint's learning-rate schedule, whatever this "
                 "run's schedule flags say")),
        (("--exit-interval",), dict(type=int, default=None,
                                    help="stop after an iteration that is a multiple of N "
                                         "(saving first), as Megatron-LM's --exit-interval")),
        (("--exit-signal-handler",), dict(
            action="store_true",
            help="on SIGTERM (to the launcher or any rank), stop after the iteration in flight, "
                 "on every rank alike, and save it first, as Megatron-LM's flag (always on with "
                 "--elastic)")),
        (("--distributed-timeout-minutes",), dict(
            type=float, default=10.0,
            help="how long a collective waits for a peer before failing (default 10, as "
                 "Megatron-LM, --elastic too: NCCL starts its communicators in the first "
                 "iteration, recovery ends at different times per rank, a fast pipeline waits "
                 "for a slow one in gradient sync; a dead peer fails collectives at once)")),
        # Elastic jobs on a spot fleet (elastic/worker.py).
        (("--elastic",), dict(action="store_true",
                              help="run as one worker of an elastic job started by `autohet "
                                   "node` (torchrun): discover the fleet present, keep --plan "
                                   "or re-plan for it, recover from the checkpoint tiers, stop "
                                   "cleanly on a signal or a preemption notice")),
        (("--cluster",), dict(default=None,
                              help="with --elastic: the cluster file whose entries describe "
                                   "the nodes the job may get (matched by node name, else by "
                                   "GPU type: bandwidths, prices); with --autohet-adapt "
                                   "replan: the cluster file the plan was made for, whose "
                                   "GPUs the plan leaves idle each get a process waiting for "
                                   "a re-plan to use it")),
        (("--autohet-notice-file",), dict(
            default=None, help="with --elastic: the preemption-notice file `autohet watch` "
                               "writes on this node ('{node}' becomes the node name)")),
        (("--autohet-events-jsonl",), dict(
            default=None, help="with --elastic: append the job's events (fleet, plan, "
                               "recovery, stop, ...) to this file as JSON lines")),
    ]
    _OPTIONS.clear()
    for flags, kwargs in opts:
        action = p.add_argument(*flags, **kwargs)
        if action.dest not in ("plan", "model"):
            _OPTIONS.append((action.dest, flags[0], action.default))
    # Internal: how launch_local's ranks get the job's options, as data (job.TrainOptions.write).
    p.add_argument("--job-file", default=None, help=argparse.SUPPRESS)
    # cli/main.py hands the arguments this parser did not take to refuse_unknown
    p.set_defaults(func=run, refuse_unknown=refuse_unknown)


def run(args: argparse.Namespace) -> int:
    if args.job_file is not None:
        return run_launched_rank(args)
    if args.elastic and "TORCHELASTIC_RUN_ID" not in os.environ:
        raise ConfigError("<command line>", "--elastic", "not started by torchrun",
                          "start elastic jobs with `autohet node` on each node")
    env = DistEnv.from_environ()
    options, plan, model = checked_job(args, launches_here=env is None and not args.elastic)
    if args.elastic:
        return run_elastic(plan, model, options)
    if env is None:
        return launch_local(plan, args.plan, args.model, options, gpus_available=gpu_count())
    return run_worker(plan, args.plan, model, options, env)


def check_runs_here(plan, plan_file: str, count_gpus: Callable[[], int],
                    command: str = "-m megatron_autohet.cli.main train ..., or an elastic job: "
                                   "`autohet node` on each node") -> None:
    """The plan's ranks can run on this one machine (launch.launch_local): one node's plan on a
    GPU each, or at most :data:`MAX_CPU_RANKS` ranks on the CPU (a plan of emulated nodes, as
    the local-N clusters'); else one ConfigError naming the plan's nodes and how to start it on
    them (torchrun's options, then ``command``). This machine's GPUs are counted (``count_gpus``:
    a torch import) only where they decide: a plan of several nodes and more than
    :data:`MAX_CPU_RANKS` ranks runs here on neither, and is refused without them."""
    nodes: dict[str, int] = {}
    for rank in plan.ranks:
        nodes[rank.node] = nodes.get(rank.node, 0) + 1
    if len(nodes) > 1 and plan.world_size > MAX_CPU_RANKS:
        here = f"this machine is one node and runs at most {MAX_CPU_RANKS} ranks on its CPU"
    else:
        gpus = count_gpus()
        on_gpus = gpus >= plan.world_size
        if (on_gpus and len(nodes) == 1) or (not on_gpus and plan.world_size <= MAX_CPU_RANKS):
            return
        here = (f"this machine has {gpus} GPUs and is one node" if on_gpus else
                f"this machine has {gpus} GPUs and runs at most {MAX_CPU_RANKS} ranks on its "
                "CPU")
    listed = ", ".join(f"{node} ({count} GPUs)" for node, count in nodes.items())
    raise ConfigError(plan_file, "ranks", f"the plan's {plan.world_size} ranks are on "
                      f"{len(nodes)} nodes: {listed}; {here}",
                      "the same command on each of the plan's nodes, in its node order: "
                      f"torchrun --nnodes {len(nodes)} --node-rank K --nproc-per-node (that "
                      f"node's GPUs) --master-addr HOST --master-port PORT {command}")


def checked_job(args: argparse.Namespace, launches_here: bool = False):
    """(options, plan, model) of the flags, every value checked: the one validation of a job's
    flags, before any process starts (the launcher's ranks and `autohet node`'s workers read the
    options it returns from a job file); ``launches_here``: also that this machine can run the
    plan's ranks (:func:`check_runs_here`). The checks that import torch or megatron-core come
    last, so the others are decided in a second or two."""
    options = train_options(args).validate(flags={"iters": iters_flag(args)})
    check_elastic(args, options.checkpoint)
    plan, model = load_job(args.plan, args.model)
    check_activation_fusion_flag(args, model)
    check_batch_flags(args, plan, args.plan)
    if not args.elastic:
        check_resume(options.checkpoint, plan, options.optimizer, options.iters, args.model)
    if options.cluster is not None:
        # the plan's GPUs are the cluster's; the others get a process each (launch.py)
        job_gpus(plan, args.plan, options)
    if launches_here:
        check_runs_here(plan, args.plan, gpu_count)
    # megatron-core's tokenizer and index reader, where the flags name them
    check_vocabulary(tokenizer_flags(args), model, args.model,
                     {s.tp for p in plan.pipelines for s in p.stages})
    check_datasets(options, model.vocab_size)
    if job_precision(options)[0].name == "bf16":
        check_bf16_support(plan, load_gpu_catalog(options.gpu_catalog), args.plan)
    if options.overlap_grad_reduce:
        check_overlap_grad_reduce(plan, args.plan)
    return options, plan, model


def iters_flag(args: argparse.Namespace) -> str:
    """The iteration flag given (what a message about the count names)."""
    return "--iters" if args.iters is not None and args.train_iters is None else "--train-iters"


def train_iters(args: argparse.Namespace) -> int:
    """--train-iters, or its older name --iters; both given must agree."""
    if None not in (args.iters, args.train_iters) and args.iters != args.train_iters:
        raise ConfigError("<command line>", "--iters", f"{args.iters}, but --train-iters "
                          f"{args.train_iters}", "one of them (--iters is --train-iters' older "
                          "name)")
    return next((n for n in (args.train_iters, args.iters) if n is not None), DEFAULT_ITERS)


def check_batch_flags(args: argparse.Namespace, plan, plan_file: str) -> None:
    """Megatron-LM's batch flags say what the plan says, or are not given (the plan decides
    the batch: its micro-batches are split over pipelines of different shapes)."""
    for flag, given, planned in (("--micro-batch-size", args.micro_batch_size,
                                  plan.micro_batch_size),
                                 ("--global-batch-size", args.global_batch_size,
                                  plan.global_batch_size)):
        if given is not None and given != planned:
            field = flag[2:].replace("-", "_")
            raise ConfigError("<command line>", flag, f"{given}, but the plan {plan_file} has "
                              f"{field} {planned}", f"{planned} or not set (the plan decides "
                              f"it: `autohet plan --{field.replace('_', '-')}`)")


def tokenizer_flags(args: argparse.Namespace) -> TokenizerFlags:
    return TokenizerFlags(tokenizer_type=args.tokenizer_type, vocab_file=args.vocab_file,
                          merge_file=args.merge_file, tokenizer_model=args.tokenizer_model,
                          vocab_size=args.vocab_size,
                          make_vocab_size_divisible_by=args.make_vocab_size_divisible_by)


def run_elastic(plan, model, options: TrainOptions) -> int:
    """One worker of an elastic job (``options.elastic``: the cluster file is read here, as
    checked before the workers started)."""
    # torch and pyscipopt: only in an elastic worker, not at the command's start-up
    from megatron_autohet.elastic.worker import ElasticWorker

    elastic = options.elastic
    return ElasticWorker(initial_plan=plan, template=load_cluster(elastic.cluster), model=model,
                         options=options, notice_file=elastic.notice_file,
                         events_jsonl=elastic.events_jsonl).run()


def run_launched_rank(args: argparse.Namespace) -> int:
    """A rank launch_local or `autohet node` started: the options are the launcher's, checked
    and written to ``--job-file`` before any rank started; the command line names only the plan
    and model. It dies with the process that started it (system/parent_death.py)."""
    die_with_launcher()
    for dest, flag, default in _OPTIONS:
        if getattr(args, dest) != default:
            raise ConfigError("<command line>", flag, "given with --job-file",
                              "only --plan and --model: a launched rank's options are the job "
                              "file's")
    env = DistEnv.from_environ()
    if env is None:
        raise ConfigError("<command line>", "--job-file", "not in a rank of a job",
                          "only in the ranks `autohet train` and `autohet node` start")
    plan, model = load_job(args.plan, args.model)
    options = TrainOptions.read(args.job_file)
    if options.elastic is not None:
        return run_elastic(plan, model, options)
    try:
        return run_worker(plan, args.plan, model, options, env)
    except ConfigError as err:
        # a check only this rank could make (the token ids it read): launch_local reports it,
        # once for the job
        report_to_launcher(err, args.job_file)
        return 2


class _TrainArgsParser(argparse.ArgumentParser):
    """`autohet node`'s parser of the `autohet train` arguments after ``--``: a bad one is a
    ConfigError (one line, status 2), not argparse's usage text."""

    def error(self, message: str):
        raise ConfigError("<command line>", "-- (the `autohet train` arguments)", message,
                          "`autohet train --help` lists them")


@dataclass(frozen=True)
class NodeJob:
    """The job `autohet node` runs, checked: what its workers get."""
    plan: str
    model: str
    options: TrainOptions

    def write(self, job_dir: str | Path) -> list[str]:
        """The options to a job file in ``job_dir``; returns the workers' arguments, ``train
        --plan P --model M --job-file F`` (their options are the file's: data, not a command
        line to parse again)."""
        job_file = str(Path(job_dir) / "options.json")
        self.options.write(job_file)
        return ["train", "--plan", self.plan, "--model", self.model, "--job-file", job_file]


def node_job(train_args: list[str]) -> NodeJob:
    """`autohet node`'s job: the `autohet train` arguments after ``--`` (``--elastic`` implied)
    parsed and checked here, once, before any worker starts."""
    if train_args[:1] == ["--"]:
        train_args = train_args[1:]
    if not train_args:
        raise ConfigError("<command line>", "--", "no training arguments",
                          "-- followed by `autohet train` arguments (--plan, --model, ...)")
    parser = _TrainArgsParser(prog="autohet node ... --", add_help=False)
    register(parser.add_subparsers())
    args, unknown = parser.parse_known_args(["train", *train_args, "--elastic"])
    if unknown:
        refuse_unknown(unknown)
    if args.job_file is not None:
        raise ConfigError("<command line>", "--job-file", "given after --",
                          "the `autohet train` flags but --job-file (autohet node writes it)")
    options, _, _ = checked_job(args)
    load_cluster(args.cluster)
    return NodeJob(args.plan, args.model, options)


def train_options(args: argparse.Namespace) -> TrainOptions:
    """The job's options from the flags, not yet validated (TrainOptions.validate: the one
    place that checks them); the precision flags are read here (--fp16 is refused)."""
    elastic = (ElasticOptions(cluster=args.cluster, notice_file=args.autohet_notice_file,
                              events_jsonl=args.autohet_events_jsonl) if args.elastic else None)
    return TrainOptions(iters=train_iters(args), seed=args.seed,
                        optimizer=optimizer_settings(args), metrics_jsonl=args.metrics_jsonl,
                        data_path=args.data_path, train_data_path=args.train_data_path,
                        valid_data_path=args.valid_data_path,
                        test_data_path=args.test_data_path, log_interval=args.log_interval,
                        data_dir=args.data_dir, checkpoint=checkpoint_options(args),
                        exit_interval=args.exit_interval,
                        exit_signal_handler=args.exit_signal_handler,
                        distributed_timeout_minutes=args.distributed_timeout_minutes,
                        eval_interval=args.eval_interval, eval_iters=args.eval_iters,
                        split=args.split, distributed_optimizer=args.use_distributed_optimizer,
                        overlap_grad_reduce=args.overlap_grad_reduce,
                        precision=check_precision(args), hidden_dropout=args.hidden_dropout,
                        attention_dropout=args.attention_dropout,
                        **requested_fusions(args), **measure_fields(args),
                        dashboard=dashboard_options(args), elastic=elastic,
                        cluster=None if args.elastic else args.cluster)


def check_precision(args: argparse.Namespace) -> str | None:
    """The precision flag's name, None without one (the worker's default: bf16 on CUDA GPUs,
    fp32 on CPU)."""
    if args.bf16 and args.fp16:
        raise ConfigError("<command line>", "--fp16", "given with --bf16", "one of them")
    if args.fp16:
        raise ConfigError("<command line>", "--fp16", "fp16 mixed precision needs a dynamic "
                          "loss scaler, which this runtime does not have",
                          "--bf16 (or no flag: bf16 on CUDA GPUs, fp32 on CPU)")
    return "bf16" if args.bf16 else None


def check_elastic(args: argparse.Namespace, checkpoint: CheckpointOptions) -> None:
    """--elastic needs a cluster file and a node-local checkpoint tier (and torchrun: checked
    where the worker starts); the elastic flags need --elastic."""
    if not args.elastic:
        # (--cluster without --elastic: adapt replan's idle GPUs, TrainOptions.validate)
        for flag in ("autohet_notice_file", "autohet_events_jsonl"):
            if getattr(args, flag) is not None:
                raise ConfigError("<command line>", "--" + flag.replace("_", "-"),
                                  "given without --elastic", "only with --elastic")
        return
    for flag in ("ckpt_step", "finetune", "no_load_optim", "no_load_rng",
                 "exit_on_missing_checkpoint"):
        if getattr(args, flag) not in (None, False):
            raise ConfigError("<command line>", "--" + flag.replace("_", "-"),
                              "given with --elastic",
                              "not with --elastic (every restart resumes the newest step with "
                              "all its state)")
    if args.cluster is None:
        raise ConfigError("<command line>", "--cluster", "missing with --elastic",
                          "the cluster file describing the nodes the job may get")
    if checkpoint.local_dir is None:
        raise ConfigError("<command line>", "--autohet-local-ckpt-dir", "missing with --elastic",
                          "a node-local checkpoint directory (with --save-interval; add "
                          "--autohet-s3-uri for what no surviving node holds)")


def optimizer_settings(args: argparse.Namespace) -> OptimizerSettings:
    return OptimizerSettings(
        lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
        clip_grad=args.clip_grad, lr_warmup_iters=args.lr_warmup_iters,
        lr_warmup_fraction=args.lr_warmup_fraction,
        lr_decay_iters=args.lr_decay_iters, lr_decay_style=args.lr_decay_style,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler)


def checkpoint_options(args: argparse.Namespace) -> CheckpointOptions:
    """The checkpoint flags (validated with the job's options); an elastic worker always resumes
    from its local tier."""
    load = args.load or (args.autohet_local_ckpt_dir if args.elastic else None)
    return CheckpointOptions(save=args.save, save_interval=args.save_interval, load=load,
                             async_save=args.async_save, ckpt_step=args.ckpt_step,
                             no_load_optim=args.no_load_optim, no_load_rng=args.no_load_rng,
                             finetune=args.finetune,
                             exit_on_missing_checkpoint=args.exit_on_missing_checkpoint,
                             **tier_fields(args))


def check_resume(checkpoint: CheckpointOptions, plan, optimizer: OptimizerSettings | None,
                 iters: int, model_file: str = "--model") -> None:
    """Before any process starts, the step ``--load`` resumes (the newest on this machine whose
    manifest reads, or ``--ckpt-step``): a model of the same shape (``model_file`` against the
    model the step records: a layer, head or vocabulary count that differs would otherwise fail
    every rank's load), the same global batch, and the same learning-rate schedule unless the
    flags say which one wins (megatron-core's scheduler asserts otherwise, on every rank) or the
    schedule is not loaded (--finetune, --no-load-optim); ``optimizer`` None: the schedule is
    Megatron-LM's scheduler's, which its ranks check (``autohet torchrun``). A ``--ckpt-step``
    not committed here is refused unless the S3 tier may hold it (the ranks check that again);
    so is a --load whose every step has an unreadable manifest (one with a readable older step
    resumes that one, and recovery says so). A --load directory that does not exist is refused
    unless the job saves there (its first run); with --exit-on-missing-checkpoint, a --load
    without a committed step here (nor where the job saves: recovery reads there too) is refused
    now, unless the S3 tier may hold one (the ranks decide then)."""
    if not checkpoint.load:
        return
    roots = existing_dirs(checkpoint.load)
    saves_there = checkpoint.load in (checkpoint.save, checkpoint.local_dir)
    if not roots and not saves_there and checkpoint.s3_uri is None:
        raise ConfigError("<command line>", "--load", f"{checkpoint.load} does not exist",
                          "a checkpoint directory, or the directory this job saves to (a "
                          "first run starts from scratch there)")
    steps = sorted(((it, root / step_dir_name(it)) for root in roots
                    for it in committed_steps(root)), reverse=True)
    if checkpoint.exit_on_missing_checkpoint and checkpoint.s3_uri is None:
        saved = [root for location in (checkpoint.save, checkpoint.local_dir) if location
                 for root in existing_dirs(location) if committed_steps(root)]
        if not steps and not saved:
            # the line the ranks' recovery would print (checkpoint/checkpointer.py)
            raise ConfigError("<command line>", "--load",
                              f"no complete checkpoint in {checkpoint.load}",
                              "a directory holding one, as --exit-on-missing-checkpoint is set")
    if checkpoint.ckpt_step is not None:
        chosen = [(it, step) for it, step in steps if it == checkpoint.ckpt_step]
        if not chosen:
            if checkpoint.s3_uri is not None:
                return
            raise ConfigError("<command line>", "--ckpt-step",
                              f"no committed step {checkpoint.ckpt_step} in {checkpoint.load}",
                              "one of the committed steps: "
                              + (", ".join(map(str, sorted({it for it, _ in steps}))) or "none"))
        steps = chosen
    found, unreadable = None, None
    for _, step in steps:
        try:
            found = step, read_manifest(step)
            break
        except ValueError as err:            # names the file; an older step may do
            unreadable = unreadable or err
    if found is None:
        if unreadable is not None and checkpoint.s3_uri is None:
            raise ConfigError("<command line>", "--load", str(unreadable),
                              "a directory with a complete checkpoint step")
        return
    step, manifest = found
    mismatch = model_mismatch(manifest.model, plan.model.to_dict())
    if mismatch is not None:
        field, value, saved = mismatch
        raise ConfigError(model_file, field, f"{value!r}, but {step} was saved from a model "
                          f"with {saved!r}{MODEL_FIELDS[field]}",
                          "the model the checkpoint was saved from, or a --load directory of "
                          "this model's checkpoints")
    saved_batch = manifest.plan.get("global_batch_size")
    if saved_batch is not None and saved_batch != plan.global_batch_size \
            and not checkpoint.finetune:
        raise ConfigError("<command line>", "--plan", f"global batch {plan.global_batch_size}, "
                          f"but {step} was trained with {saved_batch}",
                          "a plan with the checkpoint's global batch (a resume continues the "
                          "same sequence of global batches)")
    if optimizer is None or not checkpoint.load_optim \
            or optimizer.override_opt_param_scheduler \
            or optimizer.use_checkpoint_opt_param_scheduler:
        return
    mismatch = schedule_mismatch(schedule_fields(optimizer, iters, plan.global_batch_size),
                                 manifest.extra.get("opt_param_scheduler") or {})
    if mismatch is not None:
        field, value, saved = mismatch
        raise ConfigError("<command line>", SCHEDULE_FLAGS[field],
                          f"this run's learning-rate schedule has {field} {value}, "
                          f"{step} was trained with {saved}", SCHEDULE_CHOICE)


def gpu_count() -> int:
    """The CUDA GPUs this process sees, as torch counts them: ``CUDA_VISIBLE_DEVICES`` honoured,
    and a machine without nvidia-smi still counts its GPUs. Called at launch, which imports
    torch's elastic agent next anyway; bad flags are refused before torch is imported."""
    # torch: not at `autohet` start-up
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
