"""Global batches for the runtime, read through megatron-core's own GPTDataset.

The global-batch contract of the runtime and the single-process reference: global batch ``i`` is
the rows of :data:`BATCH_KEYS` - ``tokens``, ``labels``, ``loss_mask``, ``position_ids`` - each
``[global_batch_size, seq]``, and each pipeline trains its own micro-batches of it
(``RankRole.microbatch_offset``). Instead of Megatron's per-DP-rank data loader, every rank opens
the same GPTDataset - same files, same seed, hence the same shuffle - and global batch ``i`` is
the samples ``[i * global_batch_size, (i + 1) * global_batch_size)``. ``GlobalBatches.batch(i)``
is a :class:`GlobalBatch` that reads samples only when asked: a rank reads the rows of its own
micro-batches (:func:`batch_rows`), the reference and checks read all of it (``tensors()``). No
rank depends on another for data, and the batches do not depend on the plan: any plan of the same
model sees the same sequence of global batches (and a resumed job the same batch ``i``) as the
single-process reference.

The dataset is built with ``BlendedMegatronDatasetBuilder`` + ``GPTDatasetConfig`` exactly as
Megatron-LM's ``pretrain_gpt.py`` does; its sample/shuffle indices use megatron-core's compiled
``helpers_cpp`` extension, which the megatron-core wheel ships prebuilt (nothing to compile), and
are cached in the data directory's ``index-cache``. When torch.distributed is initialised the
builder creates them on global rank 0 first, then the other ranks load them (it must be called on
every rank): as with Megatron-LM's ``--data-cache-path``, every node must see rank 0's cache, so
the data directory of a multi-node job is on a shared file system. :func:`open_global_batches`
checks that before the build (the built-in corpus itself is built per node, by the node's first
local rank): a node that does not see what rank 0 wrote there stops the job with one line naming
the directory and the ranks, where megatron would fail on each such rank with a missing ``.npy``.
Building the indices per node instead would take megatron-core's builder apart (its rank-0 rule
is global), so the shared directory it expects is what is asked for.

The data is the built-in corpus, or Megatron-LM's dataset flags: ``--data-path`` (one prefix, or
a blend of prefixes with or without weights, ``0.5 A 0.5 B``, cut into the splits by
``--split``) or ``--train-data-path`` / ``--valid-data-path`` / ``--test-data-path`` (a blend per
split, no ``--split``). megatron-core reads them as the builder's ``blend`` and
``blend_per_split`` (data/indexed.py ``blend_of``) and blends them itself: a blend's samples come
from a ``BlendedDataset`` over one GPTDataset per prefix, as in Megatron-LM.

Validation (``--eval-interval``/``--eval-iters``): the builder's ``split`` (Megatron-LM's
``--split`` string, "train,valid,test" proportions of the documents) carves a validation dataset
out of the same files, read in global batches like the training one (:func:`build_splits`).
Without evaluation every document trains (:data:`TRAIN_ONLY_SPLIT`); with evaluation and no
``--split`` the built-in corpus takes Megatron-LM's legacy default (:data:`EVAL_SPLIT`), so a
job's training batches change when evaluation is switched on without a ``--split``, as in
Megatron-LM, whose ``--data-path`` default is that split whether it evaluates or not.
"""

from __future__ import annotations

import socket
import uuid
from dataclasses import dataclass
from pathlib import Path

from megatron_autohet.data.corpus import build_corpus, byte_tokenizer, default_data_dir
from megatron_autohet.data.indexed import blend_of
from megatron_autohet.errors import ConfigError, JobConfigError

# The global-batch contract's keys, defined here where the batches are made (data is upstream of
# the runtime and the reference, which read them).
BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")
TRAIN_ONLY_SPLIT = "100,0,0"
EVAL_SPLIT = "969,30,1"            # Megatron-LM's default --split with --data-path


def default_split(split: str | None, evaluating: bool) -> str:
    """The ``--split`` a job uses: the one given, else every document for training, or
    Megatron-LM's default when the job evaluates (a validation split must exist)."""
    if split is not None:
        return split
    return EVAL_SPLIT if evaluating else TRAIN_ONLY_SPLIT


@dataclass(frozen=True)
class DataOptions:
    seq_length: int
    global_batch_size: int
    num_iterations: int
    seed: int = 1234
    # Megatron-LM's --data-path values (a prefix, or a blend); None and no per-split paths: the
    # built-in corpus
    data_path: list[str] | None = None
    train_data_path: list[str] | None = None   # --train-data-path / --valid-data-path /
    valid_data_path: list[str] | None = None   # --test-data-path: a blend per split
    test_data_path: list[str] | None = None
    data_dir: str | None = None           # cache of the built-in corpus and the sample indices
    split: str = TRAIN_ONLY_SPLIT         # Megatron-LM's --split: train,valid,test proportions
    valid_batches: int = 0                # validation global batches to build (0: none)

    @property
    def per_split(self) -> bool:
        """Whether the splits are datasets of their own (--train-data-path, ...)."""
        return any((self.train_data_path, self.valid_data_path, self.test_data_path))

    @property
    def user_data(self) -> bool:
        return self.data_path is not None or self.per_split

    def describe(self) -> str:
        """The data as the flags named it (what a bad token id's line names)."""
        if self.per_split:
            return " ".join(f"{flag} {' '.join(paths)}" for flag, paths in (
                ("--train-data-path", self.train_data_path),
                ("--valid-data-path", self.valid_data_path),
                ("--test-data-path", self.test_data_path)) if paths)
        return " ".join(self.data_path) if self.data_path else "the built-in corpus"


class GlobalBatches:
    """Deterministic global batches: ``batch(i)`` reads the same samples on every rank and call.

    Token ids are checked against the model's vocabulary in the rows as they are read: the check
    costs a max over them, where scanning a large dataset's ``.bin`` up front would be a full read
    of it on every rank at start-up. A bad id is a ConfigError naming the data path, the id and
    the vocabulary, raised by the ranks that read it (the others stop with the job), instead of
    an index error inside the embedding.
    """

    def __init__(self, dataset, global_batch_size: int, vocab_size: int, data_path: str):
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.vocab_size = vocab_size
        self.data_path = data_path          # the data as the flags named it

    def __len__(self) -> int:
        return len(self.dataset) // self.global_batch_size

    def batch(self, iteration: int) -> GlobalBatch:
        if not 0 <= iteration < len(self):
            raise IndexError(f"iteration {iteration} outside the {len(self)} built batches")
        return GlobalBatch(self, iteration)

    def read(self, iteration: int, start: int, end: int) -> dict:
        """Rows ``[start, end)`` of global batch ``iteration``, read from the dataset."""
        # torch: not at `autohet` start-up
        import torch

        first = iteration * self.global_batch_size
        samples = [self.dataset[i] for i in range(first + start, first + end)]
        rows = {key: torch.stack([s[key] for s in samples]) for key in BATCH_KEYS}
        # labels hold the one token past the last of tokens; GPTDataset maps padding to id 0
        largest = int(torch.maximum(rows["tokens"].max(), rows["labels"].max()))
        if largest >= self.vocab_size:
            raise ConfigError(None, "--data-path", f"{self.data_path} holds token id {largest} "
                              f"(read by global batch {iteration}), beyond the model's "
                              f"vocab_size {self.vocab_size}",
                              "a dataset tokenized for this model's vocabulary")
        return rows


@dataclass(frozen=True)
class GlobalBatch:
    """Global batch ``iteration`` of ``source``, read when asked for: ``rows(start, end)`` reads
    those rows only (what a rank trains), ``tensors()`` the whole batch."""

    source: GlobalBatches
    iteration: int

    def rows(self, start: int, end: int) -> dict:
        if not 0 <= start < end <= self.source.global_batch_size:
            raise IndexError(f"rows [{start}, {end}) outside the global batch of "
                             f"{self.source.global_batch_size}")
        return self.source.read(self.iteration, start, end)

    def tensors(self) -> dict:
        return self.rows(0, self.source.global_batch_size)


def batch_rows(global_batch, start: int, end: int) -> dict:
    """Rows ``[start, end)`` of a global batch: a :class:`GlobalBatch` reads only them from its
    dataset; a dict of ``[global_batch_size, seq]`` tensors (a batch made in memory) is sliced."""
    if isinstance(global_batch, GlobalBatch):
        return global_batch.rows(start, end)
    return {key: global_batch[key][start:end] for key in BATCH_KEYS}


def microbatches(global_batch, micro_batch_size: int, first: int, count: int) -> list[dict]:
    """Micro-batches ``[first, first + count)`` of a global batch (dicts of its rows): micro-batch
    ``i`` is rows ``[i * micro_batch_size, (i + 1) * micro_batch_size)``; only those rows are
    materialised (:func:`batch_rows`)."""
    return [batch_rows(global_batch, i * micro_batch_size, (i + 1) * micro_batch_size)
            for i in range(first, first + count)]


def resolve_data_path(options: DataOptions) -> Path | None:
    """The built-in corpus's prefix, built if needed; None with the user's data (checked where
    the job starts: data/indexed.py)."""
    if options.user_data:
        return None
    return build_corpus(options.data_dir)


def index_cache_dir(options: DataOptions) -> Path:
    """Where megatron-core's GPTDataset caches its document, sample and shuffle indices."""
    return Path(options.data_dir or default_data_dir()) / "index-cache"


def open_global_batches(options: DataOptions, vocab_size: int,
                        local_rank: int) -> tuple[GlobalBatches, GlobalBatches | None]:
    """:func:`build_splits` for a job (``torch.distributed`` initialised, every rank calls it):
    local rank 0 of each node builds the built-in corpus first, once per node, and every rank
    must see global rank 0's index cache (:func:`check_shared_cache`)."""
    # torch: not at `autohet` start-up
    import torch.distributed as dist

    if local_rank == 0:
        resolve_data_path(options)
    dist.barrier()
    check_shared_cache(index_cache_dir(options))
    return build_splits(options, vocab_size)


def check_shared_cache(cache: Path) -> None:
    """Every rank of the default group sees the directory ``cache`` of global rank 0, where
    megatron-core builds the indices that the other ranks then read; else every rank raises the
    same JobConfigError (printed once by the job). Rank 0 writes a marker of a fresh name, each
    rank looks for it: one broadcast and one all-gather (object collectives: NCCL takes them)."""
    # torch: not at `autohet` start-up
    import torch.distributed as dist

    rank = dist.get_rank()
    said = [None]
    if rank == 0:
        marker = cache / f".autohet-shared-{uuid.uuid4().hex}"
        try:
            cache.mkdir(parents=True, exist_ok=True)
            marker.touch()
            said = [{"marker": marker.name, "cache": str(cache)}]
        except OSError as err:
            said = [{"error": f"global rank 0 cannot write there: {err}", "cache": str(cache)}]
    dist.broadcast_object_list(said, src=0)
    seen = [None] * dist.get_world_size()
    here = "error" not in said[0] and (cache / said[0]["marker"]).is_file()
    dist.all_gather_object(seen, None if here else socket.gethostname())
    if rank == 0 and "marker" in said[0]:
        (cache / said[0]["marker"]).unlink()
    blind = {r: host for r, host in enumerate(seen) if host is not None}
    if "error" in said[0] or blind:
        problem = said[0].get("error") or (
            f"ranks {sorted(blind)} (on {', '.join(sorted(set(blind.values())))}) do not see "
            "what global rank 0 wrote there; megatron-core builds the dataset's indices on "
            "global rank 0 only and the other ranks read them")
        raise JobConfigError(None, "--data-dir", f"index cache {said[0]['cache']} of global "
                             f"rank 0: {problem}",
                             "a directory every node of the job sees (a shared file system, as "
                             "Megatron-LM's --data-cache-path), by --data-dir "
                             "(--autohet-data-dir with pretrain_gpt.py) or $AUTOHET_DATA_DIR")


def build_global_batches(options: DataOptions, vocab_size: int) -> GlobalBatches:
    """Open the GPTDataset for ``num_iterations`` global batches (call on every rank)."""
    return build_splits(options, vocab_size)[0]


def build_splits(options: DataOptions,
                 vocab_size: int) -> tuple[GlobalBatches, GlobalBatches | None]:
    """The training batches (``num_iterations`` global batches) and, when
    ``options.valid_batches``, the validation ones from the split's validation documents (a
    ConfigError naming --split when the split leaves none). Call on every rank."""
    # megatron-core: not at `autohet` start-up
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder)
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    corpus = resolve_data_path(options)
    if corpus is not None:
        blend, blend_per_split, split = ([str(corpus)], None), None, options.split
    elif options.per_split:
        blend, split = None, None
        blend_per_split = [blend_of(options.train_data_path, "--train-data-path"),
                           blend_of(options.valid_data_path, "--valid-data-path"),
                           blend_of(options.test_data_path, "--test-data-path")]
    else:
        blend, blend_per_split = blend_of(options.data_path, "--data-path"), None
        split = options.split
    config = GPTDatasetConfig(
        random_seed=options.seed,
        sequence_length=options.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=split,
        path_to_cache=str(index_cache_dir(options)),
        tokenizer=byte_tokenizer(vocab_size),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,    # GPTModel applies the causal mask itself
    )
    num_samples = options.num_iterations * options.global_batch_size
    # A split not read: no size (its whole documents, if any, are indexed), but a weighted blend
    # needs one (megatron-core asserts it): none of its samples then
    weighted = any(b is not None and b[1] is not None for b in [blend, *(blend_per_split or [])])
    unread = 0 if weighted else None
    valid_samples = options.valid_batches * options.global_batch_size or unread
    try:
        train, valid, _ = BlendedMegatronDatasetBuilder(
            GPTDataset, [num_samples, valid_samples, unread], lambda: True, config).build()
    except (AssertionError, ValueError) as err:     # megatron's checks of the split string
        raise ConfigError(None, "--split", f"{options.split!r}: {err}",
                          "three comma-separated proportions train,valid,test") from None
    described = str(corpus) if corpus is not None else options.describe()
    if train is None:
        raise ConfigError(None, "--split", f"{options.split!r} leaves no training documents",
                          "a split with a non-zero training share")
    if not options.valid_batches:
        return GlobalBatches(train, options.global_batch_size, vocab_size, described), None
    if valid is None:
        raise ConfigError(None, "--split", f"{options.split!r} leaves no validation documents "
                          "for --eval-iters", "a split with a non-zero validation share, e.g. "
                          f"{EVAL_SPLIT}")
    return (GlobalBatches(train, options.global_batch_size, vocab_size, described),
            GlobalBatches(valid, options.global_batch_size, vocab_size, described))
