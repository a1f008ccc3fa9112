"""What a checkpoint holds for one rank, expressed as megatron-core sharded state dicts.

Public API
----------
``TrainingProgress(iteration, consumed_train_samples)``
    Where training stands; the data position is ``consumed_train_samples`` (global batches are
    deterministic in the sample index, so resuming at it repeats and skips nothing).
``rank_sharded_state_dict(trainer, *, for_load=False, masters=None) -> dict``
    This rank's model weights, Adam moments and (16-bit training) fp32 master weights as
    ``ShardedTensor``s keyed by global name with global shapes and offsets (megatron-core's own
    ``GPTModel.sharded_state_dict``), each marked main or replica by the plan's owner map;
    ``for_load`` builds the same entries over empty fp32 targets for a load (the optimizer may
    have no state yet; host tensors for the distributed optimizer, which takes them in bucket by
    bucket), with master entries when ``masters`` (the checkpoint has them:
    :func:`saved_master_weights`).
``saved_master_weights(keys) -> bool``
    Whether a checkpoint with these tensor keys was saved by a 16-bit job (holds fp32 masters).
``common_state(trainer, scheduler, progress, *, seed, train_args) -> dict``
    What is the same on every rank, laid out as Megatron-LM's ``save_checkpoint`` lays out
    ``common.pt`` (:func:`megatron_args`, ``checkpoint_version``, ``iteration``,
    ``opt_param_scheduler`` in samples, ``optimizer`` = ``{"state": {"common_step"},
    "param_groups"}``, ``content_metadata``, ``num_floating_point_operations_so_far``) plus our
    own ``autohet`` entry (plan, seed, training arguments). Megatron writes it once.
``megatron_args(plan, progress, config) -> argparse.Namespace``
    The ``args`` of ``common.pt``: what Megatron-LM's ``load_checkpoint`` and
    ``--use-checkpoint-args`` read from it.
``snapshot(state_dict, buffers=None) -> dict``
    The same entries over host copies of their tensors: what a background save writes while
    training changes the live tensors. ``SnapshotBuffers`` keeps the pinned host memory of one
    save for the next.
``rng_sharded_object(trainer, world_size) -> ShardedObject``
    This rank's RNG states (torch's CPU and, on a GPU, default CUDA generator, and megatron's
    model-parallel streams), one per rank.
``apply_loaded(trainer, scheduler, loaded, *, load_optim, finetune) -> TrainingProgress``
    Copy a loaded state dict into the live model, optimizer and scheduler; reads our steps and
    stock Megatron-LM's alike (the same ``common.pt`` layout). A schedule that differs from the
    job's without --override-/--use-checkpoint-opt-param-scheduler is :class:`ScheduleMismatch`.

Design (why)
------------
* Layout independence comes from megatron-core: ``GPTModel.sharded_state_dict`` keys every
  parameter by its global name, layers stacked along a leading axis at their GLOBAL layer number
  (this runtime's stage models carry global layer numbers), TP shards as offsets into the full
  tensor. torch DCP (the ``torch_dist`` format) stores those chunks with an index and reads any
  other chunking back, so a checkpoint loads into any other TP degree, layer split or number of
  pipelines, and stock Megatron-LM reads the same keys.
* One main copy per chunk. Megatron derives ``replica_id`` from a global data-parallel rank that
  pipelines of different shapes do not have (a TP2 stage even gets a DP group spanning both TP
  ranks, so half its layer would have no main copy). Every ``replica_id`` is replaced here by the
  plan's owner map (layout/owners.py): main ``(0, 0, 0)`` on exactly one holder of each chunk,
  ``(1, 0, 0)`` elsewhere. megatron's per-rank ``validate_access_integrity`` assumes one local
  shape per key, which mixed TP degrees break, so it is off and the owner map is what guarantees
  exactly one writer per chunk (tests/layout/test_layout.py checks it for every proof plan).
* The distributed optimizer (runtime/distributed_optimizer.py) writes and reads the same
  entries: a save all-gathers its moment (and, 16-bit, master) shards into per-parameter
  tensors, a load scatters the per-parameter tensors back into its shards, so one checkpoint
  serves both optimizers in either precision.
* Adam moments reuse the parameter's sharding (megatron-core's ``make_sharded_optimizer_tensor``,
  keys ``optimizer.state.exp_avg.<param key>``, the keys Megatron-LM's optimizer writes). AdamW is
  elementwise, so moments reshard exactly like the weights. The step count is one integer for all
  parameters and lives in the common state.
* Mixed precision: a 16-bit job saves what megatron-core's ``Float16OptimizerWithFloat16Params``
  saves: the 16-bit weights under the model keys and the fp32 master weights as optimizer state
  ``optimizer.state.fp32_param.<param key>``, the Adam moments keyed to the same parameters.
  A load reads the weights into fp32 targets and takes the masters when the checkpoint has them
  (else the weights: an fp32 checkpoint's weights are masters), then derives this job's 16-bit
  weights from them (runtime/mixed_precision.py ``write_back``). So a bf16 job resumes bit for
  bit, and any checkpoint loads into any plan in either precision: an fp32 job loading a bf16
  checkpoint continues from its fp32 masters. ``--no-load-optim`` skips the optimizer state, the
  masters included, and starts from the 16-bit weights, as Megatron-LM does.
* RNG states are per rank and only meaningful for the same rank layout: they are restored when the
  checkpoint's plan equals the job's plan, else every rank keeps the streams seeded from the seed
  (only dropout draws from them, and dropout masks depend on the plan anyway:
  runtime/stage_model.py).
* ``common.pt`` is stock Megatron-LM's (core_v0.16.1, ``megatron/training/checkpointing.py``
  ``generate_state_dict`` / ``load_checkpoint``), so that stock Megatron-LM (homogeneous TP x PP,
  ``--ckpt-format torch_dist``, ``--transformer-impl local``, fp32) loads our steps and continues,
  and our plans load stock's (tests/megatron/test_megatron_interop.py proves both):

  - ``optimizer`` is what megatron-core's non-distributed fp32 optimizer
    (``FP32Optimizer.sharded_state_dict``) leaves in the common part: the step shared by all
    parameters as ``state.common_step``, and the parameter groups without their params. Its
    ``load_state_dict`` matches groups by (wd_mult, lr_mult, is_expert_parallel,
    is_decoupled_lr) and merges the list with its own groups index by index, so there are
    exactly megatron's two dense-GPT groups (decayed, not decayed) with megatron's group fields.
  - ``opt_param_scheduler`` counts SAMPLES, as Megatron-LM's ``get_optimizer_param_scheduler``
    does (runtime/optimizer.make_lr_scheduler does the same): stock asserts each field equals
    its own unless ``--use-checkpoint-opt-param-scheduler`` / ``--override-opt-param-scheduler``.
  - ``args`` says ``no_save_rng=True``: our RNG states are per rank of a plan
    (``autohet.rng_state``), not stock's ``rng_state`` objects, and with that flag stock skips
    its RNG load instead of asking for objects the step does not have. TP/PP sizes are recorded
    only when the plan has one of each (stock compares them only to decide about RNG).
  - ``num_floating_point_operations_so_far`` is 0: stock only uses it for throughput logging.
"""

from __future__ import annotations

from argparse import Namespace
from dataclasses import dataclass, replace

import torch

from megatron_autohet.layout.owners import is_main_replica
from megatron_autohet.layout.params import ParamLayout, stage_global_name
from megatron_autohet.runtime.mixed_precision import MASTER_DTYPE, MASTER_KEY
from megatron_autohet.runtime.optimizer import (ADAM_STATE_KEYS, SCHEDULE_FLAGS, adam_step,
                                                schedule_mismatch)
from megatron_autohet.spec.model import VOCAB_PAD_UNIT

MAIN_REPLICA = (0, 0, 0)
OTHER_REPLICA = (1, 0, 0)
MASTER_PREFIX = f"optimizer.state.{MASTER_KEY}"
RNG_KEY = "autohet.rng_state"
CHECKPOINT_VERSION = 3.0            # Megatron-LM's current checkpoint_version
# Megatron-LM's _build_sharded_state_dict_metadata without a distributed optimizer.
CONTENT_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
# The fields megatron-core's _get_param_groups gives each group of a dense model besides
# wd_mult (one learning rate, no experts, no --decoupled-lr).
MEGATRON_GROUP_FIELDS = {"lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": False,
                         "default_config": True}


@dataclass(frozen=True)
class TrainingProgress:
    iteration: int                  # optimizer steps taken
    consumed_train_samples: int


def _layout_of(trainer, local_name: str) -> ParamLayout:
    """The parameter's layout, or for a non-parameter entry (a layer's ``_extra_state``) a
    TP-replicated pseudo-layout under its global name."""
    if local_name in trainer.layouts:
        return trainer.layouts[local_name]
    role = trainer.state.role
    name = stage_global_name(local_name, role.stage.chunks, trainer.plan.model.tie_embeddings)
    return ParamLayout(name, (), None, role.tp_rank, role.stage.tp_size)


def model_sharded_state_dict(trainer) -> dict:
    """megatron-core's sharded state dict of this rank's stage, replica ids from the owner map."""
    # The DP group megatron records in the entries (replica ids, rewritten below) is passed, not
    # looked up in megatron-core's globals (0.19 would ask for its GTP-remat variant there).
    state_dict = trainer.model.sharded_state_dict(
        metadata={"dp_cp_group": trainer.state.pg_collection.dp_cp})
    rank = trainer.state.role.rank
    for local_name, entry in state_dict.items():
        main = is_main_replica(trainer.plan, rank, _layout_of(trainer, local_name))
        entry.replica_id = MAIN_REPLICA if main else OTHER_REPLICA
    return state_dict


def _load_target(entry, like: torch.Tensor, device: torch.device | None):
    """``entry`` over an empty tensor shaped and typed as ``like``, on ``device`` (None:
    ``like``'s)."""
    # megatron-core: on first use, not with this module
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    data = torch.empty_like(like, device=device)
    if isinstance(entry, ShardedTensor):
        return replace(entry, data=data, dtype=data.dtype)
    return replace(entry, data=data)          # a ShardedTensorFactory builds from its data


def saved_master_weights(keys) -> bool:
    return any(key.startswith(MASTER_PREFIX + ".") for key in keys)


def rank_sharded_state_dict(trainer, *, for_load: bool = False,
                            masters: bool | None = None) -> dict:
    """``{"model": ..., "optimizer": ...}``: weights, Adam moments and fp32 masters of this rank
    (module doc); ``masters`` (loads only): whether to ask for master entries."""
    # megatron-core: on first use, not with this module
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    model = model_sharded_state_dict(trainer)
    states = {} if for_load else _adam_states(trainer)
    optimizer = {}
    with_masters = masters if for_load else bool(trainer.precision.master_bytes)
    # The distributed optimizer's load targets are host tensors: unsharded, its state does
    # not fit where it trains (runtime/distributed_optimizer.py); it takes them in bucket by
    # bucket. The other optimizer keeps its loaded moments (:func:`_owned`): device targets.
    target_device = torch.device("cpu") if trainer.distributed_optimizer else None
    for name, param in trainer.model.named_parameters():
        master = _master(trainer, name, param, states, for_load)
        if for_load:        # fp32 targets: a checkpoint's fp32 weights arrive unrounded
            model[name] = _load_target(model[name], master, target_device)
        state = states.get(name, {})
        for key in ADAM_STATE_KEYS:
            # a load target is overwritten whole (the load fails on a region it cannot fill);
            # before the first step a save has zero moments
            tensor = (torch.empty_like(master, device=target_device) if for_load
                      else state[key] if key in state else torch.zeros_like(master))
            optimizer[f"{key}.{name}"] = make_sharded_optimizer_tensor(
                model[name], tensor, prefix=f"optimizer.state.{key}")
        if with_masters:
            optimizer[f"{MASTER_KEY}.{name}"] = make_sharded_optimizer_tensor(
                model[name],
                torch.empty_like(master, device=target_device) if for_load else master,
                prefix=MASTER_PREFIX)
    return {"model": model, "optimizer": optimizer}


def _adam_states(trainer) -> dict:
    """Local parameter name -> its Adam moments in the parameter's local shape. The distributed
    optimizer all-gathers them from its shards (a collective of every rank)."""
    if trainer.distributed_optimizer:
        return trainer.optimizer.param_states()
    return {name: trainer.optimizer.state.get(trainer.masters.by_name[name], {})
            for name, _ in trainer.model.named_parameters()}


def _master(trainer, name: str, param, states: dict, for_load: bool):
    """The fp32 tensor a checkpoint holds for a parameter (for a load, one shaped like it): its
    master copy, the parameter itself in fp32. The distributed optimizer's masters are shards
    of its own, gathered per parameter into ``states`` by :func:`_adam_states`."""
    if param.dtype == MASTER_DTYPE:
        return param
    if trainer.masters is not None:
        return trainer.masters.by_name[name]
    if for_load:
        return torch.empty(param.shape, dtype=MASTER_DTYPE, device="meta")   # shape and dtype
    return states[name][MASTER_KEY]


def _owned(tensor, master, kept: set[int]):
    """``tensor`` as an Adam moment of ``master``: itself when it is a whole, contiguous tensor
    on master's device that no other kept state shares (the load target made for it), else a
    copy."""
    if (tensor.device == master.device and tensor.is_contiguous()
            and tensor.storage_offset() == 0 and tensor.data_ptr() not in kept
            and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()):
        kept.add(tensor.data_ptr())
        return tensor
    return tensor.to(master.device).clone()


def optimizer_step(trainer) -> int:
    if trainer.distributed_optimizer:
        return trainer.optimizer.steps
    steps = {int(s["step"]) for s in trainer.optimizer.state.values() if "step" in s}
    if len(steps) > 1:
        raise RuntimeError(f"parameters are at different optimizer steps {sorted(steps)}")
    return steps.pop() if steps else 0


def megatron_args(plan, progress: TrainingProgress, config) -> Namespace:
    """``args`` as Megatron-LM saves it, reduced to what a loading Megatron-LM reads: the model
    dimensions (``check_checkpoint_args``, ``--use-checkpoint-args``; the dropout from the
    stage's TransformerConfig ``config``), the data position, and
    the flags deciding what else it loads (module docstring). Primitives only: ``common.pt`` is
    read with ``weights_only=True``."""
    model = plan.model
    tps = {s.tp for p in plan.pipelines for s in p.stages}
    depths = {len(p.stages) for p in plan.pipelines}
    args = Namespace(
        num_layers=model.num_layers, hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size, num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        group_query_attention=model.num_query_groups != model.num_attention_heads,
        seq_length=plan.seq_length, max_position_embeddings=model.seq_length,
        position_embedding_type=model.position_embedding_type, swiglu=model.gated_linear_unit,
        untie_embeddings_and_output_weights=not model.tie_embeddings,
        normalization=model.normalization, add_bias_linear=model.linear_biases,
        hidden_dropout=config.hidden_dropout, attention_dropout=config.attention_dropout,
        make_vocab_size_divisible_by=VOCAB_PAD_UNIT, padded_vocab_size=model.padded_vocab_size(tps),
        micro_batch_size=plan.micro_batch_size, global_batch_size=plan.global_batch_size,
        consumed_train_samples=progress.consumed_train_samples, skipped_train_samples=0,
        consumed_valid_samples=0, ckpt_format="torch_dist", no_save_optim=False,
        no_save_rng=True)
    if len(tps) == 1:
        args.tensor_model_parallel_size = tps.pop()
    if len(depths) == 1:
        args.pipeline_model_parallel_size = depths.pop()
    return args


def _megatron_param_groups(trainer, scheduler) -> list[dict]:
    """The optimizer's groups as megatron-core's optimizer saves them (no params)."""
    groups = []
    for group in trainer.optimizer.param_groups:
        fields = {k: v for k, v in group.items() if k != "params"}
        groups.append({**MEGATRON_GROUP_FIELDS, "max_lr": scheduler.max_lr,
                       "min_lr": scheduler.min_lr, **fields})
    return groups


def common_state(trainer, scheduler, progress: TrainingProgress, *, seed: int,
                 train_args: dict) -> dict:
    step = optimizer_step(trainer)
    return {
        "args": megatron_args(trainer.plan, progress, trainer.model.config),
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": progress.iteration,
        "num_floating_point_operations_so_far": 0,
        "opt_param_scheduler": scheduler.state_dict(),
        "optimizer": {"state": {"common_step": torch.tensor(float(step))} if step else {},
                      "param_groups": _megatron_param_groups(trainer, scheduler)},
        "content_metadata": dict(CONTENT_METADATA),
        "autohet": {"plan": trainer.plan.to_dict(), "seed": seed, "train_args": train_args},
    }


class SnapshotBuffers:
    """Pinned host memory for the device tensors of one save, kept for the next save: pinning
    (``cudaHostAlloc`` locks every page) is slow, and every save of a job has the same
    tensors. Whoever holds it must not snapshot again before the write of the previous
    snapshot is done (the checkpointer waits for its background writer first)."""

    def __init__(self):
        self._layout: list[tuple[torch.Size, torch.dtype]] = []
        self._buffers: list[torch.Tensor] = []

    def take(self, tensors: list[torch.Tensor], *, pin: bool) -> list[torch.Tensor]:
        """One contiguous host tensor per tensor (same shape and dtype): the previous call's
        when the layout is the same, else new ones (``pin``: page-locked)."""
        layout = [(t.shape, t.dtype) for t in tensors]
        if layout != self._layout:
            self._buffers = []                  # the old layout's pinned memory goes first
            self._buffers = [torch.empty(shape, dtype=dtype, pin_memory=pin)
                             for shape, dtype in layout]
            self._layout = layout
        return self._buffers


def snapshot(state_dict: dict, buffers: SnapshotBuffers | None = None) -> dict:
    """Host copies of every tensor in a sharded state dict (in place on the entries, which
    :func:`rank_sharded_state_dict` builds fresh for each save).

    CUDA tensors are copied into ``buffers`` (pinned, reused by the next save of the same
    layout; new pageable ones without it) on one side stream, with ``non_blocking`` copies and a
    single synchronize: the training thread waits for the transfer once, not per tensor.
    Host tensors are cloned on a CPU job (a state dict without CUDA tensors), where they are
    the live state; beside CUDA tensors they are copies made for this save (the distributed
    optimizer's gathered state, 12 B per parameter in bf16) and are kept as they are."""
    # megatron-core: on first use, not with this module
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    entries = [entry for entry in nested_values(state_dict)
               if isinstance(entry.data, torch.Tensor)]
    on_device = [entry for entry in entries if entry.data.is_cuda]
    if not on_device:
        for entry in entries:
            entry.data = entry.data.detach().clone()
        return state_dict
    tensors = [entry.data.detach() for entry in on_device]
    host = (buffers or SnapshotBuffers()).take(tensors, pin=buffers is not None)
    streams = {}
    for tensor in tensors:
        if tensor.device not in streams:
            stream = torch.cuda.Stream(tensor.device)
            stream.wait_stream(torch.cuda.current_stream(tensor.device))   # training's writes
            streams[tensor.device] = stream
    for entry, tensor, copy in zip(on_device, tensors, host):
        with torch.cuda.stream(streams[tensor.device]):
            copy.copy_(tensor, non_blocking=True)
        entry.data = copy
    for stream in streams.values():
        stream.synchronize()
    return state_dict


def rng_sharded_object(trainer, world_size: int):
    # megatron-core: on first use, not with this module
    from megatron.core import tensor_parallel
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    rank = trainer.state.role.rank
    states = {"torch": torch.get_rng_state(),
              "model_parallel": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if trainer.device.type == "cuda":
        # the default CUDA generator: megatron's hidden dropout (bias-dropout-add) runs outside
        # the tracker's forks and draws from it
        states["cuda"] = torch.cuda.get_rng_state(trainer.device)
    return ShardedObject(RNG_KEY, states, (world_size,), (rank,), replica_id=MAIN_REPLICA)


def loaded_optimizer_step(optimizer_common: dict) -> int:
    """The step of a loaded ``common.pt`` ``optimizer`` entry: megatron-core's ``common_step``
    (torch's Adam keeps a step per parameter, saved once), else the step TE's / Apex's fused Adam
    keep per group (GPU runs of stock Megatron-LM), else 0 (saved before any step)."""
    common = optimizer_common.get("state", {}).get("common_step")
    if common is not None:
        return int(common)
    steps = {int(g["step"]) for g in optimizer_common.get("param_groups", []) if "step" in g}
    if len(steps) > 1:
        raise RuntimeError(f"parameter groups are at different optimizer steps {sorted(steps)}")
    return steps.pop() if steps else 0


class ScheduleMismatch(ValueError):
    """A step's learning-rate schedule differs from the job's and neither
    ``--override-opt-param-scheduler`` nor ``--use-checkpoint-opt-param-scheduler`` says what to
    do (megatron-core's ``_check_and_set`` would raise an AssertionError on every rank): the
    checkpointer turns it into one error line naming the flag."""

    def __init__(self, iteration: int, field: str, ours, saved):
        self.iteration, self.field, self.ours, self.saved = iteration, field, ours, saved
        super().__init__(f"this run's learning-rate schedule has {field} {ours}, the "
                         f"checkpoint's iteration {iteration} was trained with {saved}")


def check_schedule(scheduler, saved: dict, iteration: int) -> None:
    """Raise :class:`ScheduleMismatch` where megatron-core's scheduler would assert on
    ``saved`` (a step's ``opt_param_scheduler``): a differing field without either flag."""
    if getattr(scheduler, "override_opt_param_scheduler", False) or \
            getattr(scheduler, "use_checkpoint_opt_param_scheduler", False):
        return
    wanted = {field: getattr(scheduler, field) for field in SCHEDULE_FLAGS
              if hasattr(scheduler, field)}
    mismatch = schedule_mismatch(wanted, saved)
    if mismatch is not None:
        raise ScheduleMismatch(iteration, *mismatch)


@torch.no_grad()
def apply_loaded(trainer, scheduler, loaded: dict, *, load_optim: bool = True,
                 finetune: bool = False) -> TrainingProgress:
    """Copy ``loaded`` (the result of a load of :func:`rank_sharded_state_dict` plus the common
    state, ours or stock Megatron-LM's) into the live model, optimizer and scheduler. The
    hyper-parameters stay the job's unless ``--use-checkpoint-opt-param-scheduler`` (the
    scheduler's own flags; a difference without either is :class:`ScheduleMismatch`).

    As Megatron-LM's ``load_checkpoint``: ``load_optim`` False (``--no-load-optim``, and
    ``--finetune``) leaves the Adam state and the scheduler as they are (fresh); ``finetune``
    starts at iteration 0 with no consumed samples. RNG states are applied when the load asked
    for them (``RNG_KEY`` in ``loaded``)."""
    # megatron-core: on first use, not with this module
    from megatron.core import tensor_parallel

    iteration = int(loaded["iteration"])
    if load_optim:
        check_schedule(scheduler, loaded["opt_param_scheduler"], iteration)
    named = dict(trainer.model.named_parameters())
    saved_masters = loaded.get("optimizer", {}) if load_optim else {}
    if trainer.distributed_optimizer:
        # Its master shards come from the fp32 masters or weights, not from the 16-bit weights.
        masters = {name: saved_masters.get(f"{MASTER_KEY}.{name}", loaded["model"][name])
                   for name in named}
        for name, param in named.items():
            param.copy_(masters[name])
        trainer.optimizer.load(
            {name: {key: loaded["optimizer"][f"{key}.{name}"] for key in ADAM_STATE_KEYS}
             for name in named} if load_optim else None,
            loaded_optimizer_step(loaded["optimizer"]) if load_optim else 0, masters=masters)
    else:
        masters = trainer.masters.by_name
        for name, master in masters.items():
            master.copy_(saved_masters.get(f"{MASTER_KEY}.{name}", loaded["model"][name]))
        trainer.masters.write_back()
    if load_optim and not trainer.distributed_optimizer:
        kept: set[int] = set()
        step = loaded_optimizer_step(loaded["optimizer"])
        for name, master in masters.items():
            trainer.optimizer.state[master] = {
                "step": adam_step(step, master, trainer.optimizer.defaults),
                **{key: _owned(loaded["optimizer"][f"{key}.{name}"], master, kept)
                   for key in ADAM_STATE_KEYS}}
    if load_optim:
        scheduler.load_state_dict(loaded["opt_param_scheduler"])
    trainer.weights_set = True          # every weight and master came from the checkpoint
    rng = loaded.get(RNG_KEY)
    if rng is not None:
        torch.set_rng_state(rng["torch"])
        tensor_parallel.get_cuda_rng_tracker().set_states(rng["model_parallel"])
        if "cuda" in rng and trainer.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], trainer.device)
    if finetune:
        return TrainingProgress(iteration=0, consumed_train_samples=0)
    return TrainingProgress(
        iteration=iteration,
        consumed_train_samples=int(getattr(loaded.get("args"), "consumed_train_samples", 0)))
