"""The S3 tier of a save: one copy of every main chunk, the manifest last and only once.

``upload_step(store, manifest, step_dir, *, rank, group) -> bool`` runs on every rank after a
step is committed locally (in the background writer when ``--async-save``): each rank uploads
the main data files it wrote (``__<rank>_<i>.distcp``; replicas stay on local disks: S3 holds
one copy), rank 0 the small files. When every rank has succeeded, rank 0 writes the manifest
with ``IfNoneMatch='*'`` - the step now exists in S3, complete - then the ``latest`` pointer, and
deletes the steps beyond the newest ``keep``. A failed upload (S3 unreachable) is reported and
leaves no manifest, so the step does not exist in S3; the next save uploads its own step, which
is how the tier catches up. Two savers racing for the same step: the second manifest write finds
the first one and backs off.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tqdm import tqdm

from megatron_autohet.checkpoint.inspect import is_data_file, s3_files
from megatron_autohet.checkpoint.manifest import LATEST_FILE, MANIFEST_FILE, Manifest, step_dir_name
from megatron_autohet.checkpoint.writer import SMALL_FILES, on_every_rank


def byte_progress(total: int, desc: str, *, show: bool):
    """A tqdm bar over bytes on stderr, for one rank (the others would garble the terminal) and
    only on a terminal; long uploads and downloads show their progress."""
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                leave=False, disable=not (show and sys.stderr.isatty()))


def files_to_upload(manifest: Manifest, rank: int) -> list[str]:
    """The files ``rank`` uploads of those the S3 tier holds (inspect.s3_files): its main data
    files; rank 0 also the small files."""
    names = [name for name in s3_files(manifest)
             if is_data_file(manifest, name) and manifest.files[name].rank == rank]
    return names + (list(SMALL_FILES) if rank == 0 else [])


def upload_step(store, manifest: Manifest, step_dir: Path, *, rank: int, keep: int,
                group=None) -> bool:
    """Upload step ``manifest.iteration``; True when this call committed it in S3."""
    prefix = step_dir_name(manifest.iteration)

    def upload_mine():
        names = files_to_upload(manifest, rank)
        with byte_progress(sum(manifest.files[n].size for n in names),
                           f"upload {prefix} (rank {rank})", show=rank == 0) as bar:
            for name in names:
                store.upload_file(step_dir / name, f"{prefix}/{name}", progress=bar.update)

    on_every_rank(upload_mine, group, f"uploading iteration {manifest.iteration} to "
                                       f"{store.location.uri()}")

    def commit():
        if rank != 0:
            return None
        if not store.put_bytes_if_absent(f"{prefix}/{MANIFEST_FILE}", manifest.to_json()):
            return False                      # another saver committed this step first
        store.put_bytes(LATEST_FILE, str(manifest.iteration).encode())
        for old in store.list_steps()[:-keep]:
            store.delete_step(old)
        return True

    return bool(on_every_rank(commit, group, f"committing iteration {manifest.iteration} in "
                                              f"{store.location.uri()}")[0])


