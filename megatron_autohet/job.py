"""A training job from a plan, on a process group that exists: options, precision, assembly.

:func:`train_job` wires the pieces together on every rank: the data (identical global batches on
every rank, data/batches.py), the :class:`HeteroTrainer` with megatron-core's learning-rate
scheduler on its optimizer (runtime/optimizer.py ``make_lr_scheduler``, counting samples as
Megatron-LM does, stepped by the global batch size after every iteration), the checkpoint hook
(checkpoint/checkpointer.py) when the job saves or loads, and ``trainer.train_iterations``,
which logs each iteration from rank 0 (the trainer's metrics are the same on every rank).

It is the one assembly of a job. It sits above runtime/ and checkpoint/ (it wires the two
together) and below everything that starts ranks: launch.py (``autohet train``: a plan's ranks
under torchrun), elastic/worker.py (``autohet train --elastic``: the workers agree on a plan
first) and megatron/hooks.py (``pretrain_gpt.py --autohet-plan``: Megatron-LM's ranks, its
learning-rate scheduler). Whoever starts the ranks decides when they stop: it passes the stop
check (elastic/stop.py), which this module does not import.

With ``--autohet-adapt replan`` a job switches plans in its processes: plan_switch.py, above
this module, runs one :func:`train_job` per plan.

:class:`TrainOptions` is the one validation layer of a job's options (with the dataclasses it
holds: runtime/optimizer.py ``OptimizerSettings``, checkpoint/options.py ``CheckpointOptions``):
the front ends translate their flags into it and call :meth:`TrainOptions.validate`, which names
the flag of a bad value as that front end spells it (:data:`FLAGS`).

torch and megatron-core are imported inside the functions that use them: ``autohet train``
imports this module at start-up, long before (and in the launcher, without) any training.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from pathlib import Path

from megatron_autohet.checkpoint.options import CheckpointOptions, check_scheduler_flags
from megatron_autohet.cost_model import plan_profile
from megatron_autohet.data.batches import DataOptions, default_split, open_global_batches
from megatron_autohet.errors import (ConfigError, JobConfigError, check_output_path, positive,
                                     probability)
from megatron_autohet.plan import Plan
from megatron_autohet.profiling.from_run import (priced_entries, profile_from_window,
                                                 save_run_profile)
from megatron_autohet.runtime.dashboard import DashboardOptions, open_dashboard
from megatron_autohet.runtime.optimizer import OptimizerSettings, make_lr_scheduler
from megatron_autohet.runtime.stage_drift import DEFAULT_WINDOW
from megatron_autohet.spec.cluster import Cluster, load_cluster
from megatron_autohet.spec.gpus import load_gpu_catalog
from megatron_autohet.spec.model import ModelSpec
from megatron_autohet.spec.precision import PRECISIONS, TRAINED_PRECISIONS, default_precision

# The flag that sets each checked TrainOptions field, as `autohet train` spells it; the
# Megatron-LM path passes its own spelling where it differs (megatron/hooks.py).
FLAGS = {"iters": "--iters", "metrics_jsonl": "--metrics-jsonl",
         "exit_interval": "--exit-interval", "eval_interval": "--eval-interval",
         "eval_iters": "--eval-iters", "log_interval": "--log-interval",
         "distributed_timeout_minutes": "--distributed-timeout-minutes",
         "precision": "--bf16", "measure_window": "--autohet-measure-window",
         "measured_jsonl": "--autohet-measured-jsonl",
         "measured_profile": "--autohet-measured-profile", "adapt": "--autohet-adapt",
         "gpu_catalog": "--gpu-catalog", "cluster": "--cluster"}
# --autohet-adapt's modes (planner/adapt.py MODES, which this module does not import at start-up:
# the planner loads SCIP) and its default: log the decisions (module doc of planner/adapt.py).
ADAPT_MODES = ("off", "log", "replan")
DEFAULT_ADAPT = "log"
# What --autohet-adapt accepts where replan is refused (pretrain_gpt.py --autohet-plan).
_NO_REPLAN = "off, or log: each window's decision logged, nothing switched"


@dataclass(frozen=True)
class ElasticOptions:
    """What an elastic worker needs beyond a job's options (``autohet train --elastic``,
    elastic/worker.py); ``{node}`` in a path becomes the node's name."""
    cluster: str                        # the cluster file: the nodes the job may get
    notice_file: str | None = None      # the preemption-notice file `autohet watch` writes
    events_jsonl: str | None = None     # the job's events, as JSON lines


@dataclass(frozen=True)
class TrainOptions:
    iters: int
    seed: int
    optimizer: OptimizerSettings
    metrics_jsonl: str | None = None
    # Megatron-LM's dataset flags (data/batches.py DataOptions): --data-path (a prefix or a
    # blend, cut by --split) or a blend per split; none: the built-in corpus
    data_path: list[str] | None = None
    train_data_path: list[str] | None = None
    valid_data_path: list[str] | None = None
    test_data_path: list[str] | None = None
    data_dir: str | None = None
    checkpoint: CheckpointOptions = CheckpointOptions()
    exit_interval: int | None = None
    exit_signal_handler: bool = False   # read by the launcher, which passes the stop check
    distributed_timeout_minutes: float = 10.0
    eval_interval: int | None = None       # Megatron-LM's --eval-interval (None: no evaluation)
    eval_iters: int = 100                  # validation global batches per evaluation
    split: str | None = None               # Megatron-LM's --split (data/batches.default_split)
    distributed_optimizer: bool = False        # --use-distributed-optimizer
    # --overlap-grad-reduce: each gradient bucket synced during the last micro-batch's backward
    overlap_grad_reduce: bool = False
    precision: str | None = None        # "bf16" or "fp32"; None: bf16 on CUDA GPUs, fp32 on CPU
    hidden_dropout: float = 0.0         # Megatron-LM's --hidden-dropout / --attention-dropout
    attention_dropout: float = 0.0
    # megatron-core's bias + activation and bias + dropout + add fusions, on CUDA GPUs where
    # torch.compile works (runtime/fusions.py): on unless Megatron-LM's --no-bias-gelu-fusion /
    # --no-bias-swiglu-fusion / --no-bias-dropout-fusion
    bias_activation_fusion: bool = True
    bias_dropout_fusion: bool = True
    log_interval: int = 1               # Megatron-LM's --log-interval (autohet train: every one)
    # Every this many iterations the stages' measured times are gathered and compared with the
    # plan's predictions (runtime/stage_drift.py; 0: not measured), each window to the JSONL.
    measure_window: int = DEFAULT_WINDOW
    measured_jsonl: str | None = None
    # The profile the windows give (profiling/from_run.py), rewritten at every window's end.
    measured_profile: str | None = None
    # At every window's end, whether to re-plan on what was measured (planner/adapt.py): off,
    # log (the decision logged, nothing switched) or replan (the switch made: train_adapting).
    adapt: str = DEFAULT_ADAPT
    # The GPU catalog the adaptation and the measured profile price the plan's types in, as
    # `autohet plan --gpu-catalog` planned them (None: the bundled configs/gpus.yaml).
    gpu_catalog: str | None = None
    elastic: ElasticOptions | None = None   # None: a job whose ranks are the plan's
    # With adapt replan (not elastic): the cluster file the plan was made for; each of its GPUs
    # the plan leaves idle gets a process waiting as a member, which a re-plan may give work
    # (plan_switch.py ``Members``). None: processes for the plan's GPUs only.
    cluster: str | None = None
    # TensorBoard and W&B (runtime/dashboard.py), written by the rank that logs
    dashboard: DashboardOptions = DashboardOptions()

    @property
    def jit_fusions(self) -> dict[str, bool]:
        """The fusions requested, as runtime/fusions.py's TransformerConfig field names."""
        return {"bias_activation_fusion": self.bias_activation_fusion,
                "bias_dropout_fusion": self.bias_dropout_fusion}

    @property
    def timeout(self) -> timedelta:
        return timedelta(minutes=self.distributed_timeout_minutes)

    def write(self, path: str | Path) -> None:
        """The options as data (JSON), for the ranks of a job: ``autohet train``'s launcher and
        ``autohet node`` write them once and every rank reads them (:meth:`read`), not a command
        line to parse again."""
        Path(path).write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def read(cls, path: str | Path) -> "TrainOptions":
        """The options :meth:`write` wrote (validated by the launcher that wrote them)."""
        data = json.loads(Path(path).read_text())
        return cls(**{**data, "optimizer": OptimizerSettings(**data["optimizer"]),
                      "checkpoint": CheckpointOptions(**data["checkpoint"]),
                      "dashboard": DashboardOptions(**data["dashboard"]),
                      "elastic": data["elastic"] and ElasticOptions(**data["elastic"])})

    def validate(self, source: str = "<command line>", flags: dict | None = None, *,
                 no_replan: str | None = None) -> "TrainOptions":
        """Every value of the job's options, before any process exists: ConfigError naming the
        flag (``flags``: the front end's spelling of :data:`FLAGS`, ``source``: its input) with
        the optimizer's and the checkpoints' own checks; returns the options. ``no_replan``:
        why this front end refuses ``--autohet-adapt replan`` (pretrain_gpt.py's: Megatron-LM's
        loop owns the iterations); a job without a checkpoint location refuses it too (the
        switch moves the state through it)."""
        flags = {**FLAGS, **(flags or {})}
        positive(self.iters, flags["iters"], source)
        # probability(): "<command line>", both front ends' dropout flags are spelled alike
        probability(self.hidden_dropout, "--hidden-dropout")
        probability(self.attention_dropout, "--attention-dropout")
        if self.precision is not None and self.precision not in TRAINED_PRECISIONS:
            raise ConfigError(source, flags["precision"], f"got precision {self.precision!r}",
                              ", ".join(TRAINED_PRECISIONS))
        check_output_path(self.metrics_jsonl, flags["metrics_jsonl"])
        check_output_path(self.measured_jsonl, flags["measured_jsonl"])
        if not (isinstance(self.measure_window, int) and self.measure_window >= 0):
            raise ConfigError(source, flags["measure_window"], f"got {self.measure_window!r}",
                              "iterations per measurement window, >= 1 (0: not measured)")
        check_output_path(self.measured_profile, flags["measured_profile"])
        if self.measured_profile is not None and not self.measure_window:
            raise ConfigError(source, flags["measured_profile"], "needs measurement windows, "
                              f"and {flags['measure_window']} is 0",
                              f"{flags['measure_window']} >= 1 with it")
        if self.adapt not in ADAPT_MODES:
            raise ConfigError(source, flags["adapt"], f"got {self.adapt!r}",
                              ", ".join(ADAPT_MODES))
        if self.adapt == "replan":
            self._check_replan(source, flags, no_replan)
        if self.cluster is not None and (self.adapt != "replan" or not self.measure_window):
            raise ConfigError(source, flags["cluster"], "given to a job that does not re-plan "
                              f"({flags['adapt']} {self.adapt}, {flags['measure_window']} "
                              f"{self.measure_window}): its idle GPUs would only wait",
                              f"{flags['adapt']} replan with measurement windows, or no "
                              f"{flags['cluster']}")
        self._check_catalog(source, flags)
        self.optimizer.validate(train_iters=self.iters, source=source)
        self._check_data(source)
        self.checkpoint.validate(source)
        self.dashboard.validate(source)
        check_scheduler_flags(self.checkpoint,
                              override=self.optimizer.override_opt_param_scheduler,
                              use_checkpoint=self.optimizer.use_checkpoint_opt_param_scheduler,
                              source=source)
        for field in ("exit_interval", "eval_interval", "eval_iters", "log_interval"):
            positive(getattr(self, field), flags[field], source)
        if not self.distributed_timeout_minutes > 0:
            raise ConfigError(source, flags["distributed_timeout_minutes"],
                              f"got {self.distributed_timeout_minutes}", "minutes > 0")
        return self

    def _check_data(self, source: str) -> None:
        """Megatron-LM's rules for its dataset flags: --data-path or a blend per split, not
        both; per split, a training blend, no --split, and a validation blend to evaluate on."""
        per_split = {"--train-data-path": self.train_data_path,
                     "--valid-data-path": self.valid_data_path,
                     "--test-data-path": self.test_data_path}
        given = [flag for flag, paths in per_split.items() if paths]
        if not given:
            return
        if self.data_path:
            raise ConfigError(source, "--data-path", f"given with {given[0]}",
                              "--data-path (cut by --split) or --train-data-path, "
                              "--valid-data-path, --test-data-path, as Megatron-LM")
        if not self.train_data_path:
            raise ConfigError(source, given[0], "given without --train-data-path",
                              "--train-data-path with it (the blend this job trains on)")
        if self.split is not None:
            raise ConfigError(source, "--split", "given with --train-data-path",
                              "no --split: each split is its own blend, as in Megatron-LM")
        if self.eval_interval is not None and not self.valid_data_path:
            raise ConfigError(source, "--eval-interval", "given with --train-data-path and no "
                              "--valid-data-path", "--valid-data-path: the blend to evaluate on")

    @property
    def prices_types(self) -> bool:
        """Whether the job prices its GPU types while it trains: its windows adapt the plan or
        write a measured profile (what ``gpu_catalog`` is for)."""
        return bool(self.measure_window) and (self.adapt != "off"
                                              or self.measured_profile is not None)

    def _check_catalog(self, source: str, flags: dict) -> None:
        """``--gpu-catalog``: a catalog file that loads, for a job that prices its types."""
        if self.gpu_catalog is None:
            return
        if not self.prices_types:
            raise ConfigError(source, flags["gpu_catalog"], "prices nothing: the job neither "
                              f"adapts ({flags['adapt']} off or {flags['measure_window']} 0) "
                              f"nor writes {flags['measured_profile']}",
                              f"{flags['adapt']} log or replan with measurement windows, or "
                              f"{flags['measured_profile']}")
        try:
            load_gpu_catalog(self.gpu_catalog)
        except ConfigError as err:
            raise ConfigError(source, flags["gpu_catalog"], f"{err.file}: {err.field}: "
                              f"{err.problem}", err.allowed) from None

    def _check_replan(self, source: str, flags: dict, no_replan: str | None) -> None:
        """Where ``--autohet-adapt replan`` is refused, in one line (validate's doc)."""
        if no_replan is not None:
            raise ConfigError(source, flags["adapt"], f"replan is not available {no_replan}",
                              _NO_REPLAN)
        if not self.checkpoint.saving:
            # The switch saves the iteration and the new plan recovers it (any plan's step into
            # any other plan): through the job's own checkpoints, not a hidden second copy.
            raise ConfigError(source, flags["adapt"], "replan needs a checkpoint location: "
                              "every rank saves the iteration of a switch and the new plan "
                              "resumes from it", "--save DIR or --autohet-local-ckpt-dir DIR "
                              "(with --save-interval), or log")


def train_args(options: TrainOptions) -> dict:
    """The arguments a checkpoint records (plain values; ``autohet checkpoint ls`` shows them)."""
    return {"iters": options.iters, "seed": options.seed, "data_path": options.data_path,
            "train_data_path": options.train_data_path,
            "valid_data_path": options.valid_data_path,
            "test_data_path": options.test_data_path,
            "optimizer": asdict(options.optimizer), "precision": options.precision,
            "hidden_dropout": options.hidden_dropout,
            "attention_dropout": options.attention_dropout}


def job_precision(options: TrainOptions):
    """The precision the job trains in (spec/precision.py) and why: the flag's, else bf16 on
    CUDA GPUs (what the planner priced the plan for) and fp32 on CPU (bit-comparable proofs),
    with or without the distributed optimizer."""
    if options.precision is not None:
        why = "--bf16" if options.precision == "bf16" else "without --bf16, as Megatron-LM"
        return PRECISIONS[options.precision], why
    # torch: only once a precision has to be chosen (see the module's docstring)
    import torch

    from megatron_autohet.runtime.cpu_mode import cpu_mode_enabled

    on_gpu = torch.cuda.is_available() and not cpu_mode_enabled()
    return default_precision(on_gpu), "the default on " + ("CUDA GPUs" if on_gpu else "CPU")


def report_job_config_error(err: JobConfigError, rank: int) -> int:
    """Every rank raised ``err`` together (a resume no step can serve, ranks that disagree on
    the layer spec...): one line from rank 0, which the barrier lets print before any rank
    exits (torchrun then stops the others); the exit status is 2, as for any bad input."""
    import torch.distributed as dist     # torch: a rank's code (see the module's docstring)

    if rank == 0:
        print(f"autohet train: error: {err}", file=sys.stderr, flush=True)
    dist.barrier()
    return 2


def init_backend(on_cpu: bool) -> None:
    """Before the rank's device and process group: one CUDA work queue, as Megatron-LM's launch
    scripts set and the profiler measures (profiling/measure.py), so tensor-parallel
    communication overlaps compute in order (megatron-core warns without it; CUDA reads it when
    the device is first set; a value the user set stays); megatron-core's CPU mode when this
    process has no GPU."""
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    if on_cpu:
        # torch: a rank's code (see the module's docstring)
        from megatron_autohet.runtime.cpu_mode import enable_cpu_mode
        enable_cpu_mode()


def measure_flags(prefix: str = "") -> list[tuple[tuple[str, ...], dict]]:
    """The flags of the job measuring itself (runtime/stage_drift.py) as (option strings,
    ``add_argument`` keywords), for both front ends; help texts after ``prefix``."""
    return [
        (("--autohet-measure-window",), dict(
            type=int, default=DEFAULT_WINDOW, metavar="W",
            help=prefix + "every W iterations the stages' measured times (medians of each "
                          "rank's compute, P2P waits, gradient sync and optimizer step) are "
                          "gathered once and compared with the plan's predictions: a stage more "
                          "than 10%% off gets one 'measured' line (default "
                          f"{DEFAULT_WINDOW}; 0: not measured)")),
        (("--autohet-measured-jsonl",), dict(
            default=None, metavar="PATH",
            help=prefix + "also write each measurement window (every stage's measured and "
                          "predicted times) as one JSON line to this file")),
        (("--autohet-measured-profile",), dict(
            default=None, metavar="PATH",
            help=prefix + "write what the job measured as a profile (source: measured; an entry "
                          "per GPU type and TP degree of the plan, its per-layer times scaled "
                          "from the entries the plan was priced on to the stages' measured "
                          "times) at every window's end, for `autohet plan --profile`; kept "
                          "over the entries of other GPU types it already holds (.json: JSON, "
                          "else YAML)")),
        (("--autohet-adapt",), dict(
            default=DEFAULT_ADAPT, metavar="MODE",
            help=prefix + "at every window's end re-plan the fleet on what the window measured "
                          "(the GPU types' times, the stragglers) and decide whether switching "
                          "pays back over the iterations left: off; log (the default: one "
                          "'adapt' line per decision, nothing switched); replan (with --save "
                          "or --autohet-local-ckpt-dir, which an elastic job has: the job "
                          "switches to the re-plan in its processes, through a checkpoint of "
                          "the iteration)")),
        (("--gpu-catalog",), dict(
            default=None, metavar="G.yaml",
            help=prefix + "the GPU catalog the adaptation and --autohet-measured-profile price "
                          "the plan's GPU types in, as `autohet plan --gpu-catalog` planned "
                          "them (default: the bundled configs/gpus.yaml; a job on types it "
                          "lacks does not adapt)")),
    ]


def measured_profile_priors(plan: Plan, plan_label: str, options: TrainOptions):
    """With ``options.measured_profile``: the entries the plan was priced on, which the windows
    scale (profiling/from_run.py ``priced_entries``, in ``options.gpu_catalog``); computed on
    every rank before any collective, so a plan it cannot serve stops the job with one line
    (JobConfigError naming the flag). None without the flag."""
    if options.measured_profile is None:
        return None
    try:
        return priced_entries(plan, load_gpu_catalog(options.gpu_catalog), plan_label)
    except ConfigError as err:
        raise JobConfigError(err.file, err.field, err.problem, err.allowed) from None


def measured_profile_sink(plan: Plan, path: str, priors, trainer, precision, then=None):
    """The window sink (runtime/trainer.train_iterations ``on_window``) writing the run's
    profile to ``path`` at every window's end (profiling/from_run.py), with the attention and
    fusions ``trainer``'s layers run and the job's precision; then ``then(report)``."""
    def sink(report) -> None:
        save_run_profile(path, profile_from_window(
            plan, report.stages, priors, precision=precision, attention=trainer.attention,
            fusions=trainer.fusions.config_fields()))
        if then is not None:
            then(report)
    return sink


class _AdaptSink:
    """:func:`adapt_sink`'s window sink: one window's search in flight in a child process
    (planner/adapt_process.py), taken at the next window's end."""

    def __init__(self, options: TrainOptions, search, adapter, then, on_adapt,
                 idle_measured=None):
        self.options, self.search, self.adapter = options, search, adapter
        self.then, self.on_adapt = then, on_adapt
        # what the GPUs the plan leaves idle have measured of themselves so far (or None)
        self.idle_measured = idle_measured or (lambda: None)

    def __call__(self, report) -> None:
        end, switching = report.last_iteration, False
        if self.search.pending is not None:
            first, last = self.search.pending
            window = (report.first_iteration, end)
            try:
                # the gain must hold on this window's measurements too (planner/adapt.py)
                decision = self.adapter.decide(
                    self.search.result(), self.options.iters - end, decided_at=end,
                    confirm=lambda plan: self.search.confirm(report.stages, window, plan,
                                                             self.idle_measured()))
            except ConfigError as err:
                print(f" adapt: iterations {first}-{last} (decided after iteration {end}): no "
                      f"re-plan: {err}", flush=True)
            else:
                print(f" {decision.line()}", flush=True)
                if self.on_adapt is not None:
                    self.on_adapt(decision)
                switching = decision.switch and self.options.adapt == "replan"
        # a window is searched where its decision leaves iterations to switch for (it is taken
        # at the next window's end), and not when the job switches plans here
        if not switching and end + self.options.measure_window < self.options.iters:
            self.search.submit(report.stages, (report.first_iteration, end),
                               self.idle_measured())
        if self.then is not None:
            self.then(report)

    def close(self) -> None:
        self.search.close()


def adapt_sink(plan: Plan, plan_label: str, options: TrainOptions, trainer, precision,
               then=None, on_adapt=None, adapter=None, idle_measured=None):
    """With ``options.adapt`` log or replan and windows: the window sink deciding whether to
    re-plan (planner/adapt.py, on ``adapter``: the hysteresis so far; default a new one), on
    the rank that logs; its owner calls its ``close()`` at the generation's end. Each window's
    search runs in a child process (planner/adapt_process.py) while the job trains the next
    window, and its decision is taken at that next window's end - waiting there for the search
    if it is not done, so the iteration a job switches after depends on its inputs only, never
    on the machine's load - where a qualifying gain must hold on that next window's
    measurements (the re-plan priced there, waited for: no search): the line is printed, the
    decision handed to ``on_adapt`` (an elastic job's ``adapt`` event; replan's switch,
    plan_switch.py); then ``then(report)``. A window
    whose decision would come at or after the job's last iteration is not searched (no
    iteration would be left to switch for), nor the window a job switches plans at. None
    without windows or adapting."""
    if options.adapt not in ("log", "replan") or not options.measure_window:
        return None
    # the planner (pyscipopt, through the search): only a job that adapts loads it
    from megatron_autohet.planner.adapt import Adapter
    from megatron_autohet.planner.adapt_process import ReplanProcess

    catalog = load_gpu_catalog(options.gpu_catalog)
    try:
        priors = priced_entries(plan, catalog, plan_label)
    except ConfigError as err:        # a GPU type neither priced nor in the catalog
        print(f"WARNING: {FLAGS['adapt']} {options.adapt}: not adapting: {err}", flush=True)
        return None
    # an elastic job's cluster file prices its nodes; autohet train's (--cluster) also holds
    # the GPUs the plan leaves idle, each with a process a re-plan may give work
    cluster_file = options.elastic.cluster if options.elastic is not None else options.cluster
    template = load_cluster(cluster_file, catalog) if cluster_file is not None else None
    search = ReplanProcess(plan, priors, catalog=catalog, precision=precision,
                           attention=trainer.attention,
                           fusions=trainer.fusions.config_fields(), template=template,
                           with_idle=options.cluster is not None)
    return _AdaptSink(options, search, adapter if adapter is not None else Adapter(), then,
                      on_adapt, idle_measured)


def measure_fields(args) -> dict:
    """The :class:`TrainOptions` fields of the :func:`measure_flags` in a parsed namespace."""
    return dict(measure_window=args.autohet_measure_window,
                measured_jsonl=args.autohet_measured_jsonl,
                measured_profile=args.autohet_measured_profile, adapt=args.autohet_adapt,
                gpu_catalog=args.gpu_catalog)


def job_dashboard(options: TrainOptions, recorded_args: dict | None = None,
                  continues: dict | None = None):
    """The job's TensorBoard / W&B writers (runtime/dashboard.py ``Dashboard``), None without:
    W&B's config is what a checkpoint records, its default directory ``--save``'s wandb/ (as
    Megatron-LM's); ``continues``: another process's ``Dashboard.handover()`` (a plan switch
    that moves the rank that logs, plan_switch.py)."""
    save = options.checkpoint.save
    return open_dashboard(options.dashboard,
                          config=train_args(options) if recorded_args is None else recorded_args,
                          wandb_dir=str(Path(save) / "wandb") if save else None,
                          continues=continues)


def train_job(plan: Plan, plan_label: str, model: ModelSpec, options: TrainOptions, *, rank: int,
              local_rank: int, make_stop_check=None, make_scheduler=None,
              schedule_flags: dict | None = None, recorded_args: dict | None = None,
              on_window=None, on_adapt=None, adapter=None, dashboard=None,
              cluster: Cluster | None = None, idle_measured=None) -> int:
    """Train on an initialised default process group whose ranks are the plan's; returns the last
    iteration trained. ``make_stop_check(checkpointer)`` (the checkpointer or None) returns the
    ``stop_check`` of runtime/trainer.train_iterations; it is called on every rank right after
    the checkpointer is made (a stop check's process group is made there, collectively).

    The Megatron-LM path brings its own learning-rate schedule: ``make_scheduler(optimizer)``
    (Megatron's ``get_optimizer_param_scheduler``, reading every ``--lr-*`` flag; default: the
    options' schedule), ``schedule_flags`` (which of its flags sets each scheduler field, for a
    resume's mismatch message; default ``autohet train``'s) and ``recorded_args`` (what a
    checkpoint records of the job; default :func:`train_args`).

    ``on_window(report)``: called on rank 0 with every measurement window's
    runtime/stage_drift.py ``WindowReport`` (an elastic job's ``drift`` event), after the
    window's profile is written (``options.measured_profile``, :func:`measured_profile_sink`)
    and the adaptation done (``options.adapt``, :func:`adapt_sink`, on ``adapter``:
    planner/adapt.py's ``Adapter``, a new one by default: the previous window's decision taken,
    this window's search started), whose decisions go to ``on_adapt(decision)`` there (an
    elastic job's ``adapt`` event, replan's switch). ``idle_measured()``: the profile the GPUs
    the plan leaves idle have measured of themselves so far, or None (plan_switch.py
    ``Members.idle_measured``), which each window's re-plan prices their types on.
    ``dashboard`` (runtime/dashboard.py, rank 0's): gets every iteration and the checkpoints'
    lines; its owner closes it. None with ``options.dashboard``: this call opens and closes one
    on rank 0 (an elastic worker passes its own, which its events go to too).
    ``cluster``: the plan's nodes with their zones, on a fleet across zones (an elastic job's):
    the checkpointer's recovery then asks the peers of a rank's own zone first and counts what
    crosses zones (checkpoint/recovery.py); None: no zones."""
    # torch and megatron-core: a rank's code (see the module's docstring)
    from megatron_autohet.runtime.fusions import priced_on_other_fusions
    from megatron_autohet.runtime.stage_model import LAYER_SPECS
    from megatron_autohet.runtime.trainer import (Evaluation, HeteroTrainer, train_iterations,
                                                  validation_batches_needed)

    try:
        # on every rank, before any collective: a plan whose recorded profile does not load
        # stops the job with one line (its re-plans would price on it)
        priced = plan_profile(plan)
    except ConfigError as err:
        raise JobConfigError(plan_label, f"profile.{err.field}", err.problem,
                             err.allowed) from None
    priors = measured_profile_priors(plan, plan_label, options)
    valid_batches = validation_batches_needed(options.iters, options.eval_interval,
                                              options.eval_iters)
    data = DataOptions(seq_length=plan.seq_length, global_batch_size=plan.global_batch_size,
                       num_iterations=options.iters, seed=options.seed,
                       data_path=options.data_path, train_data_path=options.train_data_path,
                       valid_data_path=options.valid_data_path,
                       test_data_path=options.test_data_path, data_dir=options.data_dir,
                       split=default_split(options.split, valid_batches > 0),
                       valid_batches=valid_batches)
    batches, valid = open_global_batches(data, model.vocab_size, local_rank)
    evaluation = (Evaluation(options.eval_interval, options.eval_iters, valid)
                  if valid is not None else None)
    distributed_optimizer = options.distributed_optimizer or plan.use_distributed_optimizer
    overlap_grad_reduce = options.overlap_grad_reduce or plan.overlap_grad_reduce
    precision, why = job_precision(options)
    if rank == 0:
        print(f"training in {precision.name} ({why}): "
              + ("bf16 weights and activations, fp32 main gradients, master weights and Adam "
                 "state" if precision.master_bytes else "fp32 weights, gradients and Adam state"),
              flush=True)
    trainer = HeteroTrainer(plan, model, rank=rank, seed=options.seed,
                            optimizer=options.optimizer, plan_file=plan_label,
                            distributed_optimizer=distributed_optimizer, precision=precision,
                            overlap_grad_reduce=overlap_grad_reduce,
                            hidden_dropout=options.hidden_dropout,
                            attention_dropout=options.attention_dropout,
                            jit_fusions=options.jit_fusions,
                            # a checkpoint to load replaces the initial weights (trainer doc)
                            initialize=options.checkpoint.load is None)
    if rank == 0:
        print(f"layer: {LAYER_SPECS[trainer.layer_spec]}"
              + (f"; {trainer.fusions.describe()}" if trainer.device.type == "cuda" else "")
              + ("; AdamW: torch's fused kernel" if trainer.fused_optimizer else "")
              + ("; gradient sync overlapped with the backward" if overlap_grad_reduce else ""),
              flush=True)
        other = priced_on_other_fusions(priced and priced.fusions, trainer.fusions)
        if other:
            print(f"WARNING: {other}", flush=True)
    if trainer.distributed_optimizer and rank == 0:
        print(trainer.optimizer.summary(), flush=True)
    # Counting samples, as Megatron-LM does (runtime/optimizer.py): checkpoints of this job
    # load into the pretrain_gpt.py path and stock Megatron-LM, and theirs into this job.
    scheduler = (make_scheduler(trainer.optimizer) if make_scheduler else
                 make_lr_scheduler(trainer.optimizer, options.optimizer, options.iters,
                                   plan.global_batch_size))
    own_dashboard = dashboard is None and rank == 0
    if own_dashboard:
        dashboard = job_dashboard(options, recorded_args)
    checkpointer = None
    if options.checkpoint.saving or options.checkpoint.load is not None:
        # torch: a rank's code (see the module's docstring)
        from megatron_autohet.checkpoint.checkpointer import Checkpointer
        ckpt = options.checkpoint
        if ckpt.owner is None and options.elastic is not None:
            # every agent and round of an elastic job holds one lease (torchrun's run id is
            # the job's --job-id)
            ckpt = replace(ckpt, owner=f"autohet node job {os.environ['TORCHELASTIC_RUN_ID']}")
        checkpointer = Checkpointer(ckpt, trainer, scheduler, seed=options.seed,
                                    train_args=(train_args(options) if recorded_args is None
                                                else recorded_args),
                                    schedule_flags=schedule_flags,
                                    keep_lease=(options.elastic is not None
                                                or options.adapt == "replan"),
                                    on_line=dashboard and dashboard.event, cluster=cluster)
    stop_check = make_stop_check(checkpointer) if make_stop_check else None
    adapting = (adapt_sink(plan, plan_label, options, trainer, precision, then=on_window,
                           on_adapt=on_adapt, adapter=adapter, idle_measured=idle_measured)
                 if rank == 0 else None)
    on_window = adapting or on_window
    if priors is not None and rank == 0:
        on_window = measured_profile_sink(plan, options.measured_profile, priors, trainer,
                                          precision, then=on_window)
    try:
        return train_iterations(trainer, batches, scheduler, train_iters=options.iters,
                                scheduler_increment=plan.global_batch_size, log=rank == 0,
                                metrics_jsonl=options.metrics_jsonl, checkpointer=checkpointer,
                                exit_interval=options.exit_interval, stop_check=stop_check,
                                evaluation=evaluation, log_interval=options.log_interval,
                                measure_window=options.measure_window or None,
                                measured_jsonl=options.measured_jsonl, on_window=on_window,
                                dashboard=dashboard)
    finally:
        if adapting is not None:
            adapting.close()
        if own_dashboard and dashboard is not None:
            dashboard.close()
