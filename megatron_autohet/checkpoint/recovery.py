"""Recovery into the job's plan: local disks first, then surviving peers, then S3.

``recover(trainer, scheduler, *, roots, s3, group) -> (TrainingProgress, RecoveryReport) | None``
is called on every rank of a (re)started job. ``roots`` are the checkpoint directories this rank
can read (its node's local-tier directory, ``--load``); ``s3`` the S3 tier, if configured.

1. Discover: every rank lists the committed steps in its roots and which of their files it has
   (sizes as the manifest says); rank 0 lists the S3 tier. One all-gather.
2. Choose the newest step that is complete somewhere: every main chunk of it on some surviving
   disk (main file or replica), or the step committed in S3.
3. Plan: each rank computes the chunks its NEW shards need (recovery_plan.needed_items); one
   all-gather of those needs, then recovery_plan.assign_sources gives every rank the same plan of
   who reads what from where.
4. Fetch: S3 chunks first (parallel ranged GETs, each missing chunk downloaded once), then one
   exchange over ``group`` (torch.distributed send/recv of the chunk bytes, one message per pair
   of ranks), and local reads. Every chunk is checked against the SHA-256 of the copy it came from
   before it is used; a peer's bad copy falls back to S3, a bad local copy is dropped before
   planning (so a peer or S3 serves it), and a bad S3 copy is an error naming the object.
5. Stage: a per-rank directory shaped like the step (``.metadata``, ``common.pt``,
   ``metadata.json``; main files present on this disk symlinked, others sparse files holding the
   fetched chunks at their offsets), which megatron-core's ``dist_checkpointing.load`` reads
   (checkpoint/loader.py). Then it is removed.

The report says how many bytes and seconds each tier took.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_autohet.checkpoint.inspect import file_problem, item_problem
from megatron_autohet.checkpoint.loader import CorruptCheckpoint, load_staged, wanted_regions
from megatron_autohet.checkpoint.options import CheckpointOptions
from megatron_autohet.checkpoint.manifest import (MANIFEST_FILE, ItemRecord, Manifest,
                                                  committed_steps, read_manifest,
                                                  step_dir_name)
from megatron_autohet.checkpoint.recovery_plan import (OWN, PEER, S3, ChunkUnavailable,
                                                       assign_sources, copies_of, needed_items)
from megatron_autohet.checkpoint.state import (RNG_KEY, rank_sharded_state_dict,
                                               rng_sharded_object, saved_master_weights)
from megatron_autohet.checkpoint.upload import byte_progress
from megatron_autohet.checkpoint.writer import SMALL_FILES
from megatron_autohet.errors import ConfigError


S3_DOWNLOAD_CONCURRENCY = 8       # ranged GETs in flight per rank (the S3 client's pool has 10)


@dataclass
class RecoveryReport:
    """Bytes per tier this rank received, the job's totals, and this rank's seconds per phase
    (``agree``: finding and planning the step, waiting for every rank included)."""
    iteration: int
    bytes: dict[str, int] = field(default_factory=lambda: {OWN: 0, PEER: 0, S3: 0})
    job_bytes: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    def line(self) -> str:
        mib = {k: v / 2**20 for k, v in self.job_bytes.items()}
        secs = ", ".join(f"{k} {v:.2f} s" for k, v in self.seconds.items())
        return (f"recovered iteration {self.iteration}, all ranks: local disks {mib[OWN]:.1f} "
                f"MiB, peers {mib[PEER]:.1f} MiB, S3 {mib[S3]:.1f} MiB (rank 0: {secs})")


@dataclass
class _Visible:
    """One rank's view of one step: file name -> path on its disk."""
    paths: dict[str, Path]
    manifest_json: bytes


def _scan(roots: list[Path]) -> dict[int, _Visible]:
    """Committed steps in ``roots`` and the files of each whose size matches the manifest."""
    seen: dict[int, _Visible] = {}
    for root in roots:
        for iteration in committed_steps(root):
            step = root / step_dir_name(iteration)
            try:
                manifest = read_manifest(step)
            except ValueError:
                continue                       # unreadable manifest: the step is not ours
            view = seen.setdefault(iteration, _Visible({}, (step / MANIFEST_FILE).read_bytes()))
            for name, record in manifest.files.items():
                path = step / name
                if name not in view.paths and path.is_file() and \
                        path.stat().st_size == record.size:
                    view.paths[name] = path
    return seen


def _s3_steps(s3, log) -> dict[int, bytes]:
    """Committed S3 steps (manifest present) -> manifest bytes; none when S3 is not configured
    or cannot be reached (recovery then uses the disks alone, and says so)."""
    from megatron_autohet.checkpoint.s3_store import S3Error

    if s3 is None:
        return {}
    steps = {}
    try:
        for iteration in s3.list_steps():
            raw = s3.get_bytes(f"{step_dir_name(iteration)}/{MANIFEST_FILE}")
            if raw is not None:
                steps[iteration] = raw
    except S3Error as err:
        log(f"WARNING: the S3 tier is unreachable, recovering from the disks alone: {err}")
        return {}
    return steps


def _missing_on_disks(manifest: Manifest, present: dict[int, set[str]]) -> list[str]:
    """Files of the step whose chunks no surviving disk has a copy of (absent, or not of the
    size the manifest says): empty when the step is complete on the disks."""
    on_disk = set().union(*present.values())
    missing = {name for name in SMALL_FILES if name not in on_disk}
    missing.update(copies[0].file for copies in copies_of(manifest.items, manifest.replicas)
                   if not any(c.file in on_disk for c in copies))
    return sorted(missing)


def _read(path: Path, record: ItemRecord) -> bytes:
    with open(path, "rb") as f:
        f.seek(record.offset)
        return f.read(record.length)


def _good(raw: bytes, record: ItemRecord) -> bool:
    return item_problem(record, raw) is None


def recover(trainer, scheduler, *, roots: list[Path], s3=None, group=None,
            log=print, options: CheckpointOptions = CheckpointOptions()):
    """Load the newest complete step into this rank's model (module docstring); None when no
    step is complete anywhere. ``options`` says what to take from it (checkpoint/options.py):
    ``ckpt_step`` that step instead of the newest (a :class:`ConfigError` naming --ckpt-step when
    it is committed nowhere), without the Adam state and schedule (``load_optim``: none of
    their chunks is fetched), without RNG states (``load_rng``), ``finetune``."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    start = time.perf_counter()

    # 1. discover
    mine = _scan(roots)
    views: list = [None] * world_size
    dist.all_gather_object(views, {it: (sorted(v.paths), v.manifest_json)
                                   for it, v in mine.items()}, group=group)
    s3_steps = [_s3_steps(s3, log) if rank == 0 else None]
    dist.broadcast_object_list(s3_steps, src=0, group=group)
    s3_steps = s3_steps[0]

    # 2.+3. the newest step complete somewhere, planned for this rank's new shards; a step
    # whose chunks turn out corrupt everywhere falls back to the next older one.
    failures = []
    candidates = sorted({it for v in views for it in v} | set(s3_steps), reverse=True)
    if options.ckpt_step is not None:
        if options.ckpt_step not in candidates:
            raise ConfigError("<command line>", "--ckpt-step",
                              f"no committed step {options.ckpt_step} in "
                              f"{options.load}" + (f" or {s3.location.uri()}" if s3 else ""),
                              "one of the committed steps: "
                              + (", ".join(map(str, sorted(candidates))) or "none"))
        candidates = [options.ckpt_step]
    for iteration in candidates:
        raw = s3_steps.get(iteration) or next(v[iteration][1] for v in views if iteration in v)
        manifest = Manifest.from_json(raw, f"manifest of iteration {iteration}")
        present = {r: set(v[iteration][0]) if iteration in v else set()
                   for r, v in enumerate(views)}
        missing = [] if iteration in s3_steps else _missing_on_disks(manifest, present)
        if missing:
            failures.append(f"iteration {iteration}: files missing or of the wrong size on every "
                            f"surviving node: {', '.join(missing)}")
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
        needs = [index_of[item.region]
                 for item in needed_items(manifest.items, wanted_regions(state_dict))]
        local_paths = mine[iteration].paths if iteration in mine else {}
        corrupt = _verify_local_files(local_paths, manifest, needs)
        # A corrupt file found by one rank is corrupt for every rank that reads the same path
        # (a shared --load directory), so none of them offers it as a source.
        paths = {name: str(path.resolve()) for name, path in local_paths.items()}
        everyone: list = [None] * world_size
        dist.all_gather_object(everyone, (needs, paths, corrupt), group=group)
        bad_paths = {everyone[r][1][name] for r in range(world_size) for name in everyone[r][2]}
        needed = {r: n for r, (n, _, _) in enumerate(everyone)}
        present = {r: {name for name, path in p.items() if path not in bad_paths}
                   for r, (_, p, _) in enumerate(everyone)}
        try:
            fetches = assign_sources(manifest.items, manifest.replicas, needed, present,
                                     s3_available=iteration in s3_steps)
            break
        except ChunkUnavailable as err:
            problems = dict.fromkeys(m for _, _, c in everyone for m in c.values())
            failures.append(f"iteration {iteration}: " + "; ".join([*problems, str(err)]))
            log(f"WARNING: cannot recover {failures[-1]}")
    else:
        if failures:
            raise CorruptCheckpoint("no checkpoint step can be recovered: " + " | ".join(failures))
        return None
    report = RecoveryReport(iteration)
    report.seconds["agree"] = time.perf_counter() - start

    # 4. fetch: S3 downloads (each chunk once), the peer exchange, then local reads
    t = time.perf_counter()
    chunks: dict[int, bytes] = {}
    downloads = [f for f in fetches if f.source == S3 and f.rank == rank and f.peer is None]
    with byte_progress(sum(f.copy.length for f in downloads), f"download {step_dir_name(iteration)}"
                       f" (rank {rank})", show=rank == 0) as bar, \
            ThreadPoolExecutor(S3_DOWNLOAD_CONCURRENCY) as pool:
        # Ranged GETs in parallel: one at a time, S3's first-byte latency would dominate.
        for f, raw in zip(downloads, pool.map(lambda f: _download(s3, iteration, f.copy),
                                              downloads)):
            chunks[f.index] = raw
            report.bytes[S3] += f.copy.length
            bar.update(f.copy.length)
    report.seconds["s3"] = time.perf_counter() - t
    t = time.perf_counter()
    received = _exchange(fetches, rank, local_paths, chunks, group)
    for index, (raw, copy) in received.items():
        if not _good(raw, copy):
            if s3 is None or iteration not in s3_steps:
                raise CorruptCheckpoint(f"chunk {copy.key} at {copy.offsets} received from a "
                                        f"peer ({copy.file}) fails its SHA-256 check and there "
                                        "is no S3 copy to fall back to")
            log(f"WARNING: a peer's copy of {copy.key} ({copy.file}) is corrupt; reading it "
                "from S3")
            raw = _download(s3, iteration, manifest.items[index])
            report.bytes[S3] += len(raw)
        else:
            report.bytes[PEER] += len(raw)
        chunks[index] = raw
    report.seconds["peers"] = time.perf_counter() - t

    # 5. stage and load
    t = time.perf_counter()
    staging = Path(tempfile.mkdtemp(prefix=f"autohet-recovery-{rank}-",
                                    dir=roots[0] if roots and roots[0].is_dir() else None))
    try:
        report.bytes[OWN] += _stage(staging, manifest, iteration, fetches, rank, local_paths,
                                    chunks, s3, s3_steps, group)
        report.seconds["stage"] = time.perf_counter() - t
        t = time.perf_counter()
        progress = load_staged(trainer, scheduler, state_dict, staging,
                               load_optim=options.load_optim, finetune=options.finetune)
        report.seconds["load"] = time.perf_counter() - t
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    everyone_bytes: list = [None] * world_size
    dist.all_gather_object(everyone_bytes, report.bytes, group=group)
    report.job_bytes = {tier: sum(b[tier] for b in everyone_bytes) for tier in report.bytes}
    return progress, report


def _verify_local_files(paths: dict[str, Path], manifest: Manifest,
                        needs: list[int]) -> dict[str, str]:
    """Local files holding a needed chunk whose bytes fail their checksum -> what is wrong
    (reported, then treated as absent so that a peer or S3 serves the chunk)."""
    copies = copies_of(manifest.items, manifest.replicas)
    corrupt: dict[str, str] = {}
    for index in needs:
        for copy in copies[index]:
            if copy.file in paths and copy.file not in corrupt:
                if not _good(_read(paths[copy.file], copy), copy):
                    corrupt[copy.file] = (f"{paths[copy.file]}: bytes {copy.offset}-"
                                          f"{copy.offset + copy.length} ({copy.key}) do not "
                                          "match their SHA-256 in the manifest")
                    print(f"WARNING: {corrupt[copy.file]}; not loaded, fetching the chunk "
                          "elsewhere", flush=True)
    return corrupt


def _download(s3, iteration: int, record: ItemRecord) -> bytes:
    raw = s3.get_range(f"{step_dir_name(iteration)}/{record.file}", record.offset, record.length)
    if not _good(raw, record):
        raise CorruptCheckpoint(f"{s3.location.uri(step_dir_name(iteration) + '/' + record.file)}"
                                f": bytes {record.offset}-{record.offset + record.length} "
                                f"({record.key}) do not match their SHA-256 in the manifest")
    return raw


def _exchange(fetches, rank: int, local_paths: dict[str, Path], downloaded: dict[int, bytes],
              group) -> dict[int, tuple[bytes, ItemRecord]]:
    """Send what peers need from this rank, receive what this rank needs from peers: one
    message per (sender, receiver) pair, all posted at once (gloo pairs them in order)."""
    outgoing: dict[int, list] = defaultdict(list)
    incoming: dict[int, list] = defaultdict(list)
    for f in fetches:
        if f.source == PEER or (f.source == S3 and f.peer is not None):
            if f.peer == rank:
                outgoing[f.rank].append(f)
            elif f.rank == rank:
                incoming[f.peer].append(f)
    requests, buffers = [], {}
    for peer in sorted(outgoing):
        parts = [downloaded[f.index] if f.source == S3 else _read(local_paths[f.copy.file],
                                                                  f.copy)
                 for f in outgoing[peer]]
        payload = torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8)
        requests.append(dist.isend(payload, dst=peer, group=group))
    for peer in sorted(incoming):
        size = sum(f.copy.length for f in incoming[peer])
        buffers[peer] = torch.empty(size, dtype=torch.uint8)
        requests.append(dist.irecv(buffers[peer], src=peer, group=group))
    for request in requests:
        request.wait()
    received = {}
    for peer, fs in incoming.items():
        raw, offset = buffers[peer].numpy().tobytes(), 0
        for f in fs:
            received[f.index] = (raw[offset:offset + f.copy.length], f.copy)
            offset += f.copy.length
    return received


def _stage(staging: Path, manifest: Manifest, iteration: int, fetches, rank: int,
           local_paths: dict[str, Path], chunks: dict[int, bytes], s3, s3_steps,
           group) -> int:
    """Fill ``staging`` for DCP; returns the bytes read from this rank's own disk."""
    small = _small_files(manifest, local_paths, iteration, s3, s3_steps, group)
    for name, raw in small.items():
        (staging / name).write_bytes(raw)
    local_bytes = 0
    sparse: dict[str, list[tuple[ItemRecord, bytes]]] = defaultdict(list)
    for f in fetches:
        if f.rank != rank:
            continue
        main = manifest.items[f.index]
        if f.source == OWN and f.copy.file == main.file:
            target = staging / main.file
            if not target.exists():
                target.symlink_to(local_paths[main.file].resolve())
            local_bytes += main.length          # verified in _verify_local_files
            continue
        raw = chunks[f.index] if f.source != OWN else _read(local_paths[f.copy.file], f.copy)
        if f.source == OWN:
            local_bytes += len(raw)
        sparse[main.file].append((main, raw))
    for name, parts in sparse.items():
        if (staging / name).exists():
            raise RuntimeError(f"{name}: both linked and assembled")   # one source per file
        with open(staging / name, "wb") as out:
            for main, raw in parts:
                out.seek(main.offset)
                out.write(raw)
    return local_bytes


def _small_files(manifest: Manifest, local_paths: dict[str, Path], iteration: int, s3, s3_steps,
                 group) -> dict[str, bytes]:
    """``.metadata``, ``common.pt`` and ``metadata.json``: from the lowest rank that has them
    all on its disk (broadcast), else from S3; checked against the manifest."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    have = all(name in local_paths for name in SMALL_FILES)
    flags: list = [None] * world_size
    dist.all_gather_object(flags, have, group=group)
    source = next((r for r, ok in enumerate(flags) if ok), None)
    if source is None:
        small = {name: s3.get_bytes(f"{step_dir_name(iteration)}/{name}")
                 for name in SMALL_FILES}
    else:
        box = [{name: local_paths[name].read_bytes() for name in SMALL_FILES}
               if rank == source else None]
        dist.broadcast_object_list(box, src=source, group=group)
        small = box[0]
    for name, raw in small.items():
        record = manifest.files[name]
        if raw is None or file_problem(raw, record.size, record.sha256):
            raise CorruptCheckpoint(f"{name} of iteration {iteration} does not match its "
                                    "SHA-256 in the manifest")
    return small
