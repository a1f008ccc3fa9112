"""Launching a training job from a plan: checks, local process launch, and the per-rank worker.

Three pieces, used by ``autohet train`` (cli/train.py):

* :func:`load_job` - every check that needs only files, before any process exists: the plan
  loads and validates (ranks, stages, layer cover, TP dividing heads/groups/FFN), and the plan was
  made for the ``--model`` given (every dimension equal; a layer-count mismatch names
  ``model.num_layers``). Errors are :class:`ConfigError` naming the file and field.
* :func:`launch_local` - torchrun on one machine: torch.distributed.elastic's agent starts
  ``plan.world_size`` ranks, ``autohet train --plan P --model M --job-file F`` with ``RANK``/
  ``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_*`` set, and stops the others when one fails. The job's
  options reach the ranks as data: the launcher writes its validated :class:`TrainOptions` to the
  job file (JSON) and every rank reads them from it. Local rank = global rank (one node); a
  multi-node plan run on one machine is the CPU quick start. A bad input only a rank can find
  (a token id beyond the vocabulary, in the rows it reads) is reported once, by the launcher:
  the first rank to find it writes it next to the job file (:func:`report_to_launcher`) and
  exits 2 without printing, the launcher raises it when the ranks have ended.
* :func:`run_worker` - what each rank runs, whether started by :func:`launch_local` or by
  ``torchrun`` on a GPU cluster (multi-node command: docs/runtime.md, "Devices and several
  nodes"). It checks the environment against the plan (``WORLD_SIZE`` = plan ranks; on GPUs
  ``LOCAL_RANK`` = the plan's ``local_rank`` of this rank), picks NCCL + the GPU of
  ``LOCAL_RANK`` among those the process sees (runtime/device.py: one GPU per task works too)
  when this process has a GPU and gloo + the CPU mode otherwise, and trains
  (plan_switch.py ``train_adapting``: job.py's ``train_job``, one generation per plan with
  ``--autohet-adapt replan``),
  stopping on a signal with ``--exit-signal-handler`` (:func:`signal_stop_check`).

It sits above job.py and elastic/ (whose stop check it uses); the elastic workers
(elastic/worker.py) start their ranks their own way and share job.py, not this module.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import tempfile
import uuid
from dataclasses import dataclass, fields, replace
from pathlib import Path

from megatron_autohet.checkpoint.lease import take_job_lease
from megatron_autohet.errors import ConfigError, JobConfigError
from megatron_autohet.job import TrainOptions, init_backend, report_job_config_error
from megatron_autohet.plan import Plan, load_plan
from megatron_autohet.plan_switch import Members, job_members, train_adapting
from megatron_autohet.spec.cluster import Cluster, load_cluster
from megatron_autohet.spec.gpus import load_gpu_catalog
from megatron_autohet.spec.model import ModelSpec, load_model
from megatron_autohet.system.parent_death import exported_parent_pid

# Next to the job file: the first bad-input error a rank found (report_to_launcher).
JOB_ERROR_FILE = "error.json"


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


def job_cluster(options: TrainOptions) -> Cluster | None:
    """The ``--cluster`` file, loaded in the job's GPU catalog; None without one."""
    if options.cluster is None:
        return None
    return load_cluster(options.cluster, load_gpu_catalog(options.gpu_catalog))


def job_gpus(plan: Plan, plan_path: str | Path, options: TrainOptions,
             cluster: Cluster | None = None) -> tuple[tuple[str, int], ...]:
    """The GPUs the job starts a process on, as (node, local rank) by launched rank: the plan's
    ranks, and with ``--cluster`` (adapt replan) every GPU of the cluster file, the plan's
    first (plan_switch.py ``job_members``). ``cluster``: :func:`job_cluster`'s, where the
    caller has loaded it."""
    if options.cluster is None:
        return tuple((r.node, r.local_rank) for r in plan.ranks)
    return job_members(plan, cluster or job_cluster(options), str(plan_path), options.cluster)


def check_env(plan: Plan, plan_path: str | Path, env: DistEnv, gpus: tuple[tuple[str, int], ...],
              *, uses_gpus: bool) -> None:
    """The launched processes must be the job's (:func:`job_gpus`: the plan's ranks, with
    ``--cluster`` the cluster's GPUs), checked before any process group."""
    if env.world_size != len(gpus):
        members = len(gpus) > plan.world_size
        raise ConfigError(plan_path, "ranks", f"the plan has {plan.world_size} ranks"
                          + (f" and --cluster {len(gpus) - plan.world_size} GPUs it leaves idle"
                             if members else "")
                          + f" but the job has WORLD_SIZE={env.world_size} processes",
                          f"launch exactly {len(gpus)} processes (one per "
                          + ("GPU of --cluster)" if members else "planned GPU)"))
    if not 0 <= env.rank < len(gpus):
        raise ConfigError(plan_path, "ranks", f"RANK={env.rank} has no entry",
                          f"0..{len(gpus) - 1}")
    node, planned_local = gpus[env.rank]
    if uses_gpus and env.local_rank != planned_local:
        raise ConfigError(plan_path, f"ranks[{env.rank}].local_rank",
                          f"planned GPU {planned_local} of node {node}, but "
                          f"torchrun gave this rank LOCAL_RANK={env.local_rank}",
                          "start torchrun so global ranks follow the plan's rank order "
                          "(--node-rank in the plan's node order)")


# ---- local launcher ------------------------------------------------------------------------

def launch_local(plan: Plan, plan_path: str | Path, model_path: str | Path,
                 options: TrainOptions, *, gpus_available: int = 0) -> int:
    """Run one rank per planned GPU, ``python -m megatron_autohet.cli.main train --plan
    plan_path --model model_path --job-file F`` where F holds ``options`` (TrainOptions.write),
    under torch.distributed.elastic's agent on this machine (``torchrun --standalone``: the
    launcher elastic jobs use on every node, here with one node and no restarts).

    Returns 0 when every rank exits 0, else the first failing rank's status (the agent stops
    the others). With fewer GPUs than ranks every process runs on the CPU. The ranks die with
    this process, however it ends (kill -9 included: system/parent_death.py). A job that saves
    holds its checkpoints' writer lease from before its ranks start to after they end
    (checkpoint/lease.py); another job's live lease there is a ConfigError naming the flag.
    """
    world = len(job_gpus(plan, plan_path, options))
    run_id = f"autohet-{uuid.uuid4().hex[:8]}"
    lease = None
    if options.checkpoint.saving:
        # Before any rank exists: a second job on these checkpoints is refused in a second, not
        # after its ranks have loaded torch and built the model (checkpoint/lease.py).
        lease = take_job_lease(options.checkpoint,
                               options.checkpoint.save_roots([r.node for r in plan.ranks]),
                               f"autohet train {run_id} on {socket.gethostname()}",
                               with_store=options.checkpoint.s3_uri is not None)
        options = replace(options, checkpoint=replace(options.checkpoint, owner=lease.owner,
                                                      take_over=False))
    # torch: not at `autohet` start-up
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if gpus_available < world:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""     # not enough GPUs: every rank on the CPU
        # N processes share the cores: oversubscribed intra-op threads slow small runs a lot.
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world)))
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=world,
                          run_id=run_id, rdzv_backend="c10d",
                          rdzv_endpoint="127.0.0.1:0", max_restarts=0, monitor_interval=0.1,
                          local_addr="127.0.0.1")
    job_dir = tempfile.mkdtemp(prefix="autohet-job-")
    job_file = os.path.join(job_dir, "options.json")
    options.write(job_file)
    try:
        with exported_parent_pid():     # the ranks die with this launcher (system/parent_death)
            elastic_launch(config, entrypoint=sys.executable)(
                "-m", "megatron_autohet.cli.main", "train", "--plan", str(plan_path),
                "--model", str(model_path), "--job-file", job_file)
    except ChildFailedError as failed:
        reported = Path(job_dir) / JOB_ERROR_FILE
        if reported.is_file():          # the ranks have ended: it is complete
            raise ConfigError(**json.loads(reported.read_text())) from None
        first = min(failed.failures.values(), key=lambda f: f.timestamp)
        return first.exitcode if first.exitcode > 0 else 1
    except SignalException as stopped:
        # The agent passed the signal on to the ranks and waited for them (with
        # --exit-signal-handler they saved the iteration they finished first).
        return 128 + int(stopped.sigval)
    except KeyboardInterrupt:
        return 130
    finally:
        shutil.rmtree(job_dir, ignore_errors=True)
        if lease is not None:           # the ranks are gone: nobody of this job writes any more
            lease.release()
    return 0


def report_to_launcher(err: ConfigError, job_file: str | Path) -> None:
    """A rank's bad-input error for launch_local to raise once (module docstring): written next
    to ``job_file`` by the first rank to find one (created exclusively: later ones are the same
    mistake found elsewhere, or its consequence)."""
    path = Path(job_file).parent / JOB_ERROR_FILE
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        return
    with os.fdopen(fd, "w") as out:
        json.dump({"file": err.file, "field": err.field, "problem": err.problem,
                   "allowed": err.allowed}, out)


# ---- worker --------------------------------------------------------------------------------

def run_worker(plan: Plan, plan_path: str | Path, model: ModelSpec, options: TrainOptions,
               env: DistEnv) -> int:
    """One rank of a job whose ranks are the plan's (torchrun's RANK = the plan rank)."""
    # torch: not at `autohet` start-up
    import torch.distributed as dist

    from megatron_autohet.runtime.cpu_mode import cpu_mode_required
    from megatron_autohet.runtime.device import select_device

    on_cpu = cpu_mode_required()
    cluster = job_cluster(options)
    gpus = job_gpus(plan, plan_path, options, cluster)
    check_env(plan, plan_path, env, gpus, uses_gpus=not on_cpu)
    init_backend(on_cpu)
    if not on_cpu:
        select_device(env.local_rank)
    backend = "gloo" if on_cpu else "nccl"
    members, rank = None, env.rank
    if options.cluster is None:
        dist.init_process_group(backend, rank=env.rank, world_size=env.world_size,
                                timeout=options.timeout)
    else:
        # every GPU of the cluster has a process; the plan's ranks make its group
        store, _, _ = next(dist.rendezvous("env://", timeout=options.timeout))
        types = {(d.node, d.local_rank): d.gpu for d in cluster.devices()}
        members = Members(store, env.rank, gpus, backend, tuple(types[g] for g in gpus))
        rank = members.join_first(plan, options.timeout)
    try:
        train_adapting(plan, str(plan_path), model, options, rank=rank,
                       local_rank=env.local_rank, make_stop_check=signal_stop_check(options),
                       members=members)
    except JobConfigError as err:
        # after a switch (--autohet-adapt replan) the ranks are the new plan's
        return report_job_config_error(err, dist.get_rank())
    finally:
        if dist.is_initialized():       # a GPU a switch left idle has left the group
            dist.destroy_process_group()
    return 0


def signal_stop_check(options: TrainOptions):
    """``--exit-signal-handler``: the ``make_stop_check`` of job.train_job by which every rank
    stops after the same iteration once one got SIGTERM (and saves it, with checkpointing); None
    without the flag. No notice file: that is the elastic workers' (elastic/worker.py)."""
    if not options.exit_signal_handler:
        return None

    def make_stop_check(checkpointer):
        # torch: a rank's code, not the launcher's
        from megatron_autohet.elastic.stop import StopRequests, stop_group

        return StopRequests(stop_group(options.timeout), notice_file=None).check
    return make_stop_check
