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
3. Each rank hashes the chunks of its own data files (a checksum per DCP item, manifest.py);
   the records are all-gathered so every rank knows the whole manifest.
4. Rank 0 wrote ``.metadata``, ``common.pt`` and ``metadata.json``; their bytes are broadcast and
   the leader of every other directory writes them too, so each node-local directory can serve
   a recovery on its own.
5. Leaders write the manifest (atomically) and rename ``iter_N.partial`` to ``iter_N``; then
   ``latest_checkpointed_iteration.txt`` points at it. A crash at any point before leaves no
   committed step (readers skip directories without a manifest).

A phase that fails on any rank fails on all of them (:func:`on_every_rank`) with
:class:`SaveFailed`, which names each distinct root cause and the ranks that hit it
(checkpoint/failures.py); the leaders then remove ``iter_N.partial``.
"""

from __future__ import annotations

import io
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter, save as dcp_save
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megatron_autohet.checkpoint.failures import full_disk, root_cause
from megatron_autohet.checkpoint.manifest import (MANIFEST_FILE, FileRecord, ItemRecord, Manifest,
                                                  checksum, commit_step_dir, partial_dir,
                                                  write_atomic)
from megatron_autohet.checkpoint.options import node_path

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
        return cls(tuple(node_path(template, info.node) for info in plan.ranks))

    def root(self, rank: int) -> Path:
        return self.roots[rank]

    def leader(self, rank: int) -> int:
        """Lowest rank writing to the same directory as ``rank``. Directories are compared by
        path: ranks of one node share one, and a shared filesystem path is one for all."""
        return self.roots.index(self.roots[rank])

    def is_leader(self, rank: int) -> bool:
        return self.leader(rank) == rank


def _dcp_save(state_dict: dict, directory: Path, group) -> tuple[object, dict]:
    """megatron-core ShardedTensors -> torch DCP files in ``directory``. Returns DCP's Metadata
    and where this rank's own chunks went (DCP ``MetadataIndex`` -> ``_StorageInfo``).

    The chunk locations come from this rank's own write results, not from the returned
    Metadata: its ``storage_data`` is filled in by the coordinator's ``FileSystemWriter.finish``,
    which since torch 2.11 fills a copy (``dataclasses.replace``), so the Metadata ``save``
    returns has ``storage_data = None`` on every rank.

    When this rank's own write fails, DCP raises a CheckpointException on every rank that carries
    each rank's exception pickled, its chain (the OSError under torch's serializer error) lost;
    here the CheckpointException is raised from this rank's own exception, chain intact."""
    # megatron-core: on first use, not with this module
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner, _replace_state_dict_keys_with_sharded_keys, mcore_to_pyt_state_dict)

    class ChunkRecordingWriter(FileSystemWriter):
        chunks: dict = {}
        error: BaseException | None = None

        def write_data(self, plan, planner):
            try:        # thread_count=1: the files are written here, in the calling thread
                future = super().write_data(plan, planner)
                self.chunks = {result.index: result.storage_data for result in future.wait()}
            except BaseException as err:
                self.error = err
                raise
            return future

    flat, _, _ = _replace_state_dict_keys_with_sharded_keys(state_dict, keep_only_main_replica=True)
    pyt_state_dict = mcore_to_pyt_state_dict(flat, False)
    writer = ChunkRecordingWriter(directory, single_file_per_rank=True, sync_files=True,
                                  thread_count=1, overwrite=True)
    try:
        metadata = dcp_save(pyt_state_dict, storage_writer=writer,
                            planner=MCoreSavePlanner(flatten_state_dict=False),
                            process_group=group)
    except CheckpointException as err:
        if writer.error is None:
            raise
        raise err from writer.error
    return metadata, writer.chunks


def own_items(metadata, chunks: dict, directory: Path, rank: int,
              node: str) -> tuple[list[ItemRecord], list[FileRecord]]:
    """The checksum of every chunk in this rank's data files (DCP names them ``__<rank>_<i>``).
    ``chunks``: chunk locations (DCP ``MetadataIndex`` -> ``_StorageInfo``), this rank's or a
    whole step's; ``metadata``: DCP's index, for each chunk's sizes."""
    prefix = f"__{rank}_"
    items = []
    by_file: dict[str, list] = {}
    for index, info in chunks.items():
        if info.relative_path.startswith(prefix):
            by_file.setdefault(info.relative_path, []).append((index, info))
    files = []
    for name, entries in sorted(by_file.items()):
        raw = (directory / name).read_bytes()
        files.append(FileRecord(name=name, size=len(raw), rank=rank, node=node))
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
                                    length=info.length, digest=checksum(chunk)))
    return items, files


# ---- replicas on other nodes' disks ------------------------------------------------------------

def _contains(entry, item: ItemRecord) -> bool:
    """Whether this rank's (non-main) entry holds all of the main chunk ``item``."""
    # megatron-core: on first use, not with this module
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    if isinstance(entry, ShardedObject):
        return item.offsets is None and entry.unique_key == item.key
    if item.offsets is None or entry.key != item.key:
        return False
    sizes = (1,) * entry.prepend_axis_num + tuple(entry.local_shape)
    return all(have <= want and want + size <= have + extent for have, extent, want, size
               in zip(entry.global_offset, sizes, item.offsets, item.sizes))


def _replica_candidates(sharded: dict, items: list[ItemRecord]) -> dict[int, object]:
    """Main chunks this rank can write a byte-identical copy of: item index -> its entry."""
    # megatron-core: on first use, not with this module
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, is_main_replica

    by_key: dict[str, list[int]] = {}
    for index, item in enumerate(items):
        by_key.setdefault(item.key, []).append(index)
    candidates = {}
    for entry in nested_values(sharded):
        if is_main_replica(entry.replica_id):
            continue
        key = entry.unique_key if isinstance(entry, ShardedObject) else entry.key
        for index in by_key.get(key, ()):
            if index not in candidates and _contains(entry, items[index]):
                candidates[index] = entry
    return candidates


def _chunk_bytes(entry, item: ItemRecord) -> bytes:
    """The bytes DCP stores for ``item``, produced from a replica's entry: megatron's object
    serialization, or ``torch.save`` of the chunk (what DCP's FileSystemWriter writes)."""
    # megatron-core: on first use, not with this module
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.strategies.torch import mcore_to_pyt_state_dict

    if isinstance(entry, ShardedObject):
        return mcore_to_pyt_state_dict({item.key: [entry]}, False)[item.key].getvalue()
    sizes = (1,) * entry.prepend_axis_num + tuple(entry.local_shape)
    chunk = entry.data.reshape(sizes)
    for dim, (start, size) in enumerate(zip(item.offsets, item.sizes)):
        chunk = chunk.narrow(dim, start - entry.global_offset[dim], size)
    buffer = io.BytesIO()
    torch.save(chunk.contiguous().clone(), buffer)
    return buffer.getvalue()


def _choose_replicas(candidates_by_rank: list, main_files: dict[str, FileRecord],
                     items: list[ItemRecord], dirs: StepDirs) -> dict[int, list[int]]:
    """At most one copy of each main chunk per directory other than the main copy's: the lowest
    rank there that can write it. Returns rank -> item indices to write."""
    chosen: dict[tuple[Path, int], int] = {}
    for rank, indices in enumerate(candidates_by_rank):
        for index in indices:
            directory = dirs.root(rank)
            if directory == dirs.root(main_files[items[index].file].rank):
                continue
            chosen.setdefault((directory, index), rank)
    per_rank: dict[int, list[int]] = {}
    for (_, index), rank in sorted(chosen.items(), key=lambda kv: kv[1]):
        per_rank.setdefault(rank, []).append(index)
    return per_rank


def _write_replicas(directory: Path, rank: int, node: str, entries: list[tuple[ItemRecord, object]]
                    ) -> tuple[list[ItemRecord], list[FileRecord]]:
    if not entries:
        return [], []
    name = f"replica_{rank}.distcp"
    records = []
    with open(directory / name, "wb") as f:
        for item, entry in entries:
            raw = _chunk_bytes(entry, item)
            records.append(ItemRecord(key=item.key, offsets=item.offsets, sizes=item.sizes,
                                      file=name, offset=f.tell(), length=len(raw),
                                      digest=checksum(raw)))
            f.write(raw)
        size = f.tell()
        f.flush()
        os.fsync(f.fileno())
    return records, [FileRecord(name=name, size=size, rank=rank, node=node)]


# ---- one step --------------------------------------------------------------------------------

class SaveFailed(RuntimeError):
    """A step could not be written; raised on every rank alike (the step is not committed).
    ``causes``: each distinct root cause (checkpoint/failures.py) -> the ranks that hit it; the
    exception this rank hit, if any, is the ``__cause__``."""

    def __init__(self, what: str, causes: dict[str, list[int]]):
        self.what = what
        self.causes = causes
        super().__init__(f"{what} failed: " + "; ".join(
            f"{cause} ({_ranks(ranks)})" for cause, ranks in causes.items()))


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


def _agree(value, error: BaseException | None, cause: str | None, group, what: str) -> list:
    """Gather every rank's (value, root cause); SaveFailed on every rank if any rank has a cause
    (``error``, this rank's exception, is its ``__cause__``)."""
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (value, cause), group=group)
    causes: dict[str, list[int]] = {}
    for rank, (_, rank_cause) in enumerate(gathered):
        if rank_cause is not None:
            causes.setdefault(rank_cause, []).append(rank)
    if causes:
        raise SaveFailed(what, causes) from error
    return [v for v, _ in gathered]


def on_every_rank(local, group, what: str) -> list:
    """Run ``local()`` here, gather every rank's result; if any rank raised, raise SaveFailed on
    all of them, naming each rank's root cause. Each phase of a save is one of these, so a
    failure on one rank (a full disk) cannot leave the others waiting in the next collective."""
    try:
        value, error = local(), None
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:  # noqa: BLE001 - torch's CheckpointException is a BaseException
        value, error = None, err
    return _agree(value, error, root_cause(error) if error is not None else None, group, what)


def _dcp_failed(err: CheckpointException, directory: Path, group, what: str) -> NoReturn:
    """DCP raised ``err`` on every rank alike: SaveFailed with each failed rank's root cause:
    its own write error's (``err.__cause__``, :func:`_dcp_save`), else - a failure elsewhere in
    DCP, whose chain the pickle lost - a full disk named as such (checkpoint/failures.py
    ``full_disk``) or DCP's message. ``err.failures`` names at least one rank, so every rank
    raises."""
    mine = err.failures.get(dist.get_rank(group))
    cause = None
    if err.__cause__ is not None:
        cause = root_cause(err.__cause__)
    elif mine is not None:
        cause = full_disk(directory) or root_cause(mine[0] if isinstance(mine, tuple) else mine)
    _agree(None, err, cause, group, what)


def write_step(state_dict: dict, common: dict, *, iteration: int, plan, rank: int,
               dirs: StepDirs, group=None, before_commit=None) -> Manifest:
    """Write and commit step ``iteration`` (collective over ``group``; module docstring).
    Raises SaveFailed on every rank when any rank fails, having removed ``iter_N.partial``.
    ``before_commit()`` runs on every rank right before the commit (the writer lease's check:
    a job whose lease was taken over commits nothing)."""
    node = plan.ranks[rank].node
    root = dirs.root(rank)
    staged = partial_dir(root, iteration)
    try:
        return _write_and_commit(state_dict, common, iteration=iteration, plan=plan, rank=rank,
                                 dirs=dirs, group=group, node=node, root=root, staged=staged,
                                 before_commit=before_commit)
    except BaseException:
        # Nothing partial left behind (a full disk would fill up further with each try): the
        # ranks are past the failed phase's gather, so nobody writes there any more.
        if dirs.is_leader(rank):
            shutil.rmtree(staged, ignore_errors=True)
        raise


def _write_and_commit(state_dict: dict, common: dict, *, iteration: int, plan, rank: int,
                      dirs: StepDirs, group, node: str, root: Path, staged: Path,
                      before_commit=None) -> Manifest:
    # megatron-core: on first use, not with this module
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess

    def prepare():
        if dirs.is_leader(rank):
            if staged.exists():
                shutil.rmtree(staged)
            staged.mkdir(parents=True)

    on_every_rank(prepare, group, f"creating {staged}")
    sharded, leftover_common = save_preprocess(state_dict, validate_access_integrity=False)
    writing = f"writing iteration {iteration} to {root}"
    try:
        metadata, chunks = _dcp_save(sharded, staged, group)
    except CheckpointException as err:         # DCP raises it on every rank if one fails
        _dcp_failed(err, staged, group, writing)

    def hash_own_files():
        small = None
        if rank == 0:
            buffer = io.BytesIO()
            torch.save({**leftover_common, **common}, buffer)
            (staged / "common.pt").write_bytes(buffer.getvalue())
            save_config(CheckpointingConfig("torch_dist", 1), str(staged))
            small = {name: (staged / name).read_bytes() for name in SMALL_FILES}
        return own_items(metadata, chunks, staged, rank, node), small

    # Main chunks: hashed by their writers and gathered, so every rank knows the manifest and
    # plans the replicas the same way.
    gathered = on_every_rank(hash_own_files, group, writing)
    small = gathered[0][1]
    all_items = [item for (items, _), _ in gathered for item in items]
    all_files = {f.name: f for (_, files), _ in gathered for f in files}
    for name, raw in small.items():
        all_files[name] = FileRecord(name=name, size=len(raw), rank=0, node=plan.ranks[0].node,
                                     digest=checksum(raw))

    candidates = _replica_candidates(sharded, all_items)
    everyone = on_every_rank(lambda: sorted(candidates), group, "planning replicas")
    mine = _choose_replicas(everyone, all_files, all_items, dirs).get(rank, [])
    written = on_every_rank(
        lambda: _write_replicas(staged, rank, node, [(all_items[i], candidates[i]) for i in mine]),
        group, "writing replicas")
    replicas = [item for items, _ in written for item in items]
    all_files.update({f.name: f for _, files in written for f in files})
    # The schedule is in the manifest too, so a resume can be checked without torch.
    manifest = Manifest(iteration=iteration, files=all_files, items=all_items,
                        plan=plan.to_dict(), replicas=replicas,
                        extra={"opt_param_scheduler": common.get("opt_param_scheduler")})

    def commit():
        if before_commit is not None:
            before_commit()
        if dirs.is_leader(rank):
            for name, raw in small.items():
                if not (staged / name).exists():
                    write_atomic(staged / name, raw)
            write_atomic(staged / MANIFEST_FILE, manifest.to_json())
            commit_step_dir(root, iteration)

    on_every_rank(commit, group, f"committing iteration {iteration}")
    return manifest
