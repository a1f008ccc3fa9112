"""The manifest that commits a checkpoint step, and the atomic file writes behind it (no torch).

A step directory (``iter_0000004/``, Megatron-LM's name) holds megatron-core's ``torch_dist``
files - torch DCP data files ``__<rank>_<i>.distcp`` and their index ``.metadata``, megatron's
``common.pt`` and ``metadata.json`` - and, written last, ``autohet-manifest.json``. A step counts
only once its manifest is there: readers ignore a directory without one (a save that died half
way), and every byte they load is checked against the manifest's checksum first.

What the manifest records
-------------------------
* ``files``: every file of the step with its size, the rank that wrote it and, for the small
  files, the checksum of the whole file.
* ``items``: every chunk DCP stored in a data file - its checkpoint key, the global offsets and
  sizes of the tensor region it holds (None for a serialized object), and where its bytes are
  (file, byte offset, length) with their checksum. Recovery plans from these alone (which chunk a
  new layout needs, who holds it) without unpickling DCP's ``.metadata``; a chunk is the unit
  that is verified, fetched from a peer or read from S3 with a ranged GET.
* ``replicas``: the same chunks again, byte for byte, in ``replica_<rank>.distcp`` files that
  ranks holding a non-main copy wrote on other nodes' disks (at most one copy per node): after a
  node is lost, a survivor's replica saves the download.
* ``iteration``, the plan and the model it was saved under (``autohet checkpoint ls`` shows them;
  a resume compares the model with its own before any process starts, :func:`model_mismatch`).

Checksums
---------
Each is written ``ALGORITHM:HEX`` (OCI's digest form), and a reader checks bytes with the
algorithm the digest names (:class:`Checksum`), so steps written by earlier versions, whose
manifests (format version 1) hold bare SHA-256 hex, load and verify as they are. New steps record
``xxh3_128``, a 128-bit non-cryptographic hash: it guards against what a checksum is for (bit
rot, torn writes, damaged transfers; an attacker could rewrite the manifest too) at an order of
magnitude more GB/s per core than SHA-256, which took about a third of a local-first recovery's
own-disk tier (scripts/bench_checksums.py, bench_recovery.py --compare-checksum sha256; figures
in docs/checkpoints.md). Both libraries release the GIL while they hash, so verifying threads
hash in parallel.

Atomic writes: :func:`write_atomic` writes a temporary name in the target directory, fsyncs it,
renames it over the target and fsyncs the directory, so a crash leaves the old file or the new
one, never a torn one. The step directory itself is written under ``iter_0000004.partial`` and
renamed when complete (:func:`commit_step_dir`).
"""

from __future__ import annotations

import hashlib
import json
import errno
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import xxhash

MANIFEST_FILE = "autohet-manifest.json"
LATEST_FILE = "latest_checkpointed_iteration.txt"      # Megatron-LM's name and format
FORMAT = "megatron-autohet checkpoint"
FORMAT_VERSION = 2
# Versions this code reads; version 1 (no "digest" fields: bare SHA-256 hex in "sha256") is
# converted to the current form as it is read (Manifest.from_json).
READABLE_VERSIONS = (1, 2)
PARTIAL_SUFFIX = ".partial"


def step_dir_name(iteration: int) -> str:
    """Megatron-LM's step directory name: ``iter_0000004``."""
    return f"iter_{iteration:07d}"


def parse_step_dir_name(name: str) -> int | None:
    if len(name) == 12 and name.startswith("iter_") and name[5:].isdigit():
        return int(name[5:])
    return None


# Every checksum algorithm a manifest may name; new steps record CHECKSUM.
HASHERS = {"sha256": hashlib.sha256, "xxh3_128": xxhash.xxh3_128}
CHECKSUM = "xxh3_128"


class Checksum:
    """A running checksum: of the algorithm a recorded ``digest`` names (to verify bytes against
    it), or of :data:`CHECKSUM` (to record new bytes). Fed block by block with :meth:`update`."""

    def __init__(self, digest: str | None = None):
        self.algorithm = CHECKSUM if digest is None else digest.partition(":")[0]
        self._hash = HASHERS[self.algorithm]()

    def update(self, data: bytes | memoryview) -> "Checksum":
        self._hash.update(data)
        return self

    @property
    def digest(self) -> str:
        return f"{self.algorithm}:{self._hash.hexdigest()}"


def checksum(data: bytes | memoryview) -> str:
    """The digest a new step records for ``data``."""
    return Checksum().update(data).digest


def checksum_file(path: str | Path) -> str:
    digest = Checksum()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.digest


def matches(data: bytes | memoryview, digest: str) -> bool:
    """Whether ``data`` is what ``digest`` (a manifest's, any known algorithm) was taken of."""
    return Checksum(digest).update(data).digest == digest


@dataclass(frozen=True)
class ItemRecord:
    """One DCP chunk: a tensor region (``offsets``/``sizes`` in the global tensor) or an object."""

    key: str
    offsets: tuple[int, ...] | None          # None: a serialized object (megatron ShardedObject)
    sizes: tuple[int, ...] | None
    file: str
    offset: int                              # byte offset in the file
    length: int
    digest: str                              # "ALGORITHM:HEX" (Checksum)

    @property
    def region(self) -> tuple[str, tuple[int, ...] | None]:
        """What DCP's index calls the chunk: (key, offsets)."""
        return self.key, self.offsets


@dataclass(frozen=True)
class FileRecord:
    name: str
    size: int
    rank: int                                # the rank that wrote it (0 for the small files)
    node: str                                # the plan's node of that rank (whose disk has it)
    digest: str | None = None                # whole-file checksum of the small files


@dataclass
class Manifest:
    iteration: int
    files: dict[str, FileRecord]
    items: list[ItemRecord]                  # the main copy of every chunk (DCP's index)
    plan: dict                               # Plan.to_dict() of the plan that saved it
    replicas: list[ItemRecord] = field(default_factory=list)   # same bytes in other nodes' files
    format: str = FORMAT
    format_version: int = FORMAT_VERSION
    extra: dict = field(default_factory=dict)

    @property
    def model(self) -> dict | None:
        """The model spec the step was saved from (``ModelSpec.to_dict()``); None for a step
        converted from stock Megatron-LM (its plan-shaped record has no model)."""
        return self.plan.get("model")

    def items_in(self, file: str) -> list[ItemRecord]:
        return [i for i in self.items + self.replicas if i.file == file]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    def to_json(self) -> bytes:
        data = asdict(self)
        data["files"] = [asdict(f) for f in self.files.values()]
        return (json.dumps(data, indent=1, sort_keys=True) + "\n").encode()

    @classmethod
    def from_json(cls, raw: bytes, source: str) -> "Manifest":
        """Parse a manifest; ValueError naming ``source`` when it is not one of ours."""
        try:
            data = json.loads(raw)
            version = data.get("format_version")
            if data.get("format") != FORMAT or version not in READABLE_VERSIONS:
                raise ValueError(f"format {data.get('format')!r} version {version!r}")
            return cls(
                iteration=int(data["iteration"]), plan=data["plan"], extra=data.get("extra", {}),
                files={f["name"]: FileRecord(name=f["name"], size=f["size"], rank=f["rank"],
                                             node=f["node"], digest=_digest(f, version))
                       for f in data["files"]},
                items=[_item(i, version) for i in data["items"]],
                replicas=[_item(i, version) for i in data["replicas"]])
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{source}: not a readable {FORMAT} manifest ({err})") from err


# What a resume must match: every field of the model spec that shapes a tensor or what its values
# mean (the name is a label). Megatron-LM's name in brackets where it differs.
MODEL_FIELDS = {
    "num_layers": "", "hidden_size": "", "num_attention_heads": "", "num_query_groups": "",
    "ffn_hidden_size": "", "vocab_size": "", "seq_length": " (max_position_embeddings)",
    "gated_linear_unit": " (swiglu, and with it RMSNorm instead of LayerNorm, no linear biases)",
    "position_embedding_type": "",
    "tie_embeddings": " (untie_embeddings_and_output_weights)",
}


def model_mismatch(saved: dict | None, model: dict) -> tuple[str, object, object] | None:
    """The first field (:data:`MODEL_FIELDS` order) in which ``model`` (``ModelSpec.to_dict()``)
    differs from the ``saved`` model of a step, as (field, this value, saved value); None when
    they agree or the step recorded no model (:attr:`Manifest.model`); a field the record lacks
    is not compared."""
    if saved is None:
        return None
    for name in MODEL_FIELDS:
        if name in saved and name in model and saved[name] != model[name]:
            return name, model[name], saved[name]
    return None


def _digest(record: dict, version: int) -> str | None:
    """A record's checksum in the current form (format version 1 kept bare SHA-256 hex in
    "sha256"); ValueError for an algorithm this code does not know."""
    if version == 1:
        return None if record["sha256"] is None else f"sha256:{record['sha256']}"
    digest = record["digest"]
    if digest is not None and digest.partition(":")[0] not in HASHERS:
        raise ValueError(f"checksum {digest.partition(':')[0]!r} (known: {', '.join(HASHERS)})")
    return digest


def _item(data: dict, version: int) -> ItemRecord:
    return ItemRecord(key=data["key"], file=data["file"], offset=data["offset"],
                      length=data["length"], digest=_digest(data, version),
                      offsets=None if data["offsets"] is None else tuple(data["offsets"]),
                      sizes=None if data["sizes"] is None else tuple(data["sizes"]))


# ---- atomic file operations ------------------------------------------------------------------

def fsync_dir(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a crash leaves the old content or the new, never half."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_tree(path: str | Path) -> None:
    """fsync every file of a directory and the directory (before a rename commits it)."""
    for entry in Path(path).iterdir():
        if entry.is_file():
            with open(entry, "rb") as f:
                os.fsync(f.fileno())
    fsync_dir(path)


def partial_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / (step_dir_name(iteration) + PARTIAL_SUFFIX)


def commit_step_dir(root: str | Path, iteration: int) -> Path:
    """Rename the finished ``iter_N.partial`` to ``iter_N`` and point Megatron's
    ``latest_checkpointed_iteration.txt`` at it. A committed step is never replaced: an
    ``iter_N`` already there (another writer's) is a FileExistsError, the rename itself being
    the check (a directory is not renamed over a non-empty one)."""
    root = Path(root)
    final = root / step_dir_name(iteration)
    staged = partial_dir(root, iteration)
    fsync_tree(staged)
    if final.is_dir() and not any(final.iterdir()):
        final.rmdir()                       # an empty directory holds no step
    try:
        if final.exists():
            raise FileExistsError
        os.rename(staged, final)
    except (FileExistsError, IsADirectoryError, NotADirectoryError) as err:
        raise FileExistsError(f"{final} exists already (another writer's step): a committed "
                              "step is never replaced") from err
    except OSError as err:
        if err.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        raise FileExistsError(f"{final} exists already (another writer's step): a committed "
                              "step is never replaced") from err
    fsync_dir(root)
    write_atomic(root / LATEST_FILE, str(iteration).encode())
    return final


def read_manifest(step_dir: str | Path) -> Manifest | None:
    """The step's manifest, or None when the step is not committed (no manifest yet)."""
    path = Path(step_dir) / MANIFEST_FILE
    if not path.is_file():
        return None
    return Manifest.from_json(path.read_bytes(), str(path))


def committed_steps(root: str | Path) -> list[int]:
    """Iterations with a committed step directory under ``root`` (a manifest), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    steps = []
    for entry in root.iterdir():
        iteration = parse_step_dir_name(entry.name)
        if iteration is not None and (entry / MANIFEST_FILE).is_file():
            steps.append(iteration)
    return sorted(steps)


def remove_old_steps(root: str | Path, keep: int) -> list[int]:
    """Keep the newest ``keep`` committed steps; also drop partial directories older than the
    newest committed step (left by a save that died). Returns the iterations removed."""
    root = Path(root)
    steps = committed_steps(root)
    removed = steps[:-keep] if keep > 0 else []
    for iteration in removed:
        shutil.rmtree(root / step_dir_name(iteration), ignore_errors=True)
    newest = steps[-1] if steps else None
    for entry in root.iterdir() if root.is_dir() else ():
        if entry.name.endswith(PARTIAL_SUFFIX):
            iteration = parse_step_dir_name(entry.name[:-len(PARTIAL_SUFFIX)])
            if iteration is not None and newest is not None and iteration < newest:
                shutil.rmtree(entry, ignore_errors=True)
    return removed
