"""Loading a committed step into this rank's (possibly different) plan.

``load_step(trainer, scheduler, step_dir, manifest) -> TrainingProgress`` (every rank calls it):

1. Build this rank's sharded state dict for the NEW plan (checkpoint/state.py) - keys, global
   shapes and offsets of the shards it holds now.
2. :func:`needed_items`: the saved chunks that overlap them (checkpoint/recovery_plan.py), and
   verify each one's SHA-256 against the manifest before anything is deserialized. A mismatch or
   a short file raises :class:`CorruptCheckpoint` naming the file and the chunk: a corrupt
   checkpoint is reported, never loaded.
3. megatron-core's ``dist_checkpointing.load`` (torch_dist strategy: torch DCP reads the chunks
   and reshards them into this rank's shards; ``common.pt`` is read with torch's default
   ``weights_only=True``). Access validation is off for the same reason as at save time
   (checkpoint/state.py): mixed TP degrees have no single local shape per key.
4. Copy into the live model, optimizer and scheduler.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from megatron_autohet.checkpoint.inspect import check_local_items
from megatron_autohet.checkpoint.manifest import ItemRecord, sha256_bytes
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


def verify_items(step_dir: Path, items: list[ItemRecord]) -> int:
    """Check every item's bytes in ``step_dir`` against its SHA-256 (inspect.check_local_items,
    the check `autohet checkpoint verify` runs); returns the bytes read."""
    problems, total = check_local_items(step_dir, items)
    if problems and problems[0].item is None:
        raise CorruptCheckpoint(f"{problems[0].file}: missing (the manifest lists it)")
    if problems:
        item = problems[0].item
        raise CorruptCheckpoint(
            f"{problems[0].file}: bytes {item.offset}-{item.offset + item.length} ({item.key}) "
            f"do not match their SHA-256 in the manifest (truncated or corrupt file)")
    return total


def load_staged(trainer, scheduler, state_dict: dict, step_dir: str | Path) -> TrainingProgress:
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
    return apply_loaded(trainer, scheduler, loaded)
