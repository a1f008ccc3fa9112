"""What a checkpoint holds for one rank, expressed as megatron-core sharded state dicts.

Public API
----------
``TrainingProgress(iteration, consumed_train_samples)``
    Where training stands; the data position is ``consumed_train_samples`` (global batches are
    deterministic in the sample index, so resuming at it repeats and skips nothing).
``rank_sharded_state_dict(trainer, *, for_load=False) -> dict``
    This rank's model weights and Adam moments as ``ShardedTensor``s keyed by global name with
    global shapes and offsets (megatron-core's own ``GPTModel.sharded_state_dict``), each marked
    main or replica by the plan's owner map; ``for_load`` builds the same entries over empty
    targets for a load (the optimizer may have no state yet).
``common_state(trainer, scheduler, progress, *, seed, train_args) -> dict``
    What is the same on every rank: iteration and data position, the learning-rate schedule, the
    optimizer step and hyper-parameters, the plan and model it was saved under, the training
    arguments. Megatron writes it once, to ``common.pt``.
``snapshot(state_dict) -> dict``
    The same entries over host copies of their tensors: what a background save writes while
    training changes the live tensors.
``rng_sharded_object(trainer, world_size) -> ShardedObject``
    This rank's RNG states (torch's and megatron's model-parallel streams), one per rank.
``apply_loaded(trainer, scheduler, loaded) -> TrainingProgress``
    Copy a loaded state dict into the live model, optimizer and scheduler.

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
  exactly one writer per chunk (tests/test_layout.py checks it for every proof plan).
* Adam moments reuse the parameter's sharding (megatron-core's ``make_sharded_optimizer_tensor``,
  keys ``optimizer.state.exp_avg.<param key>``, the keys Megatron-LM's optimizer writes). AdamW is
  elementwise, so moments reshard exactly like the weights. The step count is one integer for all
  parameters and lives in the common state.
* RNG states are per rank and only meaningful for the same rank layout: they are restored when the
  checkpoint's plan equals the job's plan, else every rank keeps the streams seeded from the seed
  (the runtime trains with dropout 0, so no number of the loss depends on them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_autohet.layout.owners import is_main_replica
from megatron_autohet.layout.params import ParamLayout, global_param_name

MAIN_REPLICA = (0, 0, 0)
OTHER_REPLICA = (1, 0, 0)
ADAM_STATE_KEYS = ("exp_avg", "exp_avg_sq")
RNG_KEY = "autohet.rng_state"
CHECKPOINT_VERSION = 3.0            # Megatron-LM's current checkpoint_version


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
    name = global_param_name(local_name, role.stage.layers[0], trainer.plan.model.tie_embeddings)
    return ParamLayout(name, (), None, role.tp_rank, role.stage.tp_size)


def model_sharded_state_dict(trainer) -> dict:
    """megatron-core's sharded state dict of this rank's stage, replica ids from the owner map."""
    state_dict = trainer.model.sharded_state_dict()
    rank = trainer.state.role.rank
    for local_name, entry in state_dict.items():
        main = is_main_replica(trainer.plan, rank, _layout_of(trainer, local_name))
        entry.replica_id = MAIN_REPLICA if main else OTHER_REPLICA
    return state_dict


def rank_sharded_state_dict(trainer, *, for_load: bool = False) -> dict:
    """``{"model": ..., "optimizer": ...}``: weights and Adam moments of this rank."""
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    model = model_sharded_state_dict(trainer)
    optimizer = {}
    for name, param in trainer.model.named_parameters():
        state = trainer.optimizer.state.get(param, {})
        for key in ADAM_STATE_KEYS:
            tensor = torch.zeros_like(param) if for_load or key not in state else state[key]
            optimizer[f"{key}.{name}"] = make_sharded_optimizer_tensor(
                model[name], tensor, prefix=f"optimizer.state.{key}")
    return {"model": model, "optimizer": optimizer}


def optimizer_step(trainer) -> int:
    steps = {int(s["step"]) for s in trainer.optimizer.state.values() if "step" in s}
    if len(steps) > 1:
        raise RuntimeError(f"parameters are at different optimizer steps {sorted(steps)}")
    return steps.pop() if steps else 0


def common_state(trainer, scheduler, progress: TrainingProgress, *, seed: int,
                 train_args: dict) -> dict:
    groups = [{k: v for k, v in group.items() if k != "params"}
              for group in trainer.optimizer.param_groups]
    return {
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": progress.iteration,
        "consumed_train_samples": progress.consumed_train_samples,
        "opt_param_scheduler": scheduler.state_dict(),
        "optimizer_step": optimizer_step(trainer),
        "optimizer_param_groups": groups,
        "autohet": {"plan": trainer.plan.to_dict(), "seed": seed, "train_args": train_args},
    }


def snapshot(state_dict: dict) -> dict:
    """Host copies of every tensor in a sharded state dict (in place on the entries, which
    :func:`rank_sharded_state_dict` builds fresh for each save)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    for entry in nested_values(state_dict):
        if isinstance(entry.data, torch.Tensor):
            entry.data = entry.data.detach().to("cpu", copy=True)
    return state_dict


def rng_sharded_object(trainer, world_size: int):
    from megatron.core import tensor_parallel
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    rank = trainer.state.role.rank
    states = {"torch": torch.get_rng_state(),
              "model_parallel": tensor_parallel.get_cuda_rng_tracker().get_states()}
    return ShardedObject(RNG_KEY, states, (world_size,), (rank,), replica_id=MAIN_REPLICA)


@torch.no_grad()
def apply_loaded(trainer, scheduler, loaded: dict) -> TrainingProgress:
    """Copy ``loaded`` (the result of a load of :func:`rank_sharded_state_dict` plus the common
    state) into the live model, optimizer and scheduler."""
    from megatron.core import tensor_parallel

    named = dict(trainer.model.named_parameters())
    for name, param in named.items():
        param.copy_(loaded["model"][name])
    step = torch.tensor(float(loaded["optimizer_step"]), dtype=torch.float32)
    for name, param in named.items():
        trainer.optimizer.state[param] = {
            "step": step.clone(),
            **{key: loaded["optimizer"][f"{key}.{name}"].to(param.device).clone()
               for key in ADAM_STATE_KEYS}}
    scheduler.load_state_dict(loaded["opt_param_scheduler"])
    rng = loaded.get(RNG_KEY)
    if rng is not None:
        torch.set_rng_state(rng["torch"])
        tensor_parallel.get_cuda_rng_tracker().set_states(rng["model_parallel"])
    return TrainingProgress(iteration=int(loaded["iteration"]),
                            consumed_train_samples=int(loaded["consumed_train_samples"]))
