"""Writing one checkpoint step: megatron-core's torch_dist files, checksums, manifest, commit.

``write_step(state_dict, common, *, iteration, plan, rank, dirs, group) -> Manifest`` is a
collective over ``group`` (every rank of the job). ``dirs`` (:class:`StepDirs`) says where each
rank writes: one shared directory for the whole job (``--save`` on a shared filesystem), or one
directory per node (``--autohet-local-ckpt-dir``, node-local disks).

Steps, on every rank:

1. The directory's leader (lowest rank writing there) creates ``iter_N.partial/``.
2. megatron-core's translation of its ShardedTensors to torch DCP (the same functions megatron's
   ``torch_dist`` strategy calls; only main replicas are kept) and torch's own
   ``torch.distributed.checkpoint.save`` with a ``FileSystemWriter`` that fsyncs every file.
   The DCP save is called directly rather than through ``dist_checkpointing.save`` for one
   reason: it takes an explicit process group, so a save can run in a background thread on a
   group of its own while training keeps the default group busy (megatron's entry point always
   uses the default group). The files are byte-for-byte megatron's format: DCP files +
   ``.metadata``, megatron's ``common.pt`` and ``metadata.json``.
3. Each rank hashes the chunks of its own data files (SHA-256 per DCP item); the records are
   all-gathered so every rank knows the whole manifest.
4. Rank 0 wrote ``.metadata``, ``common.pt`` and ``metadata.json``; their bytes are broadcast and
   the leader of every other directory writes them too, so each node-local directory can serve
   a recovery on its own.
5. Leaders write the manifest (atomically) and rename ``iter_N.partial`` to ``iter_N``; then
   ``latest_checkpointed_iteration.txt`` points at it. A crash at any point before leaves no
   committed step (readers skip directories without a manifest).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_autohet.checkpoint.manifest import (MANIFEST_FILE, FileRecord, ItemRecord, Manifest,
                                                  commit_step_dir, partial_dir, sha256_bytes,
                                                  write_atomic)

SMALL_FILES = (".metadata", "common.pt", "metadata.json")


@dataclass(frozen=True)
class StepDirs:
    """Where each rank's checkpoint files go: ``roots[rank]`` (several ranks may share one)."""

    roots: tuple[Path, ...]

    @classmethod
    def shared(cls, root: str | Path, world_size: int) -> "StepDirs":
        return cls(tuple(Path(root) for _ in range(world_size)))

    @classmethod
    def per_node(cls, template: str, plan) -> "StepDirs":
        """``template`` with ``{node}`` replaced by each rank's node name (emulated nodes on one
        machine need distinct directories); without ``{node}``, one path that every node has on
        its own local disk."""
        return cls(tuple(Path(template.replace("{node}", info.node)) for info in plan.ranks))

    def root(self, rank: int) -> Path:
        return self.roots[rank]

    def leader(self, rank: int) -> int:
        """Lowest rank writing to the same directory as ``rank``. Directories are compared by
        path: ranks of one node share one, and a shared filesystem path is one for all."""
        return self.roots.index(self.roots[rank])

    def is_leader(self, rank: int) -> bool:
        return self.leader(rank) == rank


def _dcp_save(state_dict: dict, directory: Path, group) -> "object":
    """megatron-core ShardedTensors -> torch DCP files in ``directory``; returns DCP's Metadata."""
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner, _replace_state_dict_keys_with_sharded_keys, mcore_to_pyt_state_dict)
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save

    flat, _, _ = _replace_state_dict_keys_with_sharded_keys(state_dict, keep_only_main_replica=True)
    pyt_state_dict = mcore_to_pyt_state_dict(flat, False)
    writer = FileSystemWriter(directory, single_file_per_rank=True, sync_files=True,
                              thread_count=1, overwrite=True)
    return dcp_save(pyt_state_dict, storage_writer=writer,
                    planner=MCoreSavePlanner(flatten_state_dict=False), process_group=group)


def _own_items(metadata, directory: Path, rank: int) -> tuple[list[ItemRecord], list[FileRecord]]:
    """SHA-256 of every chunk in this rank's data files (DCP names them ``__<rank>_<i>``)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    prefix = f"__{rank}_"
    items = []
    by_file: dict[str, list] = {}
    for index, info in metadata.storage_data.items():
        if info.relative_path.startswith(prefix):
            by_file.setdefault(info.relative_path, []).append((index, info))
    files = []
    for name, entries in sorted(by_file.items()):
        raw = (directory / name).read_bytes()
        files.append(FileRecord(name=name, size=len(raw), rank=rank))
        for index, info in entries:
            chunk = memoryview(raw)[info.offset:info.offset + info.length]
            sizes = None
            stored = metadata.state_dict_metadata[index.fqn]
            if isinstance(stored, TensorStorageMetadata):
                offsets = tuple(index.offset)
                sizes = next(tuple(c.sizes) for c in stored.chunks
                             if tuple(c.offsets) == offsets)
            items.append(ItemRecord(key=index.fqn, offsets=tuple(index.offset) if sizes else None,
                                    sizes=sizes, file=name, offset=info.offset,
                                    length=info.length, sha256=sha256_bytes(chunk)))
    return items, files


def write_step(state_dict: dict, common: dict, *, iteration: int, plan, rank: int,
               dirs: StepDirs, group=None) -> Manifest:
    """Write and commit step ``iteration`` (collective over ``group``; module docstring)."""
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess

    root = dirs.root(rank)
    staged = partial_dir(root, iteration)
    if dirs.is_leader(rank):
        if staged.exists():
            import shutil
            shutil.rmtree(staged)
        staged.mkdir(parents=True)
    dist.barrier(group=group)

    sharded, leftover_common = save_preprocess(state_dict, validate_access_integrity=False)
    common = {**leftover_common, **common}
    metadata = _dcp_save(sharded, staged, group)
    if rank == 0:
        buffer = io.BytesIO()
        torch.save(common, buffer)
        (staged / "common.pt").write_bytes(buffer.getvalue())
        save_config(CheckpointingConfig("torch_dist", 1), str(staged))

    items, files = _own_items(metadata, staged, rank)
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (items, files), group=group)
    small = [{name: (staged / name).read_bytes() for name in SMALL_FILES} if rank == 0 else None]
    dist.broadcast_object_list(small, src=0, group=group)
    small_files = small[0]

    all_items = [item for rank_items, _ in gathered for item in rank_items]
    all_files = {f.name: f for _, rank_files in gathered for f in rank_files}
    for name, raw in small_files.items():
        all_files[name] = FileRecord(name=name, size=len(raw), rank=0, sha256=sha256_bytes(raw))
    manifest = Manifest(iteration=iteration, files=all_files, items=all_items,
                        plan=plan.to_dict())
    if dirs.is_leader(rank):
        for name, raw in small_files.items():
            if not (staged / name).exists():
                write_atomic(staged / name, raw)
        write_atomic(staged / MANIFEST_FILE, manifest.to_json())
        commit_step_dir(root, iteration)
    dist.barrier(group=group)
    return manifest
