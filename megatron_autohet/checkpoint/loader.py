"""Loading verified chunks into this rank's (possibly different) plan.

``wanted_regions(state_dict)``: the tensor regions and objects this rank's NEW shards ask for
(what recovery intersects with the saved chunks, checkpoint/recovery_plan.py).

``load_staged(trainer, scheduler, state_dict, step_dir, *, load_optim, finetune) -> TrainingProgress``: megatron-core's
``dist_checkpointing.load`` from a directory whose needed chunks were verified
(checkpoint/recovery.py stages it): the torch_dist strategy has torch DCP read the chunks and
reshard them into this rank's shards, ``common.pt`` is read with torch's default
``weights_only=True``, and access validation is off for the same reason as at save time
(checkpoint/state.py: mixed TP degrees have no single local shape per key). Then the values are
copied into the live model, optimizer and scheduler.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from megatron_autohet.checkpoint.recovery_plan import Wanted
from megatron_autohet.checkpoint.state import TrainingProgress, apply_loaded


class CorruptCheckpoint(RuntimeError):
    """A checkpoint file whose bytes do not match its manifest."""


def wanted_regions(sharded_state_dict: dict) -> list[Wanted]:
    """The tensor regions and objects a sharded state dict asks for (factories applied)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess

    preprocessed, _, _ = load_preprocess(sharded_state_dict)
    wanted = []
    for entry in nested_values(preprocessed):
        if isinstance(entry, ShardedTensor):
            sizes = (1,) * entry.prepend_axis_num + tuple(entry.local_shape)
            wanted.append(Wanted(entry.key, tuple(entry.global_offset), sizes))
        elif isinstance(entry, ShardedObject):
            wanted.append(Wanted(entry.unique_key, None, None))
    return wanted


def load_staged(trainer, scheduler, state_dict: dict, step_dir: str | Path, *,
                load_optim: bool = True, finetune: bool = False) -> TrainingProgress:
    """megatron-core's ``dist_checkpointing.load`` of ``state_dict`` (this rank's
    :func:`~megatron_autohet.checkpoint.state.rank_sharded_state_dict` for loading) from a
    directory whose chunks were verified, then copy it into the live model, optimizer and
    scheduler."""
    from megatron.core import dist_checkpointing

    with warnings.catch_warnings():
        # megatron-core 0.16.1 calls DCP's load_state_dict, which torch deprecates (same reader)
        warnings.filterwarnings("ignore", category=FutureWarning)
        loaded = dist_checkpointing.load(state_dict, str(step_dir),
                                         validate_access_integrity=False)
    return apply_loaded(trainer, scheduler, loaded, load_optim=load_optim, finetune=finetune)
