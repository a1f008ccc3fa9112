"""Loading verified chunks into this rank's (possibly different) plan.

``wanted_regions(state_dict)``: the tensor regions and objects this rank's NEW shards ask for
(what recovery intersects with the saved chunks, checkpoint/recovery_plan.py).

``load_streamed(state_dict, step_dir, board, chunk_at, order) -> dict``: megatron-core's
``dist_checkpointing.load`` of a step whose chunk bytes come from a :class:`ChunkBoard` as
recovery verifies them (checkpoint/recovery.py), so loading runs while the chunks still arrive:
the torch_dist strategy has torch DCP reshard the chunks into this rank's shards, reading each
through :class:`BoardReader` (which waits for it), ``common.pt`` is read from ``step_dir`` with
torch's default ``weights_only=True``, and access validation is off for the same reason as at
save time (checkpoint/state.py: mixed TP degrees have no single local shape per key). The caller
then copies the values into the live model, optimizer and scheduler
(checkpoint/state.py ``apply_loaded``).
"""

from __future__ import annotations

import dataclasses
import io
import threading
import warnings
from collections import Counter
from pathlib import Path

from megatron_autohet.checkpoint.recovery_plan import Wanted


class CorruptCheckpoint(RuntimeError):
    """A checkpoint file whose bytes do not match its manifest."""


def wanted_regions(sharded_state_dict: dict) -> list[Wanted]:
    """The tensor regions and objects a sharded state dict asks for (factories applied)."""
    # megatron-core: on first use, not with this module
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


class ChunkBoard:
    """Verified chunk bytes by chunk index, filled by recovery's fetch (any thread) and read by
    the streaming load: :meth:`get` waits until the chunk is put, or raises once the board has
    failed (the step cannot be recovered) or for a chunk the fetch was never asked for (it would
    never come). :meth:`done` drops a chunk once loaded."""

    def __init__(self, expected):
        self._expected = set(expected)
        self._chunks: dict[int, memoryview | bytes] = {}
        self._error: BaseException | None = None
        self._changed = threading.Condition()

    def put(self, index: int, raw: memoryview | bytes) -> None:
        with self._changed:
            self._chunks[index] = raw
            self._changed.notify_all()

    def fail(self, error: BaseException) -> None:
        with self._changed:
            self._error = error
            self._changed.notify_all()

    def get(self, index: int) -> memoryview | bytes:
        if index not in self._expected:
            raise CorruptCheckpoint(f"the load asked for chunk {index}, which recovery did not "
                                    "plan to fetch")
        with self._changed:
            self._changed.wait_for(lambda: index in self._chunks or self._error is not None)
            if index in self._chunks:
                return self._chunks[index]
            raise self._error

    def done(self, index: int) -> None:
        with self._changed:
            self._chunks.pop(index, None)


def _board_reader(step_dir: str | Path, board: ChunkBoard, chunk_at: dict[tuple[str, int], int],
                  order: dict[int, int]):
    # torch: on first use, not with this module
    from torch.distributed.checkpoint import FileSystemReader

    class BoardReader(FileSystemReader):
        """DCP's FileSystemReader whose chunk bytes come from ``board``, not from the files:
        a chunk (file, offset in the index) is ``chunk_at``'s index; read items go one by one
        in ``order`` of their chunks (the own-disk chunks first, received ones as they arrive),
        each waiting for its chunk. torch 2.13's reader takes every item's bytes from
        ``_slice_file``; the files it opens first are empty placeholders in ``step_dir``."""

        def read_data(self, plan, planner):
            chunks = []
            for item in plan.items:
                info = self.storage_data[item.storage_index]
                chunks.append((chunk_at[(info.relative_path, info.offset)], item))
            uses = Counter(index for index, _ in chunks)
            done = None
            for index, item in sorted(chunks, key=lambda c: order.get(c[0], len(order))):
                done = super().read_data(dataclasses.replace(plan, items=[item]), planner)
                done.wait()
                uses[index] -= 1
                if not uses[index]:
                    board.done(index)
            return done if done is not None else super().read_data(plan, planner)

        def _slice_file(self, file, sinfo):
            return io.BytesIO(board.get(chunk_at[(sinfo.relative_path, sinfo.offset)]))

    return BoardReader(step_dir)


def load_streamed(state_dict: dict, step_dir: str | Path, board: ChunkBoard,
                  chunk_at: dict[tuple[str, int], int], order: dict[int, int]) -> dict:
    """megatron-core's ``dist_checkpointing.load`` of ``state_dict`` (this rank's
    :func:`~megatron_autohet.checkpoint.state.rank_sharded_state_dict` for loading) from
    ``step_dir`` (``common.pt``, ``metadata.json``, DCP's ``.metadata`` and a placeholder per
    data file) with the chunk bytes from ``board`` (module doc)."""
    # megatron-core: on first use, not with this module
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    class StreamedLoad(TorchDistLoadShardedStrategy):
        """megatron-core's torch_dist load with two changes: DCP reads through the board, and
        without collectives (``no_dist``: each rank plans its own reads, which is all a load
        needs), so that it runs in a thread while recovery's fetch uses the process group. The
        steps are megatron's own ``TorchDistLoadShardedStrategy.load`` (0.16.1 to 0.19.x)."""

        # megatron-core 0.19 also passes ``async_strategy``, which picks its file reader: the
        # reader here is the board's, so it has nothing to choose.
        def load(self, sharded_state_dict, checkpoint_dir, async_strategy=None):
            # torch, megatron-core: on first use, not with this module
            from megatron.core.dist_checkpointing.dict_utils import nested_values
            from megatron.core.dist_checkpointing.mapping import ShardedTensor
            from megatron.core.dist_checkpointing.strategies import torch as mcore
            from torch.distributed import checkpoint

            flexible = [t for t in nested_values(sharded_state_dict)
                        if isinstance(t, ShardedTensor) and not t.allow_shape_mismatch]
            mismatch_ok = {t.key: t for t in nested_values(sharded_state_dict)
                           if isinstance(t, ShardedTensor) and t.allow_shape_mismatch}
            original = sharded_state_dict
            sharded_state_dict, flat_mapping, rename_mapping = \
                mcore._replace_state_dict_keys_with_sharded_keys(sharded_state_dict)
            pyt_state_dict = mcore.mcore_to_pyt_state_dict(sharded_state_dict, True)
            checkpoint.load_state_dict(
                pyt_state_dict, _board_reader(checkpoint_dir, board, chunk_at, order),
                planner=mcore.MCoreLoadPlanner(
                    shapes_validation_sharded_tensors=flexible,
                    allow_shape_mismatch_sharded_tensors=mismatch_ok),
                no_dist=True)
            loaded = {k: mcore._unwrap_pyt_sharded_tensor(v) for k, v in pyt_state_dict.items()}
            loaded = mcore._replace_sharded_keys_with_state_dict_keys(loaded, flat_mapping,
                                                                       rename_mapping)
            mcore._restore_dict_types(loaded, original)
            return loaded

    with warnings.catch_warnings():
        # DCP's load_state_dict is deprecated in torch (megatron-core 0.16.1 calls it; same
        # reader), and warns that no_dist means one process: it does, for this rank's reads.
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return dist_checkpointing.load(state_dict, str(step_dir), sharded_strategy=StreamedLoad(),
                                       validate_access_integrity=False)
