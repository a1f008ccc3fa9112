"""Megatron-LM's tokenizer flags, as far as they decide the vocabulary: checked against the model.

The data a job reads is already tokenized (an indexed dataset, data/indexed.py), so a tokenizer
is never run here; its flags say which vocabulary the data was written for. A user who carries
``--tokenizer-type GPT2BPETokenizer --vocab-file ... --merge-file ...`` over from a Megatron-LM
script gets them checked rather than ignored: megatron-core's own ``build_tokenizer`` (what
Megatron-LM calls, reading the same argument names) builds the tokenizer and its ``vocab_size``
must be the model file's ``vocab_size`` (NullTokenizer: ``--vocab-size`` N is N + 1 tokens, the
EOD added). ``--make-vocab-size-divisible-by`` D pads as Megatron-LM does, the vocabulary to a
multiple of D x TP; the runtime pads to 128 x TP (spec/model.py ``padded_vocab_size``, the lcm
of the plan's TP degrees), so a D that pads to another size would give embeddings of another
shape than every checkpoint of the model, and is refused.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from megatron_autohet.errors import ConfigError
from megatron_autohet.spec.model import VOCAB_PAD_UNIT, ModelSpec

# The tokenizer types of Megatron-LM core_v0.16.1's --tokenizer-type that build a GPT's
# tokenizer, and the file flag each reads.
TOKENIZER_FILES = {"GPT2BPETokenizer": ("vocab_file", "merge_file"),
                   "HuggingFaceTokenizer": ("tokenizer_model",),
                   "SentencePieceTokenizer": ("tokenizer_model",),
                   "GPTSentencePieceTokenizer": ("tokenizer_model",),
                   "Llama2Tokenizer": ("tokenizer_model",),
                   "TikTokenizer": ("tokenizer_model",),
                   "NullTokenizer": ()}
# What megatron-core's build_tokenizer reads besides these flags, at Megatron-LM's defaults.
_BUILD_DEFAULTS = dict(tokenizer_special_tokens=None, tokenizer_hf_use_fast=False,
                       trust_remote_code=False, tokenizer_hf_include_special_tokens=False,
                       tokenizer_sentencepiece_legacy=False, tiktoken_pattern=None,
                       tiktoken_num_special_tokens=1000, tokenizer_metadata=None)


@dataclass(frozen=True)
class TokenizerFlags:
    """Megatron-LM's tokenizer flags (None: not given)."""
    tokenizer_type: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    tokenizer_model: str | None = None
    vocab_size: int | None = None
    make_vocab_size_divisible_by: int | None = None


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def tokenizer_vocab_size(flags: TokenizerFlags) -> int | None:
    """The vocabulary the flags' tokenizer has (megatron-core's build_tokenizer), None when no
    tokenizer is named; a file flag without its type, a missing file or a tokenizer
    megatron-core cannot build here is a ConfigError naming the flag."""
    given = [field for field in ("vocab_file", "merge_file", "tokenizer_model", "vocab_size")
             if getattr(flags, field) is not None]
    if flags.tokenizer_type is None:
        if given:
            raise ConfigError("<command line>", _flag(given[0]), "given without "
                              "--tokenizer-type", "with the --tokenizer-type it belongs to")
        return None
    if flags.tokenizer_type not in TOKENIZER_FILES:
        raise ConfigError("<command line>", "--tokenizer-type", f"got {flags.tokenizer_type!r}",
                          ", ".join(TOKENIZER_FILES) + " (a GPT's tokenizer)")
    needed = (("vocab_size",) if flags.tokenizer_type == "NullTokenizer"
              else TOKENIZER_FILES[flags.tokenizer_type])
    for field in needed:
        value = getattr(flags, field)
        if value is None:
            raise ConfigError("<command line>", _flag(field), "missing with --tokenizer-type "
                              f"{flags.tokenizer_type}", "the file the tokenizer reads"
                              if field != "vocab_size" else "the vocabulary before the EOD")
        if field != "vocab_size" and not Path(value).exists():
            raise ConfigError("<command line>", _flag(field), f"{value} not found",
                              f"the {flags.tokenizer_type} file the data was tokenized with")
    # megatron-core: the launcher checks before any rank starts, and imports torch next anyway
    from megatron.core.tokenizers.text.utils.build_tokenizer import build_tokenizer

    try:
        return int(build_tokenizer(argparse.Namespace(**_BUILD_DEFAULTS, **asdict(flags)))
                   .vocab_size)
    except Exception as err:  # noqa: BLE001 - each library raises its own; reported in one line
        raise ConfigError("<command line>", "--tokenizer-type",
                          f"megatron-core cannot build {flags.tokenizer_type} here: "
                          f"{str(err).splitlines()[0] if str(err) else type(err).__name__}",
                          "a tokenizer whose library is installed (GPT2BPETokenizer and "
                          "HuggingFaceTokenizer: transformers; the SentencePiece ones: "
                          "sentencepiece; TikTokenizer: tiktoken), or no tokenizer flags "
                          "(the model file's vocab_size decides)") from None


def megatron_padded_vocab(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron-LM's padding: ``vocab_size`` up to a multiple of ``divisible_by`` x ``tp``."""
    unit = divisible_by * tp
    return -(-vocab_size // unit) * unit


def check_vocabulary(flags: TokenizerFlags, model: ModelSpec, model_file: str,
                     tp_degrees: set[int]) -> None:
    """The tokenizer flags agree with ``model``'s vocabulary and the runtime's padding of it on
    a plan of ``tp_degrees`` (module docstring); else one ConfigError naming the flag."""
    vocab = tokenizer_vocab_size(flags)
    if vocab is not None and vocab != model.vocab_size:
        null = flags.tokenizer_type == "NullTokenizer"
        flag = "--vocab-size" if null else "--tokenizer-type"
        raise ConfigError("<command line>", flag, f"{flags.tokenizer_type} has {vocab} tokens, "
                          f"{model_file} has vocab_size {model.vocab_size}",
                          f"--vocab-size {model.vocab_size - 1} (the EOD is added)" if null else
                          f"the tokenizer the data was written with, and a model file of its "
                          f"{vocab} tokens")
    divisible_by = flags.make_vocab_size_divisible_by
    if divisible_by is None:
        return
    if divisible_by < 1:
        raise ConfigError("<command line>", "--make-vocab-size-divisible-by",
                          f"got {divisible_by}", "a number >= 1")
    tp = math.lcm(*tp_degrees)
    runtime = model.padded_vocab_size(tp_degrees)
    padded = megatron_padded_vocab(model.vocab_size, divisible_by, tp)
    if padded != runtime:
        raise ConfigError("<command line>", "--make-vocab-size-divisible-by",
                          f"{divisible_by} pads vocab_size {model.vocab_size} to {padded} at the "
                          f"plan's TP {tp}, the runtime pads it to {runtime} "
                          f"({VOCAB_PAD_UNIT} x TP)",
                          f"one that pads it to {runtime}, as {VOCAB_PAD_UNIT} (Megatron-LM's "
                          "default) does, or not set")
