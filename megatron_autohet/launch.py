"""Launching a training job from a plan: checks, local process launch, and the per-rank worker.

Three pieces, used by ``autohet train`` (cli/train.py):

* :func:`load_job` - every check that needs only files, before any process exists: the plan
  loads and validates (ranks, stages, layer cover, TP dividing heads/groups/FFN), and the plan was
  made for the ``--model`` given (every dimension equal; a layer-count mismatch names
  ``model.num_layers``). Errors are :class:`ConfigError` naming the file and field.
* :func:`launch_local` - torchrun on one machine: torch.distributed.elastic's agent starts
  ``plan.world_size`` copies of the same ``autohet train`` command with ``RANK``/``WORLD_SIZE``/
  ``LOCAL_RANK``/``MASTER_*`` set and stops the others when one fails. Local rank = global rank
  (one node); a multi-node plan run on one machine is the CPU quick start.
* :func:`run_worker` - what each rank runs, whether started by :func:`launch_local` or by
  ``torchrun`` on a GPU cluster (multi-node command: see README "Training from a plan"). It checks
  the environment against the plan (``WORLD_SIZE`` = plan ranks; on GPUs ``LOCAL_RANK`` = the plan's
  ``local_rank`` of this rank), picks NCCL + the GPU of ``LOCAL_RANK`` among those the process sees
  (runtime/device.py: one GPU per task works too) when this process has a GPU and
  gloo + the CPU mode otherwise, opens the data on every rank (identical global batches), builds
  the :class:`HeteroTrainer` with megatron-core's learning-rate scheduler on its optimizer
  (runtime/optimizer.py ``make_lr_scheduler``, counting samples as Megatron-LM does, stepped
  by the global batch size after every iteration) and runs
  ``trainer.train_iterations``, which logs each iteration from rank 0 (the trainer's metrics are
  the same on every rank), with the checkpoint hook (checkpoint/checkpointer.py) when the job
  saves or loads.

It sits above runtime/ and checkpoint/ (it wires the two together), not inside either; elastic
jobs (elastic/worker.py) use its :func:`train_job` too.
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import asdict, dataclass, fields
from datetime import timedelta
from pathlib import Path

from megatron_autohet.checkpoint.options import CheckpointOptions
from megatron_autohet.errors import ConfigError, JobConfigError
from megatron_autohet.plan import Plan, load_plan
from megatron_autohet.runtime.optimizer import OptimizerSettings, make_lr_scheduler
from megatron_autohet.spec.model import ModelSpec, load_model


@dataclass(frozen=True)
class TrainOptions:
    iters: int
    seed: int
    optimizer: OptimizerSettings
    metrics_jsonl: str | None = None
    data_path: str | None = None
    data_dir: str | None = None
    checkpoint: CheckpointOptions = CheckpointOptions()
    exit_interval: int | None = None
    exit_signal_handler: bool = False
    distributed_timeout_minutes: float = 10.0
    eval_interval: int | None = None       # Megatron-LM's --eval-interval (None: no evaluation)
    eval_iters: int = 100                  # validation global batches per evaluation
    split: str | None = None               # Megatron-LM's --split (data/batches.default_split)
    distributed_optimizer: bool = False        # --use-distributed-optimizer
    precision: str | None = None        # "bf16" or "fp32"; None: bf16 on CUDA GPUs, fp32 on CPU
    hidden_dropout: float = 0.0         # Megatron-LM's --hidden-dropout / --attention-dropout
    attention_dropout: float = 0.0

    @property
    def timeout(self) -> timedelta:
        return timedelta(minutes=self.distributed_timeout_minutes)


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int

    @classmethod
    def from_environ(cls) -> "DistEnv | None":
        """The torchrun-style environment, or None when this process is the launcher."""
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            return None
        return cls(rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                   local_rank=int(os.environ.get("LOCAL_RANK", os.environ["RANK"])))


def load_job(plan_path: str | Path, model_path: str | Path) -> tuple[Plan, ModelSpec]:
    """Load and cross-check the plan and the model (no torch, no processes)."""
    plan = load_plan(plan_path)
    model = load_model(model_path)
    planned = plan.model
    # num_layers first: the most common mismatch gets the most specific message.
    names = ["num_layers"] + [f.name for f in fields(ModelSpec) if f.name not in ("num_layers",)]
    for name in names:
        want, got = getattr(model, name), getattr(planned, name)
        if want != got:
            raise ConfigError(plan_path, f"model.{name}",
                              f"the plan was made for {got!r} but {model_path} has {want!r}",
                              f"a plan made for this model (autohet plan --model {model_path})")
    return plan, model


def check_env(plan: Plan, plan_path: str | Path, env: DistEnv, *, uses_gpus: bool) -> None:
    """The launched processes must be the plan's ranks (checked before any process group)."""
    if env.world_size != plan.world_size:
        raise ConfigError(plan_path, "ranks", f"the plan has {plan.world_size} ranks but the job "
                          f"has WORLD_SIZE={env.world_size} processes",
                          f"launch exactly {plan.world_size} processes (one per planned GPU)")
    if not 0 <= env.rank < plan.world_size:
        raise ConfigError(plan_path, "ranks", f"RANK={env.rank} has no entry",
                          f"0..{plan.world_size - 1}")
    planned_local = plan.ranks[env.rank].local_rank
    if uses_gpus and env.local_rank != planned_local:
        raise ConfigError(plan_path, f"ranks[{env.rank}].local_rank",
                          f"planned GPU {planned_local} of node {plan.ranks[env.rank].node}, but "
                          f"torchrun gave this rank LOCAL_RANK={env.local_rank}",
                          "start torchrun so global ranks follow the plan's rank order "
                          "(--node-rank in the plan's node order)")


# ---- local launcher ------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_local(plan: Plan, worker_argv: list[str], *, gpus_available: int = 0) -> int:
    """Run ``python -m megatron_autohet.cli.main *worker_argv`` once per planned rank, under
    torch.distributed.elastic's agent on this machine (``torchrun --standalone``: the launcher
    elastic jobs use on every node, here with one node and no restarts).

    Returns 0 when every rank exits 0, else the first failing rank's status (the agent stops
    the others). With fewer GPUs than ranks every process runs on the CPU.
    """
    import uuid

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    world = plan.world_size
    if gpus_available < world:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""     # not enough GPUs: every rank on the CPU
        # N processes share the cores: oversubscribed intra-op threads slow small runs a lot.
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world)))
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=world,
                          run_id=f"autohet-{uuid.uuid4().hex[:8]}", rdzv_backend="c10d",
                          rdzv_endpoint="127.0.0.1:0", max_restarts=0, monitor_interval=0.1,
                          local_addr="127.0.0.1")
    try:
        elastic_launch(config, entrypoint=sys.executable)(
            "-m", "megatron_autohet.cli.main", *worker_argv)
    except ChildFailedError as failed:
        first = min(failed.failures.values(), key=lambda f: f.timestamp)
        return first.exitcode if first.exitcode > 0 else 1
    except SignalException as stopped:
        # The agent passed the signal on to the ranks and waited for them (with
        # --exit-signal-handler they saved the iteration they finished first).
        return 128 + int(stopped.sigval)
    except KeyboardInterrupt:
        return 130
    return 0


def train_args(options: TrainOptions) -> dict:
    """The arguments a checkpoint records (plain values; ``autohet checkpoint ls`` shows them)."""
    return {"iters": options.iters, "seed": options.seed, "data_path": options.data_path,
            "optimizer": asdict(options.optimizer), "precision": options.precision,
            "hidden_dropout": options.hidden_dropout,
            "attention_dropout": options.attention_dropout}


def job_precision(options: TrainOptions):
    """The precision the job trains in (spec/precision.py) and why: the flag's, else bf16 on
    CUDA GPUs (what the planner priced the plan for) and fp32 on CPU (bit-comparable proofs),
    with or without the distributed optimizer."""
    import torch

    from megatron_autohet.runtime.cpu_mode import cpu_mode_enabled
    from megatron_autohet.spec.precision import default_precision
    from megatron_autohet.spec.precision import PRECISIONS

    if options.precision is not None:
        return PRECISIONS[options.precision], f"--{options.precision}"
    on_gpu = torch.cuda.is_available() and not cpu_mode_enabled()
    return default_precision(on_gpu), "the default on " + ("CUDA GPUs" if on_gpu else "CPU")


# ---- worker --------------------------------------------------------------------------------

def run_worker(plan: Plan, plan_path: str | Path, model: ModelSpec, options: TrainOptions,
               env: DistEnv) -> int:
    """One rank of a job whose ranks are the plan's (torchrun's RANK = the plan rank)."""
    import torch.distributed as dist

    from megatron_autohet.runtime.cpu_mode import cpu_mode_required
    from megatron_autohet.runtime.device import select_device

    on_cpu = cpu_mode_required()
    check_env(plan, plan_path, env, uses_gpus=not on_cpu)
    if not on_cpu:
        select_device(env.local_rank)
    init_backend(on_cpu)
    dist.init_process_group("gloo" if on_cpu else "nccl", rank=env.rank,
                            world_size=env.world_size, timeout=options.timeout)
    try:
        train_job(plan, str(plan_path), model, options, rank=env.rank, local_rank=env.local_rank)
    except JobConfigError as err:
        return report_job_config_error(err, env.rank)
    finally:
        dist.destroy_process_group()
    return 0


def report_job_config_error(err: JobConfigError, rank: int) -> int:
    """Every rank raised ``err`` together (a resume no step can serve, ranks that disagree on
    the layer spec...): one line from rank 0, which the barrier lets print before any rank
    exits (torchrun then stops the others); the exit status is 2, as for any bad input."""
    import torch.distributed as dist

    if rank == 0:
        print(f"autohet train: error: {err}", file=sys.stderr, flush=True)
    dist.barrier()
    return 2


def init_backend(on_cpu: bool) -> None:
    """Before the process group: megatron-core's CPU mode when this process has no GPU."""
    if on_cpu:
        from megatron_autohet.runtime.cpu_mode import enable_cpu_mode
        enable_cpu_mode()


def train_job(plan: Plan, plan_label: str, model: ModelSpec, options: TrainOptions, *, rank: int,
              local_rank: int, make_stop_check=None) -> int:
    """Train on an initialised default process group whose ranks are the plan's; returns the last
    iteration trained. ``make_stop_check(checkpointer)`` (the checkpointer or None) returns the
    ``stop_check`` of runtime/trainer.train_iterations."""
    from megatron_autohet.data.batches import DataOptions, default_split, open_global_batches
    from megatron_autohet.runtime.stage_model import LAYER_SPECS
    from megatron_autohet.runtime.trainer import (Evaluation, HeteroTrainer, train_iterations,
                                                  validation_batches_needed)

    valid_batches = validation_batches_needed(options.iters, options.eval_interval,
                                              options.eval_iters)
    data = DataOptions(seq_length=plan.seq_length, global_batch_size=plan.global_batch_size,
                       num_iterations=options.iters, seed=options.seed,
                       data_path=options.data_path, data_dir=options.data_dir,
                       split=default_split(options.split, valid_batches > 0),
                       valid_batches=valid_batches)
    batches, valid = open_global_batches(data, model.vocab_size, local_rank)
    evaluation = (Evaluation(options.eval_interval, options.eval_iters, valid)
                  if valid is not None else None)
    distributed_optimizer = options.distributed_optimizer or plan.use_distributed_optimizer
    precision, why = job_precision(options)
    if rank == 0:
        print(f"training in {precision.name} ({why}): "
              + ("bf16 weights and activations, fp32 main gradients, master weights and Adam "
                 "state" if precision.master_bytes else "fp32 weights, gradients and Adam state"),
              flush=True)
    trainer = HeteroTrainer(plan, model, rank=rank, seed=options.seed,
                            optimizer=options.optimizer, plan_file=plan_label,
                            distributed_optimizer=distributed_optimizer, precision=precision,
                            hidden_dropout=options.hidden_dropout,
                            attention_dropout=options.attention_dropout)
    if rank == 0:
        print(f"layer: {LAYER_SPECS[trainer.layer_spec]}", flush=True)
    if trainer.distributed_optimizer and rank == 0:
        print(trainer.optimizer.summary(), flush=True)
    # Counting samples, as Megatron-LM does (runtime/optimizer.py): checkpoints of this job
    # load into the pretrain_gpt.py path and stock Megatron-LM, and theirs into this job.
    scheduler = make_lr_scheduler(trainer.optimizer, options.optimizer, options.iters,
                                  plan.global_batch_size)
    checkpointer = None
    if options.checkpoint.saving or options.checkpoint.load is not None:
        from megatron_autohet.checkpoint.checkpointer import Checkpointer
        checkpointer = Checkpointer(options.checkpoint, trainer, scheduler, seed=options.seed,
                                    train_args=train_args(options))
    if make_stop_check is None and options.exit_signal_handler:
        from megatron_autohet.elastic.stop import StopRequests, stop_group

        def make_stop_check(checkpointer):
            return StopRequests(stop_group(options.timeout), notice_file=None).check
    stop_check = make_stop_check(checkpointer) if make_stop_check else None
    return train_iterations(trainer, batches, scheduler, train_iters=options.iters,
                            scheduler_increment=plan.global_batch_size, log=rank == 0,
                            metrics_jsonl=options.metrics_jsonl, checkpointer=checkpointer,
                            exit_interval=options.exit_interval, stop_check=stop_check,
                            evaluation=evaluation)
