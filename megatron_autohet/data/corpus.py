"""The embedded default corpus: docstrings of the Python standard library as a megatron dataset.

Training must run with no network and no user data (the quick start, CI), on real text so the
loss means something. Every machine that runs this package has the Python standard library, and
its docstrings are English prose with code mixed in: a few MiB of it is a fair small corpus.

Pipeline: walk the stdlib's ``.py`` files in sorted path order, take module/class/function
docstrings with ``ast`` (nothing is imported or executed), one document per docstring, tokenize
with megatron-core's own byte-level tokenizer (UTF-8 bytes; EOD = 0, pad = 1, vocab 512 fits the
tiny model), append EOD to each document, and write a megatron-core indexed dataset with
``IndexedDatasetBuilder`` - the same ``.bin``/``.idx`` format Megatron-LM's
``tools/preprocess_data.py`` writes, so ``--data-path`` can point at either.

The result is deterministic for a given Python version and size budget and is cached under the
data directory, keyed by a digest of those inputs. Files are written under temporary names and
renamed, so concurrent builders (several ranks, several test processes) never see a partial file.
"""

from __future__ import annotations

import ast
import hashlib
import os
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy

from megatron_autohet.errors import ConfigError

CORPUS_FORMAT = 1                     # bump when the extraction below changes
DEFAULT_CORPUS_BYTES = 2 * 1024 * 1024
MIN_DOCUMENT_CHARS = 40               # one-liners like "Return self." teach nothing
# Byte-level vocabulary: 256 byte values; megatron's ByteLevelTokenizer reserves ids 0 (EOD) and 1
# (pad), which never occur in docstring text.
BYTE_VOCAB = 256
_SKIPPED_DIRS = {"test", "tests", "idlelib", "turtledemo", "site-packages", "dist-packages",
                 "lib2to3", "ensurepip", "__pycache__"}


def default_data_dir() -> Path:
    """``$AUTOHET_DATA_DIR``, else ``$XDG_CACHE_HOME/megatron-autohet``, else ``~/.cache/...``."""
    if os.environ.get("AUTOHET_DATA_DIR"):
        return Path(os.environ["AUTOHET_DATA_DIR"])
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "megatron-autohet"


def byte_tokenizer(vocab_size: int, file: str | Path | None = None):
    """megatron-core's byte-level GPT tokenizer for a model with ``vocab_size`` embeddings."""
    if vocab_size < BYTE_VOCAB:
        raise ConfigError(file, "vocab_size", f"{vocab_size} is too small for the byte-level "
                          "tokenizer of the built-in corpus", f">= {BYTE_VOCAB}")
    # megatron-core: not at `autohet` start-up
    from megatron.core.tokenizers import MegatronTokenizer

    return MegatronTokenizer.from_pretrained(
        metadata_path={"library": "byte-level", "model_type": "gpt"}, vocab_size=vocab_size)


def stdlib_documents(stdlib_dir: Path | None = None) -> Iterator[str]:
    """Docstrings of the standard library, in a fixed order (sorted file paths, source order)."""
    root = Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py")
                   if not _SKIPPED_DIRS.intersection(p.relative_to(root).parts[:-1]))
    for path in files:
        try:
            tree = ast.parse(path.read_bytes(), filename=str(path))
        except (SyntaxError, ValueError, OSError):
            continue                      # a few stdlib files are deliberately unparsable
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=True)
                if doc and len(doc) >= MIN_DOCUMENT_CHARS:
                    yield doc


def corpus_prefix(data_dir: Path, max_bytes: int) -> Path:
    """Path prefix (without .bin/.idx) of the cached corpus for this Python and size budget."""
    key = f"{CORPUS_FORMAT}|{sys.version}|{sysconfig.get_paths()['stdlib']}|{max_bytes}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return Path(data_dir) / f"stdlib-docstrings-{digest}" / "text_document"


def build_corpus(data_dir: str | Path | None = None,
                 max_bytes: int = DEFAULT_CORPUS_BYTES) -> Path:
    """Build (or reuse) the default corpus; return its indexed-dataset path prefix."""
    prefix = corpus_prefix(Path(data_dir) if data_dir else default_data_dir(), max_bytes)
    bin_path, idx_path = prefix.with_suffix(".bin"), prefix.with_suffix(".idx")
    if bin_path.is_file() and idx_path.is_file():
        return prefix
    prefix.parent.mkdir(parents=True, exist_ok=True)

    # megatron-core: not at `autohet` start-up
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    tokenizer = byte_tokenizer(512)       # ids are bytes: independent of the model's vocab
    tmp = prefix.with_name(f"{prefix.name}.tmp{os.getpid()}")
    builder = IndexedDatasetBuilder(str(tmp.with_suffix(".bin")), dtype=numpy.uint16)
    written = 0
    for doc in stdlib_documents():
        ids = tokenizer.tokenize(doc) + [tokenizer.eod]
        builder.add_document(numpy.asarray(ids, dtype=numpy.uint16), [len(ids)])
        written += len(ids)
        if written >= max_bytes:
            break
    builder.finalize(str(tmp.with_suffix(".idx")))
    # .bin first: a reader checks for .idx, so it never finds an index without its data.
    tmp.with_suffix(".bin").replace(bin_path)
    tmp.with_suffix(".idx").replace(idx_path)
    return prefix
