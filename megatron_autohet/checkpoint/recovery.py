"""Recovery into the job's plan: local disks first, then surviving peers, then S3.

``recover(trainer, scheduler, *, roots, s3, group) -> (TrainingProgress, RecoveryReport) | None``
is called on every rank of a (re)started job. ``roots`` are the checkpoint directories this rank
can read (its node's local-tier directory, ``--load``); ``s3`` the S3 tier, if configured (the
store checkpoint/options.py's ``object_store`` builds), read through a
:class:`~megatron_autohet.checkpoint.sources.StoreReader`: what S3 cannot give comes back as a
message, so no S3 error is handled here.

1. Discover: every rank lists the committed steps in its roots and which of their files it has
   (sizes as the manifest says); one all-gather, which also carries rank 0's listing of the S3
   tier, made meanwhile (which steps have a manifest there; a manifest is downloaded only for
   a step no disk has). An S3 tier that cannot be listed is tried again for about a minute
   (sources.reach_delays); still unreachable, every rank raises the same JobConfigError naming
   it (the job stops, status 2), since its newest step may be there alone and this job's saves
   would then be of iterations it holds: only with ``--autohet-resume-without-s3`` does recovery
   go on from the disks alone (or find nothing and train from scratch).
2. Choose the newest step that is complete somewhere: every main chunk of it on some surviving
   disk (main file or replica), or the step committed in S3; its manifest readable, its model
   this job's (another model is refused at once, naming the field).
3. Plan: each rank computes the chunks its NEW shards need (recovery_plan.needed_items); one
   all-gather of those needs, then recovery_plan.assign_sources gives every rank the same plan of
   who reads what from where (the tiers of checkpoint/sources.py, asked in order).
4. Fetch, all tiers at once: this rank's own-disk chunks are read and verified by a few
   threads (each chunk hashed block by block as it is read, inspect.read_item), its S3 chunks
   downloaded by parallel ranged GETs (each chunk no surviving disk holds is downloaded once,
   by the lowest rank needing it, which forwards it to the others), and one exchange over
   ``group`` (torch.distributed send/recv, a chunk in 1 MiB messages) runs meanwhile. Every
   chunk is checked against the checksum of the copy it came from before it is used; a copy
   that fails (on this disk or a peer's) is dropped for every rank and its chunks
   are planned again from what is left (another disk, S3); a bad or unreadable S3 copy makes
   the step unrecoverable on every rank together, naming the object (the others are told at
   the round's end, never left waiting for a chunk that will not come). An unrecoverable step
   falls back to the next older one, said in one line; when none is left, every rank raises
   one error listing why each step failed (printed once by the job).
5. Load while fetching: a per-rank directory shaped like the step (``common.pt``,
   ``metadata.json``, DCP's index ``.metadata``, fetched before the chunks) is what
   megatron-core's ``dist_checkpointing.load`` reads, in a thread started with the first round,
   taking each chunk's bytes as soon as it is verified (checkpoint/loader.py: a
   :class:`~megatron_autohet.checkpoint.loader.ChunkBoard` between the fetch and DCP's reader,
   and a load without collectives, so it cannot interleave with the fetch's). The load of the
   own-disk chunks thus overlaps the peers' transfer, and a received chunk is loaded while the
   next is on the wire; an unrecoverable step stops it. Then the directory is removed.
6. The loaded values go into the live model, optimizer and scheduler.

The report (:class:`RecoveryReport`) says how many bytes and seconds each tier took; the
resume logs it. On a fleet across zones (``places``, checkpoint/sources.py ``RankPlaces``) the
peers are asked in order of distance (the same zone's, then the region's, then the others'), a
chunk only S3 holds is downloaded once per zone, and the report splits the peers' bytes into
those inside a zone and those across zones, with the egress USD of the latter
(recovery_plan.zone_traffic).
"""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_autohet.checkpoint.inspect import file_problem, item_problem, read_item
from megatron_autohet.checkpoint.loader import (ChunkBoard, CorruptCheckpoint, load_streamed,
                                                wanted_regions)
from megatron_autohet.checkpoint.options import CheckpointOptions
from megatron_autohet.checkpoint.manifest import (MANIFEST_FILE, MODEL_FIELDS, ItemRecord,
                                                  Manifest, committed_steps, model_mismatch,
                                                  read_manifest, step_dir_name)
from megatron_autohet.checkpoint.recovery_plan import (ChunkUnavailable, ZoneTraffic,
                                                       assign_sources, copies_of, needed_items,
                                                       uncovered, zone_traffic)
from megatron_autohet.checkpoint.sources import OWN, PEER, S3, RankPlaces, StoreReader
from megatron_autohet.checkpoint.state import (RNG_KEY, apply_loaded, rank_sharded_state_dict,
                                               rng_sharded_object, saved_master_weights)
from megatron_autohet.checkpoint.upload import byte_progress
from megatron_autohet.checkpoint.writer import SMALL_FILES
from megatron_autohet.runtime.device import enter_device, thread_device
from megatron_autohet.errors import JobConfigError


S3_DOWNLOAD_CONCURRENCY = 8       # ranged GETs in flight per rank (the S3 client's pool has 10)
EXCHANGE_PIECE_BYTES = 2**20      # a chunk crosses to a peer in messages of at most this size
# Threads reading and hashing this rank's own-disk chunks (the hash releases the GIL, so they
# hash at once; more than a few would only compete with the transfer and the load).
VERIFY_THREADS = max(1, min(4, os.cpu_count() or 1))


@dataclass
class RecoveryReport:
    """What this rank's recovery moved and how long it took. ``bytes``: received per tier (own
    disk, peers, S3); ``sent_bytes``: sent to peers; ``job_bytes``: ``bytes`` summed over the
    ranks. ``seconds``: per tier (``own``, ``peer``, ``s3``: from the start of the fetch to the
    end of that tier's work on this rank; the tiers run at the same time) and per phase
    (``agree``: finding the step, waiting for every rank included; ``stage``: the step's small
    files; ``fetch``: all tiers, wall time; ``load``: DCP's load, which runs during the fetch;
    ``apply``: into the live model, optimizer and scheduler). ``zones``: on a fleet across
    zones, the job's peer bytes inside and across zones and the egress USD of the latter (module
    docstring); None on a fleet without zones."""
    iteration: int
    bytes: dict[str, int] = field(default_factory=lambda: {OWN: 0, PEER: 0, S3: 0})
    sent_bytes: int = 0
    job_bytes: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    zones: ZoneTraffic | None = None

    def line(self) -> str:
        mib = {k: v / 2**20 for k, v in self.job_bytes.items()}
        secs = ", ".join(f"{k} {v:.2f} s" for k, v in self.seconds.items())
        peers = f"peers {mib[PEER]:.1f} MiB"
        if self.zones is not None:
            peers = (f"peers in the zone {self.zones.same_zone_bytes / 2**20:.1f} MiB, peers in "
                     f"other zones {self.zones.other_zone_bytes / 2**20:.1f} MiB "
                     f"(${self.zones.egress_usd:.4g} egress)")
        return (f"recovered iteration {self.iteration}, all ranks: local disks {mib[OWN]:.1f} "
                f"MiB, {peers}, S3 {mib[S3]:.1f} MiB (rank 0: {secs})")

    def event_fields(self) -> dict:
        """The recovery event's figures: bytes per tier and seconds, and on a fleet across
        zones the peers' bytes inside and across zones and their egress USD."""
        out = {"bytes": self.job_bytes, "seconds": self.seconds}
        if self.zones is not None:
            out.update(same_zone_peer_bytes=self.zones.same_zone_bytes,
                       other_zone_peer_bytes=self.zones.other_zone_bytes,
                       egress_usd=self.zones.egress_usd)
        return out


@dataclass
class _Visible:
    """One rank's view of one step: file name -> path on its disk."""
    paths: dict[str, Path]
    manifest_json: bytes


def _scan(roots: list[Path]) -> tuple[dict[int, _Visible], list[str]]:
    """Committed steps in ``roots`` and the files of each whose size matches the manifest; and
    what is wrong with each manifest that does not read (its step is skipped)."""
    seen: dict[int, _Visible] = {}
    unreadable = []
    for root in roots:
        for iteration in committed_steps(root):
            step = root / step_dir_name(iteration)
            try:
                manifest = read_manifest(step)
            except ValueError as err:          # names the file
                unreadable.append(str(err))
                continue
            view = seen.setdefault(iteration, _Visible({}, (step / MANIFEST_FILE).read_bytes()))
            for name, record in manifest.files.items():
                path = step / name
                if name not in view.paths and path.is_file() and \
                        path.stat().st_size == record.size:
                    view.paths[name] = path
    return seen, unreadable


def _s3_manifest(s3: StoreReader, iteration: int, group) -> Manifest | str:
    """The manifest of a step committed in S3 and on no surviving disk: rank 0 downloads it and
    every rank gets the same manifest, or the same reason it could not be had or read."""
    box = [s3.manifest(iteration) if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def _missing_on_disks(manifest: Manifest, present: dict[int, set[str]]) -> list[str]:
    """Files of the step whose chunks no surviving disk has a copy of (absent, or not of the
    size the manifest says): empty when the step is complete on the disks."""
    on_disk = set().union(*present.values())
    missing = {name for name in SMALL_FILES if name not in on_disk}
    missing.update(copies[0].file for copies in copies_of(manifest.items, manifest.replicas)
                   if not any(c.file in on_disk for c in copies))
    return sorted(missing)


def recover(trainer, scheduler, *, roots: list[Path], s3=None, group=None,
            log=print, options: CheckpointOptions = CheckpointOptions(),
            places: RankPlaces | None = None):
    """Load the newest complete step into this rank's model (module docstring); None when no
    step is committed anywhere. A step that cannot be recovered (unreadable manifest, files
    missing or corrupt everywhere) falls back to the next older one, said once (``log``: rank
    0's); when none is left, or the step was saved from another model, every rank raises the
    same :class:`~megatron_autohet.errors.JobConfigError` naming --load (printed once by the
    job); so does an S3 tier that cannot be listed, unless ``options.resume_without_s3``
    (module docstring, step 1). ``options`` says what to take from it (checkpoint/options.py):
    ``ckpt_step`` that
    step instead of the newest (a JobConfigError naming --ckpt-step when it is committed
    nowhere), without the Adam state and schedule (``load_optim``: none of their chunks is
    fetched), without RNG states (``load_rng``), ``finetune``. ``places``: where each rank of
    ``group`` is on a fleet across zones (module docstring; None: no zones)."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    start = time.perf_counter()
    store = StoreReader(s3) if s3 is not None else None

    # 1. discover; rank 0's S3 listing (round trips over the slowest link) runs meanwhile and
    # rides on rank 0's part of the one all-gather that agrees on what every rank sees
    with ThreadPoolExecutor(1) as lister:
        listing = (lister.submit(store.committed_steps, log) if rank == 0 and store is not None
                   else None)
        mine, unreadable = _scan(roots)
        seen = {it: (sorted(v.paths), v.manifest_json) for it, v in mine.items()}
        gathered: list = [None] * world_size
        dist.all_gather_object(gathered, (seen, unreadable,
                                          listing.result() if listing else set()), group=group)
    s3_steps = gathered[0][2]
    if isinstance(s3_steps, str):            # rank 0's listing failed every attempt
        s3_steps = _without_s3(store, s3_steps, options, log)
    views = [view for view, _, _ in gathered]
    # why each step that is not loaded was not (the error when none is); a step whose manifest
    # does not read is skipped, said once
    failures = list(dict.fromkeys(p for _, problems, _ in gathered for p in problems))
    for problem in failures:
        log(f"WARNING: {problem}; that step is skipped")

    # 2.+3. the newest step complete somewhere, planned for this rank's new shards; a step
    # whose chunks turn out corrupt everywhere falls back to the next older one.
    candidates = sorted({it for v in views for it in v} | set(s3_steps), reverse=True)
    if options.ckpt_step is not None:
        if options.ckpt_step not in candidates:
            raise JobConfigError("<command line>", "--ckpt-step",
                                 f"no committed step {options.ckpt_step} in "
                                 f"{options.load}" + (f" or {store.uri()}" if store else ""),
                                 "one of the committed steps: "
                                 + (", ".join(map(str, sorted(candidates))) or "none"))
        candidates = [options.ckpt_step]
    for iteration in candidates:
        older = candidates[candidates.index(iteration) + 1:]

        def give_up(why: str) -> None:
            """This step cannot be recovered: the reason is kept for the final error, and a
            fallback to the next older step is said once."""
            failures.append(f"iteration {iteration}: {why}")
            if older:
                log(f"WARNING: cannot recover iteration {iteration} ({why}); falling back to "
                    f"iteration {older[0]}")

        disk_copy = next((v[iteration][1] for v in views if iteration in v), None)  # at the scan
        manifest = (_s3_manifest(store, iteration, group) if disk_copy is None
                    else Manifest.from_json(disk_copy, f"manifest of iteration {iteration}"))
        if isinstance(manifest, str):
            give_up(manifest)
            continue
        mismatch = model_mismatch(manifest.model, trainer.plan.model.to_dict())
        if mismatch is not None:             # the same on every rank: no older step is tried
            field_name, value, saved = mismatch
            raise JobConfigError("<command line>", "--load", f"iteration {iteration} was saved "
                                 f"from a model with {field_name} {saved!r}"
                                 f"{MODEL_FIELDS[field_name]}, this job's model has {value!r}",
                                 "a checkpoint of this job's model")
        present = {r: set(v[iteration][0]) if iteration in v else set()
                   for r, v in enumerate(views)}
        missing = [] if iteration in s3_steps else _missing_on_disks(manifest, present)
        if missing:
            give_up("files missing or of the wrong size on every surviving node: "
                    + ", ".join(missing))
            continue
        # fp32 masters are asked for when this step has them (a 16-bit job saved it)
        state_dict = rank_sharded_state_dict(
            trainer, for_load=True,
            masters=saved_master_weights(item.key for item in manifest.items))
        if not options.load_optim:
            del state_dict["optimizer"]
        if manifest.plan == trainer.plan.to_dict() and options.load_rng:
            state_dict[RNG_KEY] = rng_sharded_object(trainer, world_size)
        else:
            state_dict.pop(RNG_KEY, None)
        index_of = {item.region: i for i, item in enumerate(manifest.items)}
        wanted = wanted_regions(state_dict)
        needs = [index_of[item.region] for item in needed_items(manifest.items, wanted)]
        # a step that does not hold all of this rank's state is corrupt (failed together below)
        missing_regions = uncovered(manifest.items, wanted)
        local_paths = mine[iteration].paths if iteration in mine else {}
        report = RecoveryReport(iteration, zones=ZoneTraffic() if places else None)
        report.seconds["agree"] = time.perf_counter() - start
        t = time.perf_counter()
        staging = Path(tempfile.mkdtemp(prefix=f"autohet-recovery-{rank}-",
                                        dir=roots[0] if roots and roots[0].is_dir() else None))
        try:
            small, problem = _small_files(manifest, local_paths, iteration, store, present,
                                           group)
            if missing_regions:
                problem = (f"the manifest of iteration {iteration} has no chunk of "
                           + ", ".join(f"{w.key} at {w.offsets}" for w in missing_regions[:3])
                           + f" ({len(missing_regions)} regions this rank needs)")
            if problem is None:
                _stage(staging, small)
            report.seconds["stage"] = time.perf_counter() - t
            loaded = _fetch_and_load(state_dict, staging, manifest, iteration, needs,
                                     local_paths, store, iteration in s3_steps, group, report,
                                     problem, places)
            break
        except _Unrecoverable as err:
            give_up(str(err))
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    else:
        if failures:
            where = f"{options.load}" + (f" or {store.uri()}" if store else "")
            raise JobConfigError("<command line>", "--load", f"no checkpoint step in {where} "
                                 "can be recovered: " + " | ".join(failures))
        return None

    # 6. into the live model, optimizer and scheduler
    t = time.perf_counter()
    progress = apply_loaded(trainer, scheduler, loaded, load_optim=options.load_optim,
                            finetune=options.finetune)
    report.seconds["apply"] = time.perf_counter() - t
    return progress, report


def _without_s3(store: StoreReader, why: str, options: CheckpointOptions, log) -> set[int]:
    """The S3 tier could not be listed (``why``): no step of it, with --autohet-resume-without-s3
    (said once); else every rank raises the same JobConfigError (printed once by the job)."""
    if not options.resume_without_s3:
        raise JobConfigError("<command line>", "--autohet-s3-uri",
                             f"{store.uri()} cannot be reached at --load ({why}); its "
                             "newest step may be held "
                             "there alone, and training from the disks alone or from scratch "
                             "could overwrite the steps it holds",
                             "make the S3 tier reachable and start again, or pass "
                             "--autohet-resume-without-s3 to recover from the disks alone "
                             "(training from scratch when they hold no step)")
    log(f"WARNING: the S3 tier {store.uri()} is unreachable ({why}); recovering from the disks "
        "alone (--autohet-resume-without-s3); this job's saves do not overwrite the steps "
        "committed there")
    return set()


class _Unrecoverable(RuntimeError):
    """A step that cannot be recovered (corrupt or missing chunks); the same on every rank."""


def _fetch_and_load(state_dict: dict, staging: Path, manifest: Manifest, iteration: int,
                    needs: list[int], local_paths: dict[str, Path], s3: StoreReader | None,
                    s3_available: bool, group, report, problem: str | None,
                    places: RankPlaces | None) -> dict:
    """Fetch every chunk this rank needs of one step (module docstring, step 4) while a thread
    loads them (step 5) as they are verified; the loaded state dict. The load starts once the
    first round's sources are known (own-disk chunks first, then what the exchange brings in
    the order it brings it); a step that turns out unrecoverable stops it (every rank raises
    :class:`_Unrecoverable` together)."""
    board = ChunkBoard(needs)
    chunk_at = {(item.file, item.offset): i for i, item in enumerate(manifest.items)}
    started = []

    def start_load(order: list[int]) -> None:
        began = time.perf_counter()
        device = thread_device()        # the loader thread's CUDA device is the caller's

        def load() -> dict:
            enter_device(device)
            try:
                return load_streamed(state_dict, staging, board, chunk_at,
                                     {index: n for n, index in enumerate(order)})
            finally:
                report.seconds["load"] = time.perf_counter() - began

        started.append(pool.submit(load))

    with ThreadPoolExecutor(1) as pool:
        try:
            _fetch_step(manifest, iteration, needs, local_paths, s3, s3_available, group, report,
                        board, start_load, problem, places)
        except BaseException as err:
            board.fail(err)
            for future in started:
                future.exception()          # the load gives up on the failed board
            raise
        return started[0].result() if started else load_streamed(
            state_dict, staging, board, chunk_at, {})


def _fetch_step(manifest: Manifest, iteration: int, needs: list[int],
                local_paths: dict[str, Path], s3: StoreReader | None, s3_available: bool,
                group, report, board: ChunkBoard, start_load, problem: str | None,
                places: RankPlaces | None = None) -> None:
    """Fetch and verify every chunk this rank needs of one step, all tiers at once (module
    docstring, step 4), putting each on ``board`` as it is verified; ``start_load`` is called
    with the order the chunks are expected in once the first round is planned. A copy that
    fails its checksum is dropped for every rank (a file found corrupt by one rank is corrupt
    for all that read the same path, as with a shared --load directory) and its chunks are
    planned and fetched again, from what is left; :class:`_Unrecoverable` (on every rank) when
    nothing is. A rank's ``problem`` (its bad small files, :func:`_small_files`, or a region of
    its state no chunk holds) fails every rank here, before anything is fetched."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    paths = {name: str(path.resolve()) for name, path in local_paths.items()}
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, (needs, paths, problem), group=group)
    problem = next((p for _, _, p in everyone if p), None)
    if problem:
        raise _Unrecoverable(problem)
    all_paths = [p for _, p, _ in everyone]
    pending = {r: n for r, (n, _, _) in enumerate(everyone) if n}
    report.job_bytes = dict.fromkeys(report.bytes, 0)
    bad_paths: set[str] = set()
    problems: dict[str, None] = {}
    while pending:
        present = {r: {name for name, path in p.items() if path not in bad_paths}
                   for r, p in enumerate(all_paths)}
        try:
            fetches = assign_sources(manifest.items, manifest.replicas, pending, present,
                                     s3_available=s3_available, places=places)
        except ChunkUnavailable as err:
            raise _Unrecoverable("; ".join([*problems, str(err)])) from None
        if places is not None:       # the same fetches on every rank: the job's traffic
            report.zones += zone_traffic(fetches, places)
        if start_load is not None:
            start_load(_arrival_order(fetches, rank))
            start_load = None
        result = _fetch_round(fetches, rank, iteration, local_paths, s3, group, report, board)
        gathered: list = [None] * world_size
        dist.all_gather_object(gathered, (result.bad, result.failed, result.s3_error,
                                          report.bytes), group=group)
        report.job_bytes = {tier: sum(g[3][tier] for g in gathered) for tier in report.bytes}
        s3_error = next((g[2] for g in gathered if g[2]), None)
        if s3_error:
            raise _Unrecoverable(s3_error)
        for r, (bad, *_) in enumerate(gathered):
            for (holder, name), problem in bad.items():
                bad_paths.add(all_paths[holder][name])
                if r == rank and problem not in problems:   # told by the rank that found it
                    print(f"WARNING: {problem}; not loaded, fetching the chunk elsewhere",
                          flush=True)
                problems[problem] = None
        pending = {r: g[1] for r, g in enumerate(gathered) if g[1]}


def _arrival_order(fetches, rank: int) -> list[int]:
    """The chunks this rank fetches in the order they are expected: its own disk's (read
    first), then the exchange's (peer by peer, in message order), then its S3 downloads."""
    mine = [f for f in fetches if f.rank == rank]
    return ([f.index for f in mine if f.source == OWN]
            + [f.index for f in sorted((f for f in mine if f.peer is not None),
                                       key=lambda f: f.peer)]
            + [f.index for f in mine if f.source == S3 and f.peer is None])


@dataclass
class _Round:
    bad: dict[tuple[int, str], str] = field(default_factory=dict)   # (holder, file) -> problem
    failed: list[int] = field(default_factory=list)                 # still needed
    s3_error: str | None = None          # a download that failed: the step cannot be loaded


def _fetch_round(fetches, rank: int, iteration: int, local_paths: dict[str, Path],
                 s3: StoreReader | None, group, report, board: ChunkBoard) -> _Round:
    """One round of fetches, the tiers concurrently: this rank's own-disk chunks are read and
    verified by VERIFY_THREADS threads, its S3 chunks downloaded by a pool of ranged GETs, and
    the peer exchange runs on this thread (an S3 chunk forwarded to peers is sent once
    downloaded). Every verified chunk goes on ``board`` at once. Each tier's seconds and bytes
    go into ``report``."""
    out = _Round()
    start = time.perf_counter()
    own = [f for f in fetches if f.rank == rank and f.source == OWN]
    downloads = [f for f in fetches if f.rank == rank and f.source == S3 and f.peer is None]
    tier_end: dict[str, float] = {}

    def verify_own(f) -> None:
        """Read and verify one own-disk chunk (VERIFY_THREADS of these run at once)."""
        with open(local_paths[f.copy.file], "rb") as file:
            raw, problem = read_item(file, f.copy)
        with own_lock:
            report.bytes[OWN] += len(raw)
            tier_end[OWN] = time.perf_counter()
            if problem is None:
                board.put(f.index, raw)
            else:
                out.bad[(rank, f.copy.file)] = (
                    f"{local_paths[f.copy.file]}: bytes {f.copy.offset}-"
                    f"{f.copy.offset + f.copy.length} ({f.copy.key}) do not match their "
                    "checksum in the manifest")
                out.failed.append(f.index)

    def download(f) -> memoryview | None:
        """The verified chunk, or None when S3 failed (said in ``out.s3_error``; a chunk this
        rank forwards then goes out as zeros, so the exchange completes on every rank)."""
        raw = s3.chunk(iteration, f.copy)
        if isinstance(raw, str):
            out.s3_error = out.s3_error or raw
            return None
        raw = memoryview(raw)
        report.bytes[S3] += len(raw)
        bar.update(len(raw))
        tier_end[S3] = time.perf_counter()
        if f.rank == rank:
            board.put(f.index, raw)
        return raw

    own_lock = threading.Lock()
    with byte_progress(sum(f.copy.length for f in downloads), f"download "
                       f"{step_dir_name(iteration)} (rank {rank})", show=rank == 0) as bar, \
            ThreadPoolExecutor(VERIFY_THREADS) as disk, \
            ThreadPoolExecutor(S3_DOWNLOAD_CONCURRENCY) as pool:
        # in arrival order: the load takes them in that order (_arrival_order)
        verified = [disk.submit(verify_own, f) for f in own]
        # Ranged GETs in parallel: one at a time, S3's first-byte latency would dominate.
        downloaded = {f.index: pool.submit(download, f) for f in downloads}
        _exchange(fetches, rank, local_paths, downloaded, group, report, board, out)
        tier_end[PEER] = time.perf_counter()
        for future in verified:
            future.result()
        tier_end.setdefault(OWN, start)
        for future in downloaded.values():
            future.result()
    for tier, end in tier_end.items():
        report.seconds[tier] = report.seconds.get(tier, 0.0) + end - start
    report.seconds["fetch"] = report.seconds.get("fetch", 0.0) + time.perf_counter() - start
    return out


def _good(raw: bytes | memoryview, record: ItemRecord) -> bool:
    return item_problem(record, raw) is None


def _pieces(length: int) -> list[tuple[int, int]]:
    return [(a, min(a + EXCHANGE_PIECE_BYTES, length))
            for a in range(0, length, EXCHANGE_PIECE_BYTES)]


def _exchange(fetches, rank: int, local_paths: dict[str, Path], downloaded: dict, group,
              report, board: ChunkBoard, out: _Round) -> None:
    """Send what peers need from this rank, receive what this rank needs from peers: every
    message posted at once (gloo pairs a pair's messages in order), so each received chunk is
    verified and put on ``board`` while the next ones are still on the wire. A chunk crosses in
    pieces of EXCHANGE_PIECE_BYTES, each sent as soon as it is read: the link starts after one
    piece is read, not a whole chunk (a layer's matrix is megabytes, and the sender's disk is
    busy with its own chunks too). The bytes are read (or copied from a download) straight into
    the message buffer, and a received chunk is a view of its receive buffer: no other copy on
    either side."""
    outgoing: dict[int, list] = defaultdict(list)
    incoming: dict[int, list] = defaultdict(list)
    for f in fetches:
        if f.source == PEER or (f.source == S3 and f.peer is not None):
            if f.peer == rank:
                outgoing[f.rank].append(f)
            elif f.rank == rank:
                incoming[f.peer].append(f)
    receives = []
    for peer in sorted(incoming):              # receives first: senders never wait for them
        for f in incoming[peer]:
            buffer = torch.empty(f.copy.length, dtype=torch.uint8)
            receives.append((f, buffer, [dist.irecv(buffer[a:b], src=peer, group=group)
                                         for a, b in _pieces(f.copy.length)]))
    sends, files = [], {}
    try:
        for peer in sorted(outgoing):
            for f in outgoing[peer]:
                payload = torch.empty(f.copy.length, dtype=torch.uint8)
                part = memoryview(payload.numpy())
                if f.source == S3:
                    raw = downloaded[f.index].result()
                    if raw is not None:          # else zeros; every rank raises at the end
                        part[:] = raw
                elif f.copy.file not in files:
                    files[f.copy.file] = open(local_paths[f.copy.file], "rb")
                for a, b in _pieces(f.copy.length):
                    if f.source != S3:
                        files[f.copy.file].seek(f.copy.offset + a)
                        if files[f.copy.file].readinto(part[a:b]) != b - a:
                            raise CorruptCheckpoint(f"{local_paths[f.copy.file]}: shorter "
                                                    "than its manifest says")
                    sends.append((payload, dist.isend(payload[a:b], dst=peer, group=group)))
                report.sent_bytes += f.copy.length
    finally:
        for handle in files.values():
            handle.close()
    for f, buffer, requests in receives:
        for request in requests:
            request.wait()
        raw = memoryview(buffer.numpy())
        if _good(raw, f.copy):
            board.put(f.index, raw)
            report.bytes[PEER] += len(raw)
        elif f.source == S3:        # verified by the forwarder: damaged on the way, no disk to drop
            out.s3_error = out.s3_error or (
                f"chunk {f.copy.key} at {f.copy.offsets} forwarded by rank {f.peer} from "
                f"{f.copy.file} in S3 fails its checksum on arrival")
        else:
            out.bad[(f.peer, f.copy.file)] = (f"chunk {f.copy.key} at {f.copy.offsets} received "
                                              f"from rank {f.peer} ({f.copy.file}) fails its "
                                              "checksum")
            out.failed.append(f.index)
    for _, request in sends:
        request.wait()


def _stage(staging: Path, small: dict[str, bytes]) -> None:
    """``staging`` as megatron-core's load reads a step: ``common.pt``, ``metadata.json``, DCP's
    index ``.metadata``, and an empty placeholder for every data file the index names (the
    chunk bytes come from the board, checkpoint/loader.py)."""
    for name, raw in small.items():
        (staging / name).write_bytes(raw)
    metadata = pickle.loads(small[".metadata"])     # verified against the manifest
    for name in {info.relative_path for info in metadata.storage_data.values()}:
        (staging / name).touch()


def _small_files(manifest: Manifest, local_paths: dict[str, Path], iteration: int,
                 s3: StoreReader | None, present: dict[int, set[str]],
                 group) -> tuple[dict[str, bytes], str | None]:
    """``.metadata``, ``common.pt`` and ``metadata.json``, checked against the manifest, and
    what is wrong with them (None: nothing). From this rank's disk when every rank has them on
    its own (``present``: each rank's files, as the discovery gathered them): no collective
    then, and a bad copy is only reported, for the fetch's first all-gather to fail every rank
    together. Else from the lowest rank that has them all (broadcast), else from S3: the same
    bytes on every rank, so a bad copy raises on every rank at once."""
    rank = dist.get_rank(group)
    holders = [r for r in sorted(present) if all(name in present[r] for name in SMALL_FILES)]
    if len(holders) == len(present):
        small = {name: local_paths[name].read_bytes() for name in SMALL_FILES}
    elif holders:
        box = [{name: local_paths[name].read_bytes() for name in SMALL_FILES}
               if rank == holders[0] else None]
        dist.broadcast_object_list(box, src=holders[0], group=group)
        small = box[0]
    else:
        small = s3.files(iteration, SMALL_FILES)
        failed = [None] * dist.get_world_size(group)
        dist.all_gather_object(failed, small if isinstance(small, str) else None, group=group)
        why = next((f for f in failed if f is not None), None)
        if why is not None:         # every rank alike: the step is given up as a corrupt one
            raise _Unrecoverable(f"the S3 tier did not give its small files: {why}")
    for name, raw in small.items():
        record = manifest.files[name]
        if raw is None or file_problem(raw, record.size, record.digest):
            problem = (f"{local_paths.get(name, name)} of iteration {iteration} does not match "
                       "its checksum in the manifest")
            if len(holders) != len(present):
                raise _Unrecoverable(problem)
            return small, problem
    return small, None
