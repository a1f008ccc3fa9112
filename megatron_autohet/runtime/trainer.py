"""One training iteration of a heterogeneous plan on this rank: schedule, grad sync, optimizer.

:class:`HeteroTrainer` builds everything a rank needs from the plan (parallel state, its stage of
megatron-core's ``GPTModel``, the layer-wise :class:`~megatron_autohet.runtime.grad_sync.GradSync`,
the optimizer) and :meth:`HeteroTrainer.train_step` runs one iteration on a global batch, returning
:class:`StepMetrics` that are identical on every rank. :func:`train_iterations` is a job's loop
over it (scheduler step and Megatron's log line per iteration, evaluation every
``Evaluation.interval`` iterations), for ``autohet train`` and the Megatron-LM path alike.

Evaluation (:meth:`HeteroTrainer.evaluate`, Megatron-LM's ``--eval-interval``/``--eval-iters``):
megatron-core's schedule with ``forward_only=True`` over the same pipelines and communicator, no
gradients; the validation loss is the training objective's mean over every micro-batch of the
validation global batches. The evaluation after iteration ``i`` reads validation batches
``[(i // interval - 1) * iters, (i // interval) * iters)``: fresh batches each time, as
Megatron's validation iterator gives, and the same after a resume. Megatron-LM also evaluates once
after the last iteration ("on validation set"); this loop does not.

Activation recompute: a plan with ``activation_recompute`` builds every stage with megatron-core's
full recompute (runtime/stage_model.py ``recompute_config``); the numbers do not change.

Global batch contract: a dict of tensors ``tokens``, ``labels``, ``loss_mask``, ``position_ids``,
each ``[global_batch_size, seq]`` and identical on all ranks, or a ``data.batches.GlobalBatch``
(the same rows, read from the dataset on demand). Micro-batch ``i`` is rows
``[i * micro_batch_size, (i + 1) * micro_batch_size)``; pipeline ``p`` runs micro-batches
``[offset_p, offset_p + m_p)`` (``RankRole.microbatch_offset``, the plan's ``num_microbatches``),
and a rank materialises only those (``reference.microbatches``).

Loss and scaling. The loss of an iteration is the mean over ALL ``M`` micro-batches of the global
batch of each micro-batch's masked-token-mean cross-entropy, and the gradient is the gradient of
that (testing/reference.py computes the same in one process). Megatron's schedule divides each
micro-batch loss by the LOCAL count ``m_p`` before backward (pipeline_parallel/schedules.py,
``forward_step_calc_loss``), which would make every replica's gradient a per-replica mean, wrong as
soon as replicas run different counts. The loss function therefore multiplies each micro-batch
loss by ``m_p / M`` before returning it: after the schedule's ``/ m_p`` each micro-batch
contributes ``loss_i / M``, exactly the reference's objective, so the grad sync is a plain SUM
over replicas with no rescaling pass. Doing it in the loss (not in ``config.grad_scale_func``,
which belongs to the mixed-precision loss scaler, and not as a scaling of the synced buckets)
costs one scalar multiply per micro-batch.

The objective is runtime/loss.py's ``masked_token_mean``, the global-batch split
data/batches.py's ``microbatches``, the optimizer runtime/optimizer.py's: the single-process
reference the tests compare against uses the same three.

Precision (spec/precision.py, runtime/mixed_precision.py): Megatron-LM's ``--bf16`` mixed
precision or fp32. In bf16 the stage model's weights, activations and P2P messages are bf16;
GradSync accumulates every backward's gradient into fp32 ``main_grad`` buckets and reduces them in
fp32; the norm and clipping are taken on those fp32 gradients; AdamW steps fp32 master weights
whose ``.grad`` are the main-grad views, with fp32 moments, and the bf16 weights are written back
from the masters after every step. In fp32 the weights are their own masters. With the
distributed optimizer the masters are its fp32 shards (runtime/distributed_optimizer.py) and the
bf16 weights are written from their all-gather.

Optimizer: torch's ``torch.optim.AdamW`` (``make_optimizer``: decoupled weight decay, none on
biases and 1-D parameters, decided on global names so every rank agrees; its fused kernel on
CUDA, runtime/optimizer.py ``fused_adamw``) on each rank's local
shards, with the global grad norm and clipping of :class:`GradSync` (megatron-core's
``get_grad_norm_fp32`` / ``clip_grad_by_total_norm_fp32`` over the world, each parameter counted
once). AdamW is elementwise, so AdamW on shards equals AdamW on the full tensors; only the norm
needs the whole model, and that is what GradSync provides. With ``distributed_optimizer``
(``--use-distributed-optimizer``) runtime/distributed_optimizer.py replaces both: it
reduce-scatters the gradient buckets, steps AdamW on each rank's shards of them and all-gathers
the weights; ``.optimizer`` is then that object and ``.grads`` (sync, norm, clip) too. The
learning-rate schedule is the caller's, between iterations: megatron-core's
``OptimizerParamScheduler`` on ``.optimizer`` (``make_lr_scheduler`` for ``autohet train``,
Megatron-LM's own ``get_optimizer_param_scheduler`` on the ``pretrain_gpt.py`` path), stepped after
each :meth:`HeteroTrainer.train_step`. megatron-core's ``MegatronOptimizer`` was not used because it
computes the norm over one model-parallel group with ``param.shared`` / TP-duplicate filters that
assume every replica has the same shape, and its distributed optimizer needs megatron DDP's single
DP group; on a machine without Apex/TE it falls back to the same torch Adam(W) anyway.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

from megatron_autohet.data.batches import microbatches
from megatron_autohet.plan import Plan, check_overlap_grad_reduce
from megatron_autohet.runtime.attention import attention_kind
from megatron_autohet.runtime.distributed_optimizer import DistributedOptimizer
from megatron_autohet.runtime.fusions import agree_jit_fusions
from megatron_autohet.runtime.grad_sync import DEFAULT_BUCKET_NUMEL, GradSync
from megatron_autohet.runtime.init import initialize_parameters
from megatron_autohet.runtime.iteration_clock import IterationClock
from megatron_autohet.runtime.loss import masked_token_mean
from megatron_autohet.runtime.mixed_precision import MasterWeights
from megatron_autohet.runtime.optimizer import OptimizerSettings, fused_adamw, make_optimizer
from megatron_autohet.runtime.parallel_state import build_parallel_state
from megatron_autohet.runtime.schedule import run_schedule
from megatron_autohet.runtime.stage_drift import DEFAULT_WINDOW, WindowMeter
from megatron_autohet.runtime.stage_model import (agree_layer_spec, build_stage_model,
                                                  model_device, param_layouts,
                                                  plan_padded_vocab_size, recompute_config,
                                                  stage_chunks)
from megatron_autohet.runtime.train_log import (IterationLogger, IterationRecord,
                                                num_floating_point_operations)
from megatron_autohet.spec.model import ModelSpec
from megatron_autohet.spec.precision import FP32, Precision


@dataclass(frozen=True)
class StepMetrics:
    loss: float                 # mean over the global batch's micro-batches (see module doc)
    grad_norm: float            # L2 norm of the global gradient, before clipping
    num_microbatches: int       # M, all pipelines together
    tokens: int                 # global_batch_size * seq_length
    # every rank's torch.cuda.max_memory_allocated at the gradient sync, by rank; None on a CPU
    max_allocated_bytes: list[int] | None = None


class HeteroTrainer:
    """This rank's part of training a plan; every rank of the job constructs one.

    Args:
        plan: the plan (validated); ``torch.distributed`` must be initialised with its world size.
        model_spec: the job's model; a ConfigError if the plan was made for another one.
        rank: this process's global rank.
        seed: seed of the layout-independent initial weights (runtime/init.py).
        optimizer: AdamW hyper-parameters, weight decay and the clipping threshold (the global
            gradient is clipped to ``optimizer.clip_grad``; 0 disables clipping). Its learning
            rate is the initial one; a scheduler on ``.optimizer`` changes it between steps.
        sequence_parallel: Megatron sequence parallelism on every stage with TP > 1.
        bucket_numel: gradient bucket size in elements (runtime/grad_sync.py).
        distributed_optimizer: shard the master weights and Adam moments over each bucket's
            holders, reduce-scatter / all-gather instead of the all-reduce
            (runtime/distributed_optimizer.py; Megatron-LM's --use-distributed-optimizer).
        precision: the numerics (spec/precision.py ``PRECISIONS``): bf16 mixed precision or fp32.
        hidden_dropout, attention_dropout: Megatron-LM's dropout probabilities (default off;
            runtime/stage_model.py says how the masks are seeded).
        jit_fusions: the megatron-core fusions wanted (runtime/fusions.py ``JIT_FUSIONS`` ->
            bool; default none); on where every rank can run them (``self.fusions`` says).
        fused_optimizer: torch's fused AdamW kernel; None (default): on CUDA
            (runtime/optimizer.py ``fused_adamw``). ``self.fused_optimizer`` says which.
        overlap_grad_reduce: start each gradient bucket's collective during the backward of
            the last micro-batch, as soon as its gradients are final (Megatron-LM's
            --overlap-grad-reduce; runtime/grad_sync.py, "Overlapped sync"); the same sums.
        initialize: give the weights (and masters) the seed's initial values now; False for a
            job that loads a checkpoint over them, which saves drawing every parameter's full
            fp32 tensor (runtime/init.py) on every (re)start. Such a trainer trains only once its
            weights are set: by a checkpoint load (checkpoint/state.py ``apply_loaded``) or, when
            there was none to load, by :meth:`initialize_weights`, which gives exactly what
            ``initialize`` would have (train_iterations calls it after the resume).
    """

    def __init__(self, plan: Plan, model_spec: ModelSpec | None = None, *, rank: int, seed: int,
                 optimizer: OptimizerSettings, sequence_parallel: bool = False,
                 bucket_numel: int = DEFAULT_BUCKET_NUMEL, plan_file: str = "<plan>",
                 distributed_optimizer: bool = False, precision: Precision = FP32,
                 hidden_dropout: float = 0.0, attention_dropout: float = 0.0,
                 jit_fusions: dict[str, bool] | None = None, initialize: bool = True,
                 fused_optimizer: bool | None = None, overlap_grad_reduce: bool = False):
        optimizer.validate(source=plan_file)
        if overlap_grad_reduce:
            check_overlap_grad_reduce(plan, plan_file)
        self.plan = plan
        self.seed = seed
        self.precision = precision
        self.clip_grad = optimizer.clip_grad
        self.state = build_parallel_state(plan, rank, model=model_spec, plan_file=plan_file)
        role = self.state.role
        self.fusions = agree_jit_fusions(jit_fusions or {}, model_device())
        self.model = build_stage_model(plan.model, self.state, seed=seed,
                                       sequence_parallel=sequence_parallel, precision=precision,
                                       hidden_dropout=hidden_dropout,
                                       attention_dropout=attention_dropout, initialize=initialize,
                                       **recompute_config(plan.activation_recompute),
                                       **self.fusions.config_fields())
        self.weights_set = initialize       # (class doc: ``initialize``)
        self.sequence_parallel = sequence_parallel
        self.device = next(self.model.parameters()).device
        # One layer spec on every rank (parameter names, hence gradient buckets, depend on it).
        self.layer_spec = agree_layer_spec(self.device)
        self.layouts = param_layouts(self.model, self.state)   # local name -> ParamLayout
        self.grad_sync = GradSync(
            self.model, self.layouts,
            [g.spec for g in self.state.sync_groups], [g.group for g in self.state.sync_groups],
            holder=role.stage.ranks, tp_group=self.state.tp_group,
            sequence_parallel=sequence_parallel, bucket_numel=bucket_numel,
            shard_padding=distributed_optimizer, overlap_grad_reduce=overlap_grad_reduce)
        if overlap_grad_reduce:
            # megatron's schedules enter it for every micro-batch but the last (grad_sync.py)
            self.model.config.no_sync_func = self.grad_sync.no_sync
        self.distributed_optimizer = distributed_optimizer
        self.fused_optimizer = fused_adamw(self.device, fused_optimizer)
        if distributed_optimizer:
            # It keeps its own fp32 master shards and writes the weights back itself.
            self.masters = None
            self.optimizer = DistributedOptimizer(self.grad_sync, self.model, optimizer,
                                                  fused=self.fused_optimizer)
            self.grads = self.optimizer       # reduce-scatter, norm and clip of the shards
        else:
            self.masters = MasterWeights(
                ((name, p) for name, p in self.model.named_parameters() if p.requires_grad),
                precision)
            self.optimizer = make_optimizer(self.model, self.layouts, optimizer, self.masters,
                                            fused=self.fused_optimizer)
            self.grads = self.grad_sync
        # The global-batch scaling of every micro-batch loss (module doc): m_p / M.
        self.loss_scale = role.stage.num_microbatches / plan.num_microbatches_total
        # Where each iteration goes (runtime/iteration_clock.py): read with clock.lap().
        self.clock = IterationClock(self.device)

    @property
    def attention(self) -> str:
        """How its layers compute attention (profiling/profile.py ``ATTENTIONS``), as a profile
        records it: what a profile of this job's measurements says its layers ran."""
        first_layer = stage_chunks(self.model)[0].decoder.layers[0]
        return attention_kind(first_layer.self_attention.core_attention)

    @torch.no_grad()
    def initialize_weights(self) -> None:
        """The seed's initial weights (runtime/init.py) and the masters derived from them, as a
        trainer built with ``initialize`` holds them: for a trainer built without, when no
        checkpoint was loaded."""
        initialize_parameters(((p, self.layouts[n]) for n, p in self.model.named_parameters()),
                              self.plan.model, self.seed)
        if self.distributed_optimizer:
            self.optimizer.load()           # the master shards from the weights, as when built
        else:
            self.masters.copy_weights()
        self.weights_set = True

    def _check_weights_set(self) -> None:
        if not self.weights_set:
            raise RuntimeError("the trainer was built with initialize=False and its weights "
                               "were never set: load a checkpoint or call initialize_weights()")

    def train_step(self, global_batch) -> StepMetrics:
        self._check_weights_set()
        role, plan = self.state.role, self.plan
        self.model.train()
        self.clock.begin()
        self.grad_sync.zero_grad()
        local = microbatches(global_batch, plan.micro_batch_size, role.microbatch_offset,
                             role.stage.num_microbatches)
        reported = run_schedule(self._forward_step, iter(local), self.model, self.state,
                                sequence_parallel=self.sequence_parallel, clock=self.clock)
        self.clock.phase_done("schedule")
        self.grads.sync()
        loss, grad_norm, max_allocated = self._global_loss_and_grad_norm(reported)
        self.clock.phase_done("grad_sync")
        if self.clip_grad > 0:
            if self.masters is None:
                self.grads.clip(self.clip_grad, grad_norm)
            else:
                clip_grad_by_total_norm_fp32(self.masters.tensors, self.clip_grad, grad_norm)
        self.optimizer.step()
        if self.masters is not None:
            self.masters.write_back()
        self.clock.phase_done("optimizer")
        return StepMetrics(loss=loss, grad_norm=grad_norm,
                           num_microbatches=plan.num_microbatches_total,
                           tokens=plan.global_batch_size * plan.seq_length,
                           max_allocated_bytes=max_allocated)

    def evaluate(self, global_batches) -> float:
        """Forward-only over ``global_batches`` (each as in :meth:`train_step`): the mean loss
        over all their micro-batches, the same on every rank."""
        self._check_weights_set()
        role, plan = self.state.role, self.plan
        self.model.eval()
        sums = torch.zeros(1, dtype=torch.float64, device=self.device)
        with torch.no_grad():
            for global_batch in global_batches:
                local = microbatches(global_batch, plan.micro_batch_size, role.microbatch_offset,
                                     role.stage.num_microbatches)
                reported = run_schedule(self._forward_step, iter(local), self.model, self.state,
                                        sequence_parallel=self.sequence_parallel,
                                        forward_only=True)
                if role.stage.is_last and role.tp_rank == 0:
                    sums[0] += _loss_sum(reported)
        self.model.train()
        dist.all_reduce(sums)
        return float(sums[0]) / (plan.num_microbatches_total * len(global_batches))

    def _forward_step(self, data_iterator, model):
        batch = {key: value.to(self.device, non_blocking=True)
                 for key, value in next(data_iterator).items()}
        output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        return output, partial(self._loss_func, batch["loss_mask"])

    def _loss_func(self, loss_mask, per_token_loss):
        loss = masked_token_mean(per_token_loss, loss_mask)
        # The schedule divides the returned tensor in place by m_p; `loss` itself is untouched.
        return loss * self.loss_scale, {"lm loss": loss.detach()}

    def _global_loss_and_grad_norm(self, reported: list[dict]
                                   ) -> tuple[float, float, list[int] | None]:
        """One all-reduce over the world of [loss sum, squared grad norm, peak bytes of rank 0,
        ..., of rank N-1]: each last stage's TP rank 0 adds its pipeline's micro-batch losses,
        every rank the squares of the gradients it owns (GradSync counts each parameter once)
        and, on a GPU, its ``torch.cuda.max_memory_allocated`` into its own slot (the sum is then
        every rank's peak: no collective of its own; float64 holds byte counts exactly)."""
        role = self.state.role
        on_cuda = self.device.type == "cuda"
        sums = torch.zeros(2 + (self.state.world_size if on_cuda else 0), dtype=torch.float64,
                           device=self.device)
        if role.stage.is_last and role.tp_rank == 0:
            sums[0] = _loss_sum(reported)
        sums[1] = self.grads.owned_sum_of_squares()
        if on_cuda:
            sums[2 + self.state.rank] = torch.cuda.max_memory_allocated(self.device)
        dist.all_reduce(sums)
        loss_sum, norm_squared, *peaks = sums.tolist()   # the iteration's one host sync
        return (loss_sum / self.plan.num_microbatches_total, norm_squared ** 0.5,
                [int(p) for p in peaks] if on_cuda else None)


def _loss_sum(reported: list[dict]) -> torch.Tensor:
    """The sum of the micro-batch losses the schedule reported, in float64 on their device: no
    host sync per micro-batch (the float32 losses of an iteration add exactly in float64, so
    the order is free)."""
    return torch.stack([r["lm loss"] for r in reported]).double().sum()


@dataclass(frozen=True)
class Evaluation:
    """Megatron-LM's ``--eval-interval`` / ``--eval-iters`` with the validation batches
    (data/batches.py ``build_splits``: at least ``train_iters // interval * iters`` of them)."""
    interval: int
    iters: int
    batches: object

    def batches_after(self, iteration: int) -> list:
        first = (iteration // self.interval - 1) * self.iters
        return [self.batches.batch(i) for i in range(first, first + self.iters)]


def validation_batches_needed(train_iters: int, eval_interval: int | None, eval_iters: int) -> int:
    """Validation global batches a job evaluating every ``eval_interval`` iterations reads."""
    if not eval_interval or eval_iters <= 0:
        return 0
    return train_iters // eval_interval * eval_iters


def train_iterations(trainer: HeteroTrainer, batches, scheduler, *, train_iters: int,
                     scheduler_increment: int, log: bool, metrics_jsonl: str | None = None,
                     checkpointer=None, exit_interval: int | None = None,
                     stop_check=None, evaluation: Evaluation | None = None,
                     log_interval: int = 1, measure_window: int | None = DEFAULT_WINDOW,
                     measured_jsonl: str | None = None, on_window=None,
                     dashboard=None) -> int:
    """The iteration loop of a job (``autohet train`` and the Megatron-LM path): a train step on
    each global batch, the learning-rate scheduler stepped by ``scheduler_increment`` after it
    (1 for iteration-based schedules, the global batch size for Megatron's sample-based one),
    and, where ``log`` (one rank: the metrics are the same on all), Megatron's iteration line.
    The logged learning rate is read after the scheduler step, as Megatron-LM's training_log
    reads it. ``log_interval``: the line only after every N-th iteration (Megatron's
    ``--log-interval``); ``metrics_jsonl`` gets every iteration.

    ``checkpointer`` (checkpoint/checkpointer.py): training starts where its ``resume()`` says
    (global batch ``i`` is the same whatever plan runs it, so a resumed job sees exactly the
    batches an uninterrupted one would), it saves after iterations its interval names and at
    the end. ``exit_interval``: stop after an iteration that is a multiple of it (Megatron's
    ``--exit-interval``), saving first. ``stop_check(iteration)`` (elastic/stop.py), called after
    every iteration on every rank, returns "stop" (save this iteration and return), "save" (save
    it and go on) or None. ``evaluation``: the validation loss after every ``interval``-th
    iteration (before that iteration's checkpoint), logged in Megatron's format.
    ``measure_window``: every that many iterations the ranks' measured phase times are gathered
    once (runtime/stage_drift.py) and, where ``log``, each stage off its prediction by more than
    10% gets a line and the window a JSON line in ``measured_jsonl`` (None: not measured);
    ``on_window(report)`` is then called with the window's ``WindowReport`` there too (the
    front end's sinks: an elastic job's ``drift`` event, the measured profile).
    ``dashboard`` (runtime/dashboard.py), where ``log``: every record to TensorBoard / W&B.
    Returns the last iteration trained."""
    plan = trainer.plan
    flops_per_iteration = num_floating_point_operations(
        plan.model, plan.global_batch_size, plan.seq_length, plan_padded_vocab_size(plan))
    first = checkpointer.resume().iteration if checkpointer else 0
    if not trainer.weights_set:         # built for a checkpoint that was not there
        trainer.initialize_weights()
    # A resumed job appends to the metrics of the run it continues.
    logger = (IterationLogger(metrics_jsonl, append=first > 0, measured_jsonl=measured_jsonl,
                              dashboard=dashboard) if log else None)
    meter = (WindowMeter(plan, trainer.state.rank, trainer.device, measure_window)
             if measure_window else None)
    iteration = first
    # Megatron-LM's "elapsed time per iteration" is its interval timer: from one iteration's end
    # to the next, so a save, an evaluation or a stop check between them counts where it stalls.
    interval_start = time.perf_counter()
    ends = True     # the run ends here: not a stop for a notice, a signal or a plan switch
    try:
        while iteration < train_iters:
            batch = batches.batch(iteration)
            metrics = trainer.train_step(batch)
            now = time.perf_counter()
            elapsed, interval_start = now - interval_start, now
            scheduler.step(scheduler_increment)
            iteration += 1
            if dashboard is not None and log:   # this iteration's events (its window's) on its step
                dashboard.at(iteration)
            window_start = time.perf_counter()
            report = meter.add(iteration, trainer.clock.lap()) if meter else None
            if report and logger:
                logger.log_measured(report)
                if on_window:
                    on_window(report)
            # what measuring costs the job, measured: the window's gather and sinks
            window_s = time.perf_counter() - window_start if report else None
            if logger:
                logger.log(IterationRecord.make(
                    iteration=iteration, train_iters=train_iters,
                    global_batch_size=plan.global_batch_size, seq_length=plan.seq_length,
                    elapsed_s=elapsed, learning_rate=trainer.optimizer.param_groups[0]["lr"],
                    lm_loss=metrics.loss, grad_norm=metrics.grad_norm,
                    flops_per_iteration=flops_per_iteration, world_size=plan.world_size,
                    max_allocated_bytes=metrics.max_allocated_bytes, window_s=window_s),
                    console=iteration % log_interval == 0)
            if evaluation and iteration % evaluation.interval == 0:
                loss = trainer.evaluate(evaluation.batches_after(iteration))
                if logger:
                    logger.log_validation(iteration, loss)
            if checkpointer:
                checkpointer.after_iteration(iteration)
            if exit_interval and iteration % exit_interval == 0:
                break
            action = stop_check(iteration) if stop_check else None
            if action == "stop":
                ends = False
                break
            if action == "save" and checkpointer and checkpointer.last_saved != iteration:
                checkpointer.save(iteration)
        if checkpointer:
            checkpointer.finish(iteration, completed=ends)
    finally:
        if logger:
            logger.close()
        if checkpointer:
            checkpointer.close(completed=ends)
    return iteration
