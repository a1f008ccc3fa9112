"""The S3 tier of a save: one copy of every main chunk, the manifest last and only once.

``upload_step(store, manifest, step_dir, *, rank, keep, group) -> Uploaded`` runs on every rank
after a step is committed locally (in the background writer when ``--async-save``): each rank
uploads the main data files it wrote (``__<rank>_<i>.distcp``; replicas stay on local disks: S3
holds one copy), rank 0 the small files. When every rank has succeeded, rank 0 writes the manifest
with ``IfNoneMatch='*'`` - the step now exists in S3, complete - then the ``latest`` pointer, and
deletes the steps beyond the newest ``keep``. A failed upload (S3 unreachable) is reported and
leaves no manifest, so the step does not exist in S3; the next save uploads its own step, which is
how the tier catches up. Two savers racing for the same step: the second manifest write finds the
first one and backs off. A step already committed in S3 by another save (a job that recovered
from older disk copies while S3 was unreachable, --autohet-resume-without-s3, saving an iteration
S3 holds) is not uploaded at all: its data files would replace the committed step's under a
manifest that does not describe them; the result says so (``taken``).

With a ``deadline`` (a preemption notice's, checkpoint/deadline.py) a rank does not start a file
whose upload cannot end before it, estimated from the bandwidth its uploads of this step measured
so far, and stops waiting for one still running when its time is up (the upload goes on in the
background until the node goes; without the manifest it commits nothing): what follows - the
re-plan, whose broadcast the leaving ranks take part in - must not miss the deadline. ``give_up``
(an event) does the same at once when set: a notice's stop does not wait for the upload of an
older step that a background save is making. A skipped file leaves the step uncommitted in S3
(the manifest goes only over a complete step); the result says which files were skipped and
why.
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from megatron_autohet.checkpoint.deadline import Deadline, Throughput
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


GIVEN_UP = "a preemption notice's stop came first"


@dataclass(frozen=True)
class Skipped:
    """A file a rank did not upload before the deadline."""
    rank: int
    name: str
    size: int
    why: str


@dataclass(frozen=True)
class Uploaded:
    """What :func:`upload_step` did: ``committed`` (this call wrote the step's manifest in S3;
    False also when another saver had), the files every rank skipped, and the bytes every rank
    sent; ``taken``: the S3 address of another save's committed manifest of this iteration,
    found before any file was sent (nothing was), else None."""
    committed: bool
    skipped: list[Skipped]
    bytes: int
    taken: str | None = None


def upload_step(store, manifest: Manifest, step_dir: Path, *, rank: int, keep: int,
                group=None, deadline: Deadline | None = None,
                give_up: threading.Event | None = None) -> Uploaded:
    """Upload step ``manifest.iteration`` (collective over ``group``); with ``deadline`` or
    ``give_up``, only the files sent before them, and the manifest only when no rank skipped
    one."""
    prefix = step_dir_name(manifest.iteration)
    key = f"{prefix}/{MANIFEST_FILE}"

    def committed_by_another():
        # One GET by rank 0, before any data file goes: a committed step's files must never be
        # replaced (the manifest's conditional PUT guards only the manifest). This save's own
        # manifest there (a step committed by an earlier try of it) is no other's.
        if rank != 0:
            return None
        there = store.get_bytes(key)
        return None if there is None or there == manifest.to_json() else store.location.uri(key)

    # (a failure here is the upload's failure, said as such)
    taken = on_every_rank(committed_by_another, group, f"uploading iteration "
                          f"{manifest.iteration} to {store.location.uri()}")[0]
    if taken is not None:
        return Uploaded(False, [], 0, taken)

    def upload_mine():
        names = files_to_upload(manifest, rank)
        sizes = {name: manifest.files[name].size for name in names}
        skipped, sent, meter = [], 0, Throughput()
        with byte_progress(sum(sizes.values()), f"upload {prefix} (rank {rank})",
                           show=rank == 0) as bar:
            for name in names:
                why = _why_not(sizes[name], meter.rate, deadline, give_up, bool(skipped))
                if why is None:
                    start = time.monotonic()
                    why = _upload_by(store, step_dir / name, f"{prefix}/{name}", bar.update,
                                     deadline, give_up)
                if why is not None:
                    skipped.append(Skipped(rank, name, sizes[name], why))
                    continue
                meter.add(sizes[name], time.monotonic() - start)
                sent += sizes[name]
        return skipped, sent

    mine = on_every_rank(upload_mine, group, f"uploading iteration {manifest.iteration} to "
                                             f"{store.location.uri()}")
    skipped = [s for rank_skipped, _ in mine for s in rank_skipped]
    sent = sum(rank_sent for _, rank_sent in mine)

    def commit():
        if rank != 0 or skipped:
            return None
        if not store.put_bytes_if_absent(key, manifest.to_json()):
            return False                      # another saver committed this step first
        store.put_bytes(LATEST_FILE, str(manifest.iteration).encode())
        for old in store.list_steps()[:-keep]:
            store.delete_step(old)
        return True

    committed = on_every_rank(commit, group, f"committing iteration {manifest.iteration} in "
                                             f"{store.location.uri()}")[0]
    return Uploaded(bool(committed), skipped, sent)


def _upload_by(store, path: Path, key: str, progress, deadline: Deadline | None,
               give_up: threading.Event | None) -> str | None:
    """Upload ``path``; with ``deadline`` or ``give_up``, wait for it only until the time is
    up or the event set, and say so (boto3 cannot cancel an upload, and its progress callbacks
    come as the body is read - for a checksum, all at once - not as it is sent, so neither
    could stop it). None: uploaded."""
    if deadline is None and give_up is None:
        store.upload_file(path, key, progress=progress)
        return None
    failed: list[BaseException] = []

    def upload() -> None:
        try:
            store.upload_file(path, key, progress=progress)
        except BaseException as err:  # noqa: BLE001 - raised again in the caller's thread
            failed.append(err)
    thread = threading.Thread(target=upload, daemon=True, name=f"upload {key}")
    thread.start()
    while thread.is_alive():
        if give_up is not None and give_up.is_set():
            return f"still uploading when given up: {GIVEN_UP} (left running)"
        if deadline is not None and deadline.left() <= 0:
            return "still uploading when the time before the deadline was up (left running)"
        thread.join(0.1)
    if failed:
        raise failed[0]
    return None


def _why_not(size: int, rate: float | None, deadline: Deadline | None,
             give_up: threading.Event | None, after_skip: bool) -> str | None:
    """Why a file is not started; None: it is."""
    if give_up is not None and give_up.is_set():
        return GIVEN_UP
    if deadline is None:
        return None
    if after_skip:
        return "a file before it was skipped: the step cannot be complete in S3"
    if deadline.fits(size, rate):
        return None
    if rate is None or deadline.left() <= 0:
        return "no time left before the deadline"
    return (f"{size / 2**20:.1f} MiB at the {rate / 2**20:.2f} MiB/s measured need "
            f"{size / rate:.1f} s, {deadline.left():.1f} s left before the deadline")
