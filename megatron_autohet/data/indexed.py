"""The user's indexed datasets, checked before any process starts: ``--data-path`` blends.

Megatron-LM takes a dataset flag (``--data-path``, ``--train-data-path``, ``--valid-data-path``,
``--test-data-path``) as one prefix, a list of prefixes, or weights and prefixes alternating
(``0.5 A 0.5 B``); megatron-core's ``get_blend_from_list`` reads it into the ``blend`` of
``BlendedMegatronDatasetConfig`` and :func:`blend_of` calls it here too. :func:`check_prefixes`
checks every prefix of such a blend in the launcher, where a mistake costs a second instead of
every rank's start-up: the ``.bin`` and ``.idx`` exist (a path given with its suffix is named as
such), the ``.idx`` reads with megatron-core's own index reader (``_IndexReader``, what
``IndexedDataset`` opens), the ``.bin`` holds exactly the tokens the index points at, and the
index's token dtype can hold every id of the model's vocabulary (a dataset written for a smaller
vocabulary cannot be this model's). Ids beyond the vocabulary are found where the batches read
them (data/batches.py): a full scan of a large ``.bin`` on every start would cost more than it
saves.
"""

from __future__ import annotations

from pathlib import Path

import numpy

from megatron_autohet.errors import ConfigError

SUFFIXES = (".bin", ".idx")
_PREFIX = "the prefix of a megatron indexed dataset (PREFIX.bin + PREFIX.idx)"


def blend_of(paths: list[str] | None, flag: str) -> tuple[list[str], list[float] | None] | None:
    """megatron-core's blend (prefixes, weights or None) of a dataset flag's values, as
    Megatron-LM's ``get_blend_and_blend_per_split`` makes it; a weight that is not a number > 0
    is a ConfigError naming ``flag``."""
    if not paths:
        return None
    # megatron-core: the launcher checks before any rank starts, and imports torch next anyway
    from megatron.core.datasets.utils import get_blend_from_list

    if len(paths) % 2 == 0 and _is_number(paths[0]):
        for weight in paths[::2]:
            if not (_is_number(weight) and float(weight) > 0):
                raise ConfigError("<command line>", flag, f"weight {weight!r} in "
                                  f"{' '.join(paths)}", "weights > 0 and prefixes alternating "
                                  "(0.5 A 0.5 B), or prefixes only")
    return get_blend_from_list(list(paths))


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def check_prefixes(paths: list[str] | None, flag: str, vocab_size: int) -> None:
    """Every prefix of the blend ``paths`` (a dataset flag's values) is an indexed dataset this
    model can train on (module docstring); else one ConfigError naming ``flag``."""
    blend = blend_of(paths, flag)
    if blend is None:
        return
    for prefix in blend[0]:
        check_prefix(prefix, flag, vocab_size)


# The dataset flags, by the field that holds each (job.TrainOptions, data/batches.DataOptions).
DATASET_FLAGS = {"data_path": "--data-path", "train_data_path": "--train-data-path",
                 "valid_data_path": "--valid-data-path", "test_data_path": "--test-data-path"}


def check_datasets(options, vocab_size: int) -> None:
    """:func:`check_prefixes` of every dataset flag of ``options`` (:data:`DATASET_FLAGS`)."""
    for field, flag in DATASET_FLAGS.items():
        check_prefixes(getattr(options, field), flag, vocab_size)


def check_prefix(prefix: str, flag: str, vocab_size: int) -> None:
    """One dataset prefix (:func:`check_prefixes`)."""
    # megatron-core's index reader: what IndexedDataset opens (see blend_of for the import)
    from megatron.core.datasets.indexed_dataset import _IndexReader

    path = Path(prefix)
    if path.suffix in SUFFIXES and not _files_of(path).is_file():
        raise ConfigError("<command line>", flag, f"{prefix} ends in {path.suffix}",
                          f"give the prefix without {path.suffix}: {path.with_suffix('')}")
    bin_path, idx_path = (Path(f"{prefix}{suffix}") for suffix in SUFFIXES)
    for file in (bin_path, idx_path):
        if not file.is_file():
            raise ConfigError("<command line>", flag, f"{file} not found", _PREFIX)
    try:
        index = _IndexReader(str(idx_path), multimodal=False)
    except (AssertionError, ValueError, OSError) as err:       # megatron's header asserts
        raise ConfigError("<command line>", flag, f"{idx_path} is not a megatron index: {err}",
                          _PREFIX) from None
    dtype = numpy.dtype(index.dtype)
    if index.sequence_count == 0:
        raise ConfigError("<command line>", flag, f"{idx_path} indexes no documents",
                          "a dataset with documents")
    expected = int(index.sequence_pointers[-1]) + int(index.sequence_lengths[-1]) * dtype.itemsize
    size = bin_path.stat().st_size
    if size != expected:
        raise ConfigError("<command line>", flag, f"{bin_path} holds {size} bytes but "
                          f"{idx_path} indexes {expected} ({index.sequence_count} sequences of "
                          f"{dtype.name})", "the .bin and .idx that one tokenization wrote "
                          "together")
    if dtype.kind not in "iu" or numpy.iinfo(dtype).max < vocab_size - 1:
        holds = (f"ids up to {numpy.iinfo(dtype).max}" if dtype.kind in "iu"
                 else "no integer token ids")
        raise ConfigError("<command line>", flag, f"{idx_path}'s tokens are {dtype.name}, "
                          f"which holds {holds}; the model's vocab_size is {vocab_size}",
                          "a dataset tokenized for this model's vocabulary (Megatron-LM's "
                          "preprocess_data.py writes uint16 below 65500 tokens, int32 above)")


def _files_of(path: Path) -> Path:
    """``path`` read as a prefix: PREFIX.bin for a path given as PREFIX.bin, say."""
    return Path(f"{path}{SUFFIXES[0]}")
