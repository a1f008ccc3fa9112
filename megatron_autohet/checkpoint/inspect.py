"""What is in a checkpoint directory or S3 prefix, and whether its bytes still match (no torch).

``autohet checkpoint ls`` and ``verify`` run here, and recovery (checkpoint/recovery.py) judges
every chunk and small file it fetches with :func:`read_item` / :func:`item_problem` /
:func:`file_problem` before deserializing anything, so bytes are judged by one piece of code.
Nothing here imports torch, megatron-core or boto3 (an :class:`~.s3_store.S3Store` comes in
from the caller): the commands answer in well under a second.

Which files a directory should hold
-----------------------------------
A shared ``--save`` directory holds every rank's data files; a node-local directory
(``--autohet-local-ckpt-dir``) holds only those of its node's ranks (main files and replicas)
plus the small files. A directory does not say which it is, so :func:`nodes_served` reads it from
the data files present: one node's only -> a node-local directory of that node; several (or none)
-> a shared directory, which owes every node's files. Every data file of the nodes served, and
every small file, must then be there with the manifest's size. An S3 prefix holds one whole copy
of the step: every listed file must be there.
"""

from __future__ import annotations

import glob
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from megatron_autohet.checkpoint.manifest import (LATEST_FILE, MANIFEST_FILE, PARTIAL_SUFFIX,
                                                  Checksum, ItemRecord, Manifest,
                                                  committed_steps, matches,
                                                  parse_step_dir_name, read_manifest,
                                                  step_dir_name)

MISMATCH = "checksum mismatch"
TRUNCATED = "truncated"
MISSING = "missing file"
# Bytes per ranged GET when verifying on S3 (see verify_s3).
S3_WINDOW = 64 * 2**20
# A chunk is read and hashed in blocks of this size (read_item).
READ_BLOCK = 2**20


# ---- what a step holds ---------------------------------------------------------------------

@dataclass
class StepInfo:
    """One step directory as ``ls`` shows it. Without a manifest (a save or upload that did not
    finish, e.g. ``iter_0000008.partial``) the ``*_listed`` and plan fields are None and
    ``reason`` says why the step is incomplete."""

    where: str                          # step directory, or its s3:// URI
    iteration: int
    complete: bool
    files_present: int
    files_listed: int | None
    bytes_present: int
    bytes_listed: int | None
    world_size: int | None = None       # of the plan that saved it
    pipelines: int | None = None
    cluster: str | None = None
    nodes_served: list[str] = field(default_factory=list)   # whose data files it holds
    latest: bool = False                # what latest_checkpointed_iteration.txt names
    reason: str | None = None


def node_of_file(manifest: Manifest) -> dict[str, str]:
    """File name -> the plan's node whose disk the file's writer is on."""
    node_of_rank = {r["rank"]: r["node"] for r in manifest.plan["ranks"]}
    return {name: node_of_rank[f.rank] for name, f in manifest.files.items()}


def is_data_file(manifest: Manifest, name: str) -> bool:
    """DCP data files carry per-chunk checksums; the small files one for the whole file."""
    return manifest.files[name].digest is None


def nodes_served(manifest: Manifest, names: set[str]) -> set[str]:
    """The nodes whose data files a directory holding ``names`` owes (module docstring): the one
    node when only its data files are there, else every node - so a shared directory missing
    some rank's file reports it instead of passing for another node's copy."""
    nodes = node_of_file(manifest)
    here = {nodes[n] for n in names & manifest.files.keys() if is_data_file(manifest, n)}
    return here if len(here) == 1 else set(nodes.values())


def expected_files(manifest: Manifest, nodes: set[str]) -> tuple[list[str], list[str]]:
    """(files a copy serving ``nodes`` must hold, data files that are on other nodes' disks)."""
    node = node_of_file(manifest)
    due, elsewhere = [], []
    for name in sorted(manifest.files):
        if is_data_file(manifest, name) and node[name] not in nodes:
            elsewhere.append(name)
        else:
            due.append(name)
    return due, elsewhere


def s3_files(manifest: Manifest) -> list[str]:
    """The files the S3 tier holds of a step (checkpoint/upload.py): the data files of the main
    copies and the small files; replicas stay on the disks (S3 keeps one copy)."""
    main = {item.file for item in manifest.items}
    return sorted(n for n in manifest.files if n in main or not is_data_file(manifest, n))


def _step_info(where: str, iteration: int, manifest: Manifest, sizes: dict[str, int],
               nodes: set[str], due: list[str]) -> StepInfo:
    """A committed step from its manifest and the sizes of the files that are there (``due``:
    those that must be)."""
    listed = manifest.files
    present = {name: size for name, size in sizes.items() if name in listed}
    problems = [f"{name} missing" if name not in present else
                f"{name} has {present[name]} bytes, the manifest lists {listed[name].size}"
                for name in due if present.get(name) != listed[name].size]
    return StepInfo(
        where=where, iteration=iteration, complete=not problems, files_present=len(present),
        files_listed=len(listed), bytes_present=sum(present.values()),
        bytes_listed=manifest.total_bytes, world_size=len(manifest.plan["ranks"]),
        pipelines=len(manifest.plan["pipelines"]), cluster=manifest.plan["cluster"],
        nodes_served=sorted(nodes), reason="; ".join(problems) or None)


def _uncommitted(where: str, iteration: int, sizes: dict[str, int], reason: str) -> StepInfo:
    return StepInfo(where=where, iteration=iteration, complete=False, files_present=len(sizes),
                    files_listed=None, bytes_present=sum(sizes.values()), bytes_listed=None,
                    reason=reason)


def _latest(raw: bytes | None) -> int | None:
    text = raw.decode(errors="replace").strip() if raw is not None else ""
    return int(text) if text.isdigit() else None


def existing_dirs(location: str) -> list[Path]:
    """The directory if it exists, or every existing directory a ``{node}`` template matches."""
    if "{node}" not in location:
        return [Path(location)] if Path(location).is_dir() else []
    pattern = "*".join(glob.escape(part) for part in location.split("{node}"))
    return sorted(Path(p) for p in glob.glob(pattern) if Path(p).is_dir())


def newest_manifest(location: str) -> tuple[Path, Manifest] | None:
    """The newest committed step under ``location`` (``{node}`` allowed) and its manifest."""
    found = [(iteration, root) for root in existing_dirs(location)
             for iteration in committed_steps(root)]
    if not found:
        return None
    iteration, root = max(found)
    step = root / step_dir_name(iteration)
    return step, read_manifest(step)


def list_local(root: str | Path) -> list[StepInfo]:
    """Committed and partial step directories under ``root``, oldest first."""
    root = Path(root)
    latest_file = root / LATEST_FILE
    latest = _latest(latest_file.read_bytes() if latest_file.is_file() else None)
    steps = []
    for entry in root.iterdir():
        partial = entry.name.endswith(PARTIAL_SUFFIX)
        iteration = parse_step_dir_name(entry.name.removesuffix(PARTIAL_SUFFIX))
        if iteration is None or not entry.is_dir():
            continue
        sizes = {f.name: f.stat().st_size for f in entry.iterdir() if f.is_file()}
        if partial:
            info = _uncommitted(str(entry), iteration, sizes, "no manifest: a save in progress "
                                "or interrupted (.partial)")
        elif MANIFEST_FILE not in sizes:
            info = _uncommitted(str(entry), iteration, sizes, "no manifest: the save did not "
                                "commit")
        else:
            try:
                manifest = Manifest.from_json((entry / MANIFEST_FILE).read_bytes(),
                                              str(entry / MANIFEST_FILE))
            except ValueError as err:
                info = _uncommitted(str(entry), iteration, sizes, str(err))
            else:
                nodes = nodes_served(manifest, set(sizes))
                info = _step_info(str(entry), iteration, manifest, sizes, nodes,
                                  expected_files(manifest, nodes)[0])
                info.latest = iteration == latest
        steps.append((iteration, partial, info))
    return [info for _, _, info in sorted(steps, key=lambda s: s[:2])]


def committed_s3(store) -> list[int]:
    """Iterations under an S3Store's prefix with a manifest object, oldest first (the S3
    counterpart of manifest.committed_steps; a listing only, no manifest is downloaded)."""
    return store.steps_holding(MANIFEST_FILE)


def list_s3(store) -> list[StepInfo]:
    """Steps under an :class:`~.s3_store.S3Store`'s prefix, oldest first. Complete: the manifest
    object exists and so does every file the S3 tier holds (:func:`s3_files`), with its size."""
    latest = _latest(store.get_bytes(LATEST_FILE))
    steps = []
    for iteration in store.list_steps():
        where = store.location.uri(step_dir_name(iteration))
        sizes = store.list_files(iteration)
        raw = store.get_bytes(f"{step_dir_name(iteration)}/{MANIFEST_FILE}") \
            if MANIFEST_FILE in sizes else None
        if raw is None:
            steps.append(_uncommitted(where, iteration, sizes, "no manifest: the upload did "
                                      "not finish"))
            continue
        try:
            manifest = Manifest.from_json(raw, f"{where}/{MANIFEST_FILE}")
        except ValueError as err:
            steps.append(_uncommitted(where, iteration, sizes, str(err)))
            continue
        info = _step_info(where, iteration, manifest, sizes, set(node_of_file(manifest).values()),
                          s3_files(manifest))
        info.latest = iteration == latest
        steps.append(info)
    return steps


# ---- whether the bytes match ---------------------------------------------------------------

@dataclass(frozen=True)
class BadItem:
    """One problem: a chunk's bytes (``item`` set) or a whole file (``item`` None)."""

    file: str                           # path or s3:// URI
    problem: str                        # MISMATCH, TRUNCATED, MISSING, or an unreadable manifest
    item: ItemRecord | None = None

    def __str__(self) -> str:
        if self.item is None:
            return f"{self.file}: {self.problem}"
        return (f"{self.file}: bytes {self.item.offset}-{self.item.offset + self.item.length} "
                f"({self.item.key}): {self.problem}")


@dataclass
class VerifyReport:
    where: str
    iteration: int
    problems: list[BadItem] = field(default_factory=list)
    files_checked: int = 0
    items_checked: int = 0
    bytes_checked: int = 0
    elsewhere: list[str] = field(default_factory=list)   # data files on other nodes' disks

    @property
    def ok(self) -> bool:
        return not self.problems


def item_problem(item: ItemRecord, raw: bytes | memoryview) -> str | None:
    """None when ``raw`` (what was read at the item's place) is the item, else what is wrong."""
    if len(raw) < item.length:
        return TRUNCATED
    return None if matches(raw, item.digest) else MISMATCH


def read_item(f, item: ItemRecord) -> tuple[memoryview, str | None]:
    """The item's bytes read from the open file ``f``, and what is wrong with them (None: they
    are the item). Hashed block by block as they are read, each block while it is still in the
    CPU's cache (a chunk is often hundreds of MB: no second pass over it); the hash releases the
    GIL for each block, so threads reading other chunks hash at the same time."""
    buffer = memoryview(bytearray(item.length))
    digest = Checksum(item.digest)
    f.seek(item.offset)
    done = 0
    while done < item.length:
        n = f.readinto(buffer[done:done + READ_BLOCK])
        if not n:
            return buffer[:done], TRUNCATED
        digest.update(buffer[done:done + n])
        done += n
    return buffer, None if digest.digest == item.digest else MISMATCH


def file_problem(raw: bytes, size: int, digest: str) -> str | None:
    """None when ``raw`` is the whole file the manifest describes, else what is wrong."""
    if len(raw) < size:
        return TRUNCATED
    return None if matches(raw, digest) else MISMATCH


def cut_short(where: str, items: list[ItemRecord], size: int) -> list[BadItem]:
    """One problem for a data file of ``size`` bytes that ends before some of its ``items``
    (none when it holds them all): a cut file is one line, not one per chunk it lost."""
    cut = sorted((i for i in items if i.offset + i.length > size), key=lambda i: i.offset)
    if not cut:
        return []
    end = max(i.offset + i.length for i in items)
    return [BadItem(where, f"{TRUNCATED} at byte {size} of {end}: {len(cut)} of its "
                           f"{len(items)} chunks cut short or missing (from {cut[0].key})")]


def check_local_items(step_dir: Path, items: list[ItemRecord],
                      progress=None) -> tuple[list[BadItem], int]:
    """Re-hash ``items`` in ``step_dir`` (files by name, chunks in file order): the problems and
    the bytes read; a file cut short is one problem (:func:`cut_short`), the chunks it still
    holds whole are re-hashed. ``progress``: None or a tqdm bar, advanced by each chunk's
    bytes."""
    by_file: dict[str, list[ItemRecord]] = defaultdict(list)
    for item in items:
        by_file[item.file].append(item)
    problems, total = [], 0
    for name, file_items in sorted(by_file.items()):
        path = step_dir / name
        if not path.is_file():
            problems.append(BadItem(str(path), MISSING))
            continue
        size = path.stat().st_size
        with open(path, "rb") as f:
            for item in sorted(file_items, key=lambda i: i.offset):
                if progress is not None:
                    progress.update(item.length)
                if item.offset + item.length > size:
                    continue
                raw, problem = read_item(f, item)
                total += len(raw)
                if problem:
                    problems.append(BadItem(str(path), problem, item))
        problems += cut_short(str(path), file_items, size)
    return problems, total


def _manifest_problem(path: str, raw: bytes) -> tuple[Manifest | None, BadItem | None]:
    try:
        return Manifest.from_json(raw, path), None
    except ValueError as err:
        return None, BadItem(path, str(err).removeprefix(f"{path}: "))


def _start(progress, total: int) -> None:
    if progress is not None:
        progress.total = total
        progress.refresh()


def verify_local(step_dir: str | Path, progress=None) -> VerifyReport:
    """Re-hash every chunk of the data files this directory should hold (:func:`nodes_served`)
    and the small files. ``progress``: None or a tqdm bar (its total is set here)."""
    step_dir = Path(step_dir)
    iteration = parse_step_dir_name(step_dir.name)
    report = VerifyReport(str(step_dir), iteration)
    manifest, bad = _manifest_problem(str(step_dir / MANIFEST_FILE),
                                      (step_dir / MANIFEST_FILE).read_bytes())
    if bad:
        report.problems.append(bad)
        return report
    present = {f.name for f in step_dir.iterdir() if f.is_file()}
    due, report.elsewhere = expected_files(manifest, nodes_served(manifest, present))
    data = [n for n in due if is_data_file(manifest, n)]
    items = [item for name in data for item in manifest.items_in(name)]
    small = [manifest.files[n] for n in due if not is_data_file(manifest, n)]
    _start(progress, sum(i.length for i in items) + sum(f.size for f in small))
    report.problems, report.bytes_checked = check_local_items(step_dir, items, progress)
    for record in small:
        path = step_dir / record.name
        if not path.is_file():
            report.problems.append(BadItem(str(path), MISSING))
            continue
        raw = path.read_bytes()
        report.bytes_checked += len(raw)
        if progress is not None:
            progress.update(record.size)
        problem = file_problem(raw, record.size, record.digest)
        if problem:
            report.problems.append(BadItem(str(path), problem))
    report.files_checked = len(present.intersection(due))
    report.items_checked = len(items)
    return report


def _windows(items: list[ItemRecord]) -> list[list[ItemRecord]]:
    """Consecutive chunks (file order) grouped so that each group spans at most S3_WINDOW bytes
    (a larger chunk is a group of its own)."""
    groups: list[list[ItemRecord]] = []
    for item in sorted(items, key=lambda i: i.offset):
        if groups and item.offset + item.length - groups[-1][0].offset <= S3_WINDOW:
            groups[-1].append(item)
        else:
            groups.append([item])
    return groups


def _check_s3_data_file(store, key: str, uri: str, items: list[ItemRecord], size: int,
                        report: VerifyReport) -> None:
    """Chunks that end past the object's ``size`` make one problem (:func:`cut_short`, no
    request needed); the others are fetched by :func:`_windows` and re-hashed."""
    whole = [i for i in items if i.offset + i.length <= size]
    for group in _windows(whole):
        start = group[0].offset
        raw = memoryview(store.get_range(key, start, group[-1].offset + group[-1].length - start))
        report.bytes_checked += len(raw)
        for item in group:
            problem = item_problem(item, raw[item.offset - start:item.offset - start + item.length])
            if problem:
                report.problems.append(BadItem(uri, problem, item))
    report.problems += cut_short(uri, items, size)
    report.items_checked += len(items)


def verify_s3(store, iteration: int, progress=None) -> VerifyReport:
    """Re-hash every chunk and small file of step ``iteration`` under an S3Store's prefix.

    Data files are read with ranged GETs of up to :data:`S3_WINDOW` bytes, each covering many
    consecutive chunks: one GET per chunk would cost a round trip for each of the hundreds of
    small chunks (norms, biases, extra state) a file holds, and one GET per file would hold a
    whole rank's file (gigabytes for a large model) in memory at once."""
    step = step_dir_name(iteration)
    report = VerifyReport(store.location.uri(step), iteration)
    manifest, bad = _manifest_problem(store.location.uri(f"{step}/{MANIFEST_FILE}"),
                                      store.get_bytes(f"{step}/{MANIFEST_FILE}") or b"")
    if bad:
        report.problems.append(bad)
        return report
    sizes = store.list_files(iteration)
    due = s3_files(manifest)
    _start(progress, sum(manifest.files[n].size for n in due))
    for name in due:
        key, record = f"{step}/{name}", manifest.files[name]
        uri = store.location.uri(key)
        if name not in sizes:
            report.problems.append(BadItem(uri, MISSING))
        elif is_data_file(manifest, name):
            report.files_checked += 1
            _check_s3_data_file(store, key, uri, manifest.items_in(name), sizes[name], report)
        else:
            report.files_checked += 1
            raw = store.get_bytes(key)
            report.bytes_checked += len(raw)
            problem = file_problem(raw, record.size, record.digest)
            if problem:
                report.problems.append(BadItem(uri, problem))
        if progress is not None:
            progress.update(record.size)
    return report
