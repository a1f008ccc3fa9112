"""A GPT model's dimensions (``configs/models/*.yaml``).

YAML form::

    name: gpt3-1.3b
    num_layers: 24
    hidden_size: 2048
    num_attention_heads: 16
    ffn_hidden_size: 8192          # default 4 * hidden_size
    vocab_size: 50257              # padded as Megatron does: ModelSpec.padded_vocab_size
    seq_length: 2048
    num_query_groups: 16           # optional (GQA); default num_attention_heads
    gated_linear_unit: false       # SwiGLU MLP (LLaMA): three FFN matrices instead of two;
                                   # such models also get RMSNorm and no linear biases
    position_embedding_type: learned_absolute   # or rope
    tie_embeddings: true           # share input embedding and output layer weights
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from megatron_autohet.errors import ConfigError
from megatron_autohet.spec._yaml import check_keys, get_field, read_yaml_mapping

POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope")
# Megatron pads the vocabulary to a multiple of this times the TP degree
# (--make-vocab-size-divisible-by 128).
VOCAB_PAD_UNIT = 128


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    vocab_size: int
    seq_length: int
    num_query_groups: int
    gated_linear_unit: bool = False
    position_embedding_type: str = "learned_absolute"
    tie_embeddings: bool = True

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def normalization(self) -> str:
        """The norm megatron-core builds: RMSNorm for SwiGLU (LLaMA) models, else LayerNorm."""
        return "RMSNorm" if self.gated_linear_unit else "LayerNorm"

    @property
    def linear_biases(self) -> bool:
        """Whether the layers' linears have biases: GPT's do, the LLaMA family's do not."""
        return not self.gated_linear_unit

    def padded_vocab_size(self, tp_degrees: Iterable[int]) -> int:
        """The vocabulary rounded up to a multiple of ``128 * lcm(tp_degrees)``.

        For one TP degree this is Megatron's padding. A plan mixing TP degrees needs one size
        that every stage holding the (tied) embedding or the output layer splits evenly: padding
        rows enter the softmax, so all copies must agree on the full shape.
        """
        unit = VOCAB_PAD_UNIT * math.lcm(*tp_degrees)
        return -(-self.vocab_size // unit) * unit

    def check_seq_length(self, seq_length: int, file, field: str) -> None:
        """Raise ConfigError (``file``, ``field``) when sequences of ``seq_length`` tokens do not
        fit the model: GPTModel sizes a learned position table by the model's seq_length, and a
        longer sequence would index past it in the first forward pass."""
        if self.position_embedding_type == "learned_absolute" and seq_length > self.seq_length:
            raise ConfigError(file, field, f"{seq_length} > the model's seq_length "
                              f"{self.seq_length} (learned position embeddings)",
                              f"at most {self.seq_length}, or a model with rope positions")

    def check_tp_degree(self, tp: int, file, field: str) -> None:
        """Raise ConfigError (``file``, ``field``) unless TP degree ``tp`` splits the attention
        heads, the query groups and the FFN evenly, as megatron-core's TP layers require."""
        if tp < 1:
            raise ConfigError(file, field, f"TP degree {tp}",
                              f"a TP degree in {self.valid_tp_degrees(64)}")
        for what, value in (("num_attention_heads", self.num_attention_heads),
                            ("num_query_groups", self.num_query_groups),
                            ("ffn_hidden_size", self.ffn_hidden_size)):
            if value % tp:
                raise ConfigError(file, field, f"TP degree {tp} does not divide the model's "
                                  f"{what} ({value})",
                                  f"a TP degree in {self.valid_tp_degrees(64)}")

    def valid_tp_degrees(self, max_tp: int = 8) -> list[int]:
        """TP degrees (powers of two up to max_tp) that divide heads, query groups and FFN."""
        out, tp = [], 1
        while tp <= max_tp:
            if (self.num_attention_heads % tp == 0 and self.num_query_groups % tp == 0
                    and self.ffn_hidden_size % tp == 0):
                out.append(tp)
            tp *= 2
        return out


_FIELDS = {"name", "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
           "vocab_size", "seq_length", "num_query_groups", "gated_linear_unit",
           "position_embedding_type", "tie_embeddings", "description"}


def load_model(path: str | Path) -> ModelSpec:
    path = Path(path)
    return model_from_dict(read_yaml_mapping(path), path)


def model_from_dict(data: dict, file="<model>") -> ModelSpec:
    check_keys(data, _FIELDS, file, "")
    hidden = get_field(data, "hidden_size", int, file, positive=True)
    heads = get_field(data, "num_attention_heads", int, file, positive=True)
    if hidden % heads:
        raise ConfigError(file, "num_attention_heads", f"{heads} does not divide hidden_size "
                          f"{hidden}", "a divisor of hidden_size")
    groups = get_field(data, "num_query_groups", int, file, default=heads, positive=True)
    if heads % groups:
        raise ConfigError(file, "num_query_groups", f"{groups} does not divide "
                          f"num_attention_heads {heads}", "a divisor of num_attention_heads")
    pos = get_field(data, "position_embedding_type", str, file, default="learned_absolute")
    if pos not in POSITION_EMBEDDING_TYPES:
        raise ConfigError(file, "position_embedding_type", f"got {pos!r}",
                          ", ".join(POSITION_EMBEDDING_TYPES))
    return ModelSpec(
        name=get_field(data, "name", str, file),
        num_layers=get_field(data, "num_layers", int, file, positive=True),
        hidden_size=hidden,
        num_attention_heads=heads,
        ffn_hidden_size=get_field(data, "ffn_hidden_size", int, file, default=4 * hidden,
                                  positive=True),
        vocab_size=get_field(data, "vocab_size", int, file, positive=True),
        seq_length=get_field(data, "seq_length", int, file, positive=True),
        num_query_groups=groups,
        gated_linear_unit=get_field(data, "gated_linear_unit", bool, file, default=False),
        position_embedding_type=pos,
        tie_embeddings=get_field(data, "tie_embeddings", bool, file, default=True),
    )
