"""The optimizer and learning-rate schedule: AdamW with Megatron's weight-decay rule and schedule.

Public API
----------
``OptimizerSettings``
    Every knob, named and defaulted as Megatron-LM's flags (``--lr``, ``--min-lr``,
    ``--weight-decay`` 0.01, ``--adam-beta1/2``, ``--adam-eps``, ``--clip-grad`` 1.0,
    ``--lr-warmup-iters`` or ``--lr-warmup-fraction``, ``--lr-decay-iters``,
    ``--lr-decay-style`` linear).
    ``validate(train_iters=None, source=None)`` raises :class:`ConfigError` naming the flag.
``applies_weight_decay(layout) -> bool``
    Megatron-core's no-decay rule on a parameter's GLOBAL identity.
``make_optimizer(model, layouts, settings, masters=None, fused=False) -> torch.optim.AdamW``
    The optimizer of the single-process reference, of ``HeteroTrainer`` and of the Megatron-LM
    path: two parameter groups, ``wd_mult`` 1.0 (decayed) and 0.0 (not decayed). ``masters``
    (runtime/mixed_precision.MasterWeights): it steps each parameter's fp32 master instead.
    ``fused``: torch's one-kernel AdamW instead of its default multi-tensor one.
``megatron_adamw(stepped, settings, fused=False) -> torch.optim.AdamW``
    AdamW over (tensor, layout) pairs in those two groups: make_optimizer's, and the
    distributed optimizer's over its shards.
``fused_adamw(device, requested=None) -> bool``
    Whether AdamW steps with the fused kernel on ``device``: as requested, else on CUDA.
``adam_step(step, param, options)``
    The ``step`` state tensor of ``param`` as a torch AdamW with ``options`` (its ``defaults``)
    keeps it (on the parameter's device for the fused kernel): what a checkpoint load writes.
``schedule_fields(settings, train_iters, global_batch_size) -> dict``, ``SCHEDULE_FLAGS``
    The scheduler's fields (counted in samples) and the flag that sets each (torch-free);
    ``warmup_steps`` the warm-up's samples, as Megatron-LM computes them.
``schedule_mismatch(wanted, saved)``, ``SCHEDULE_CHOICE``
    The first field where a checkpoint's schedule differs from this run's (what a resume refuses
    unless ``--override-opt-param-scheduler`` or ``--use-checkpoint-opt-param-scheduler``).
``make_lr_scheduler(optimizer, settings, train_iters, global_batch_size)``
    megatron-core's ``OptimizerParamScheduler`` driving that optimizer, counting SAMPLES as
    Megatron-LM's ``get_optimizer_param_scheduler`` does: ``scheduler.step(global_batch_size)``
    after each ``optimizer.step()``, as Megatron-LM's ``train_step`` does.

Design (why)
------------
* One definition. testing/reference.py (the ground truth), runtime/trainer.py and
  testing/stock.py's hyper-parameters all come from here, so the runtime, the reference and stock
  megatron-core cannot drift apart. The module imports torch and megatron lazily: the CLI
  validates settings before any process (or torch) exists.
* AdamW, decoupled decay (Megatron's ``decoupled_weight_decay=True`` default;
  ``get_megatron_optimizer`` picks ``torch.optim.AdamW`` when neither TE nor Apex is installed, and
  the fused kernels it prefers compute the same update). AdamW is elementwise - the decay
  ``p *= 1 - lr * wd`` included - so AdamW on a TP shard equals AdamW on the full tensor sliced,
  and every rank can step its own shards.
* Fused on a GPU. Megatron-LM on a GPU steps with Transformer Engine's or Apex's ``FusedAdam``,
  one kernel over every tensor; without either, megatron-core falls back to ``torch.optim.AdamW``
  whose default (foreach) implementation runs about eight kernels over the fp32 masters, grads
  and moments: three times the memory traffic of one pass, which for a 1B-parameter stage is
  a few percent of an iteration. torch's ``fused=True`` AdamW is the same update in one pass,
  so the runtime uses it on CUDA (stock megatron-core's baseline, testing/stock.py, too). On a
  CPU it keeps the default: the fused kernel rounds differently in the last bit, and CPU runs
  stay bit for bit those of the reference and of stock megatron-core. The fused kernel keeps
  each ``step`` on the parameter's device, where a checkpoint load must put it (``adam_step``).
* The no-decay rule is megatron-core 0.16.1's default
  (``optimizer/__init__.py:get_standard_config_overrides`` with ``apply_wd_to_qk_layernorm``
  False: ``ParamKey(name="*.bias", predicate=len(param.shape) == 1)`` gets ``wd_mult=0.0``): no
  decay on biases and on 1-D parameters (norm weights); everything else, embeddings and the output
  layer included, is decayed. It is decided on the parameter's global name and FULL shape
  (:class:`~megatron_autohet.layout.params.ParamLayout`), never on a local shard, so every rank of
  every layout and the one-process reference put a parameter in the same group. TP never changes
  a tensor's number of dimensions, so this is exactly megatron's per-rank decision.
  tests/runtime/test_optimizer.py checks it against megatron's ``_get_param_groups`` on the tiny
  GPTs.
* The groups carry ``wd_mult`` as megatron's do, so megatron-core's ``OptimizerParamScheduler``
  (ours here, or Megatron-LM's ``get_optimizer_param_scheduler`` on the ``pretrain_gpt.py`` path)
  writes ``weight_decay = wd * wd_mult`` and the scheduled ``lr`` into them; there is no second
  scheduler. ``make_lr_scheduler`` is ``get_optimizer_param_scheduler`` for iteration-based
  training (``--train-iters``), with Megatron's defaults: warm-up from ``--lr-warmup-init`` 0,
  constant weight decay. The group's initial ``weight_decay`` is already ``wd * wd_mult``, so the
  optimizer is right even before a scheduler touches it.
* Samples, not iterations: the scheduler's state is part of every checkpoint, and Megatron-LM
  (stock, and the ``pretrain_gpt.py --autohet-plan`` path) counts every step count of it in
  samples (``num_steps = iteration * global_batch_size``, warm-up, decay and weight-decay
  lengths likewise) and asserts on load that they equal its own. Counting the same way makes one
  checkpoint format serve ``autohet train``, the Megatron-LM path and stock Megatron-LM, and the
  learning rates are bit for bit stock Megatron-LM's. They are those of iteration units: after
  the warm-up bit for bit (the decay is a function of ``(k * B) / (n * B)``, a correctly rounded
  quotient of exact integers, so ``k / n``); during the warm-up megatron computes
  ``lr * (k * B) / (w * B)`` product first, which for a global batch size B that is not a power
  of two may differ from ``lr * k / w`` in the last bit.
* The learning rate a log line shows is the one in the optimizer after the iteration's scheduler
  step, as Megatron-LM's ``training_log`` shows it (the rate of the next iteration).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_autohet.errors import ConfigError

LR_DECAY_STYLES = ("constant", "linear", "cosine")
# AdamW's per-parameter moments (torch's state keys, Megatron-LM's checkpoint keys).
ADAM_STATE_KEYS = ("exp_avg", "exp_avg_sq")
LR_WARMUP_INIT = 0.0          # Megatron-LM's --lr-warmup-init default: warm-up starts at 0


@dataclass(frozen=True)
class OptimizerSettings:
    lr: float
    min_lr: float = 0.0
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0                    # 0: no clipping
    lr_warmup_iters: int = 0
    # Megatron-LM's --lr-warmup-fraction: the warm-up as a fraction of the decay (in samples,
    # not rounded to iterations); None: --lr-warmup-iters
    lr_warmup_fraction: float | None = None
    lr_decay_iters: int | None = None         # None: decay over the whole run (train_iters)
    lr_decay_style: str = "linear"
    # What a resume does with a checkpoint whose schedule differs (Megatron-LM's flags, the
    # arguments of megatron-core's OptimizerParamScheduler): neither -> refused; override -> this
    # run's values from the checkpoint's sample count on; use-checkpoint -> the checkpoint's.
    override_opt_param_scheduler: bool = False
    use_checkpoint_opt_param_scheduler: bool = False

    def decay_iters(self, train_iters: int) -> int:
        return train_iters if self.lr_decay_iters is None else self.lr_decay_iters

    def validate(self, train_iters: int | None = None,
                 source: str | None = None) -> "OptimizerSettings":
        """ConfigError (field = Megatron's flag) for values Megatron would refuse or misuse;
        the schedule length is checked when ``train_iters`` is given."""
        def bad(flag: str, value, allowed: str):
            raise ConfigError(source, flag, f"got {value}", allowed)

        if not self.lr > 0:
            bad("--lr", self.lr, "a learning rate > 0")
        if not 0 <= self.min_lr <= self.lr:
            bad("--min-lr", self.min_lr, f"0 <= --min-lr <= --lr ({self.lr})")
        if not self.weight_decay >= 0:
            bad("--weight-decay", self.weight_decay, ">= 0 (0: no weight decay)")
        if not self.clip_grad >= 0:
            bad("--clip-grad", self.clip_grad, ">= 0 (0: no clipping)")
        for flag, beta in (("--adam-beta1", self.adam_beta1), ("--adam-beta2", self.adam_beta2)):
            if not 0 <= beta < 1:
                bad(flag, beta, "0 <= beta < 1")
        if not self.adam_eps > 0:
            bad("--adam-eps", self.adam_eps, "> 0")
        if self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            # megatron-core's OptimizerParamScheduler asserts the same
            raise ConfigError(source, "--override-opt-param-scheduler",
                              "given with --use-checkpoint-opt-param-scheduler",
                              "one of them: this run's schedule (override) or the checkpoint's")
        if self.lr_decay_style not in LR_DECAY_STYLES:
            bad("--lr-decay-style", self.lr_decay_style, ", ".join(LR_DECAY_STYLES))
        if self.lr_warmup_iters < 0:
            bad("--lr-warmup-iters", self.lr_warmup_iters, ">= 0")
        if self.lr_warmup_fraction is not None:
            if self.lr_warmup_iters:
                # Megatron-LM's validate_args asserts the same
                raise ConfigError(source, "--lr-warmup-fraction", "given with --lr-warmup-iters",
                                  "one of them, as in Megatron-LM")
            if not 0 <= self.lr_warmup_fraction < 1:
                bad("--lr-warmup-fraction", self.lr_warmup_fraction,
                    "a fraction of the decay iterations in [0, 1)")
        if self.lr_decay_iters is not None and self.lr_decay_iters <= 0:
            bad("--lr-decay-iters", self.lr_decay_iters, "> 0")
        if train_iters is not None and self.lr_warmup_iters >= self.decay_iters(train_iters):
            # megatron's OptimizerParamScheduler asserts warm-up < decay steps
            bad("--lr-warmup-iters", self.lr_warmup_iters,
                f"fewer than the decay iterations ({self.decay_iters(train_iters)}: "
                "--lr-decay-iters, default the training iterations)")
        return self


def applies_weight_decay(layout) -> bool:
    """Megatron-core's default rule on the global identity: no decay on ``*.bias`` and 1-D."""
    return not (layout.global_name.endswith(".bias") or len(layout.full_shape) == 1)


def fused_adamw(device, requested: bool | None = None) -> bool:
    """Whether AdamW steps with torch's fused kernel on ``device``: ``requested``, else the
    runtime's choice (module doc), on CUDA."""
    return device.type == "cuda" if requested is None else requested


def adam_step(step: int, param, options: dict):
    """``param``'s ``step`` state as a torch AdamW built with ``options`` keeps it: a float32
    scalar, on the parameter's device for the fused or capturable kernels, else on the CPU
    (torch's ``Optimizer._process_value_according_to_param_policy``, as its ``load_state_dict``
    puts it)."""
    # torch: not at `autohet` start-up
    import torch

    on_device = options.get("fused") or options.get("capturable")
    return torch.tensor(float(step), dtype=torch.float32,
                        device=param.device if on_device else "cpu")


def make_optimizer(model, layouts: dict, settings: OptimizerSettings, masters=None,
                   fused: bool = False):
    """AdamW over ``model``'s parameters (or their ``masters``); ``layouts``: local name ->
    ParamLayout; ``fused``: torch's fused kernel (:func:`fused_adamw`)."""
    settings.validate()
    return megatron_adamw(
        ((masters.by_name[name] if masters is not None else param, layouts[name])
         for name, param in model.named_parameters() if param.requires_grad), settings, fused)


def megatron_adamw(stepped, settings: OptimizerSettings, fused: bool = False):
    """torch's AdamW over the tensors of ``stepped``, (tensor, ParamLayout) pairs, in Megatron's
    two groups: ``wd_mult`` 1.0 (decayed, group 0) and 0.0, by :func:`applies_weight_decay` on
    each layout. What ``make_optimizer`` and the distributed optimizer's shards step."""
    # torch: not at `autohet` start-up
    import torch

    groups = {1.0: [], 0.0: []}
    for tensor, layout in stepped:
        groups[1.0 if applies_weight_decay(layout) else 0.0].append(tensor)
    # Both groups on every rank (an empty one is allowed): group 0 is the decayed one everywhere.
    return torch.optim.AdamW(
        [{"params": params, "wd_mult": wd_mult, "weight_decay": settings.weight_decay * wd_mult}
         for wd_mult, params in groups.items()],
        lr=settings.lr, betas=(settings.adam_beta1, settings.adam_beta2), eps=settings.adam_eps,
        # None, not False: False would force torch's slowest (per-tensor) implementation
        weight_decay=settings.weight_decay, fused=True if fused else None)


def schedule_fields(settings: OptimizerSettings, train_iters: int,
                    global_batch_size: int) -> dict:
    """The fields of megatron-core's OptimizerParamScheduler for ``train_iters`` iterations of
    ``global_batch_size`` samples, counted in samples (module docstring): what
    :func:`make_lr_scheduler` builds and what its ``load_state_dict`` insists a checkpoint
    agrees with (torch-free, so ``autohet train`` checks a resume before starting processes)."""
    if global_batch_size < 1:
        raise ValueError(f"global_batch_size must be >= 1, got {global_batch_size}")
    return {"max_lr": settings.lr, "min_lr": settings.min_lr,
            "lr_warmup_steps": warmup_steps(settings, train_iters, global_batch_size),
            "lr_decay_steps": settings.decay_iters(train_iters) * global_batch_size,
            "lr_decay_style": settings.lr_decay_style, "start_wd": settings.weight_decay,
            "end_wd": settings.weight_decay, "wd_incr_steps": train_iters * global_batch_size,
            "wd_incr_style": "constant"}


def warmup_steps(settings: OptimizerSettings, train_iters: int, global_batch_size: int) -> float:
    """The warm-up in samples, as Megatron-LM's get_optimizer_param_scheduler computes it:
    --lr-warmup-fraction of the decay samples, else --lr-warmup-iters global batches."""
    if settings.lr_warmup_fraction is not None:
        return settings.lr_warmup_fraction * settings.decay_iters(train_iters) * global_batch_size
    return settings.lr_warmup_iters * global_batch_size


# The flag that sets each scheduler field (what a mismatch on resume names), in the order
# megatron-core's OptimizerParamScheduler.load_state_dict checks them.
SCHEDULE_FLAGS = {"max_lr": "--lr", "min_lr": "--min-lr", "lr_warmup_steps": "--lr-warmup-iters",
                  "lr_decay_steps": "--lr-decay-iters", "lr_decay_style": "--lr-decay-style",
                  "start_wd": "--weight-decay", "end_wd": "--weight-decay",
                  "wd_incr_steps": "--iters", "wd_incr_style": "--weight-decay"}
# The same for Megatron-LM's command line (pretrain_gpt.py --autohet-plan).
MEGATRON_SCHEDULE_FLAGS = {**SCHEDULE_FLAGS, "start_wd": "--start-weight-decay",
                           "end_wd": "--end-weight-decay", "wd_incr_steps": "--train-iters",
                           "wd_incr_style": "--weight-decay-incr-style"}
SCHEDULE_CHOICE = ("the checkpoint's flags (the schedule continues where it stopped), or "
                   "--override-opt-param-scheduler (this run's schedule, from the checkpoint's "
                   "sample count on) or --use-checkpoint-opt-param-scheduler (the checkpoint's "
                   "schedule)")


def saved_schedule_fields(saved: dict) -> dict:
    """A checkpoint's ``opt_param_scheduler`` entry under the current field names (megatron-core
    reads older names too: ``start_lr``, ``warmup_iter``/``warmup_steps``, ``end_iter``/
    ``decay_steps``, ``decay_style``)."""
    aliases = {"max_lr": ("start_lr", "max_lr"),
               "lr_warmup_steps": ("warmup_iter", "warmup_steps", "lr_warmup_steps"),
               "lr_decay_steps": ("end_iter", "decay_steps", "lr_decay_steps"),
               "lr_decay_style": ("decay_style", "lr_decay_style")}
    fields = {}
    for field in SCHEDULE_FLAGS:
        for name in aliases.get(field, (field,)):
            if name in saved:
                fields[field] = saved[name]
                break
    return fields


def schedule_mismatch(wanted: dict, saved: dict) -> tuple[str, object, object] | None:
    """The first field (megatron-core's order) where this run's schedule ``wanted`` differs from
    a checkpoint's ``opt_param_scheduler`` entry: ``(field, this run's, the checkpoint's)``;
    None when they agree (what megatron-core's ``_check_and_set`` asserts without
    --override-/--use-checkpoint-opt-param-scheduler)."""
    saved = saved_schedule_fields(saved)
    for field in SCHEDULE_FLAGS:
        if field in saved and field in wanted and saved[field] != wanted[field]:
            return field, wanted[field], saved[field]
    return None


def make_lr_scheduler(optimizer, settings: OptimizerSettings, train_iters: int,
                      global_batch_size: int):
    """megatron-core's OptimizerParamScheduler for ``train_iters`` iterations of
    ``global_batch_size`` samples, counting samples (module docstring); sets the first
    iteration's learning rate now, ``step(global_batch_size)`` after each optimizer step."""
    # megatron-core: not at `autohet` start-up
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    settings.validate(train_iters)
    return OptimizerParamScheduler(
        optimizer, init_lr=LR_WARMUP_INIT,
        use_checkpoint_opt_param_scheduler=settings.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=settings.override_opt_param_scheduler,
        **schedule_fields(settings, train_iters, global_batch_size))
