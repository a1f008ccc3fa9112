"""Where each local parameter sits in the full (TP1) model: its global name and TP-shard layout.

Public API
----------
``global_param_name(local_name, first_layer, tied) -> str``
    The global name of a stage's local parameter: megatron's GPTModel naming with GLOBAL layer
    indices (``decoder.layers.7.mlp.linear_fc1.weight``; a stage numbers its layers from 0 and
    holds global layers from ``first_layer`` on). A tied output layer is named
    ``embedding.word_embeddings.weight``: it is the same logical tensor as the embedding.
``layer_param_layouts(model, layer) -> list[ParamLayout]``, ``non_layer_param_layouts(model,
padded_vocab) -> dict[str, list[ParamLayout]]``
    The parameters megatron-core's GPTModel builds (local layer spec, as runtime/stage_model.py
    builds stages), as full-tensor (TP1) layouts computed from the model's dimensions alone:
    what a plan change has to move can be counted without building a model. Non-layer
    parameters are grouped by the holders that keep them (layout/topology.py kinds).
``ParamLayout(global_name, full_shape, partition_dim, tp_rank, tp_size, num_chunks=1)``
    Where a local parameter sits in the full tensor. ``partition_dim`` is None for TP-replicated
    parameters. ``num_chunks`` > 1 marks fused tensors whose full form is ``num_chunks`` stacked
    blocks each split over TP separately (the gate/up halves of a SwiGLU ``linear_fc1``).
    Methods: ``local_shape``, ``shard_ranges()`` (the index ranges of the partition dimension
    the shard covers), ``shard(full)`` (this rank's shard of a full tensor),
    ``write_shard(full, shard)`` (its inverse, in place), ``merge(shards)`` (the full tensor from
    every TP rank's shard, in TP-rank order) - initialisation, grad sync and checkpoints re-shard
    with these.

Torch-free at import (this package is shared with the cost model and checkpoints): the methods
use tensor methods, and torch itself is imported only where shards are concatenated.

Shard layout (verified against megatron-core 0.16.1 in tests/runtime/test_stage_model.py):
* ColumnParallelLinear (``linear_qkv``, ``linear_fc1``, ``output_layer``): dim 0; RowParallelLinear
  (``linear_proj``, ``linear_fc2``): dim 1, bias replicated; VocabParallelEmbedding: dim 0.
* ``linear_qkv``: megatron stores the fused QKV rows group-major (for each query group: its query
  heads, then its key head, then its value head), and TP rank k holds query groups
  [k*g/t, (k+1)*g/t): a contiguous dim-0 slice of the full tensor, so no special case.
* SwiGLU ``linear_fc1`` (``gated_linear_unit``): each rank holds [its gate rows; its up rows], i.e.
  ``num_chunks = 2``.
* Vocabulary rows: the embedding/output full shape uses the padded vocabulary
  (``stage_model.plan_padded_vocab_size``, one size for the whole plan), so every stage holding
  the tied embedding or the output layer shards the same full tensor.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatron_autohet.spec.model import ModelSpec

if TYPE_CHECKING:
    import torch

_LAYER_NAME = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")


def global_param_name(local_name: str, first_layer: int, tied: bool) -> str:
    match = _LAYER_NAME.match(local_name)
    if match:
        return f"decoder.layers.{first_layer + int(match.group(1))}.{match.group(2)}"
    if tied and local_name == "output_layer.weight":
        return "embedding.word_embeddings.weight"        # one logical tensor (tied)
    return local_name


def stage_global_name(local_name: str, chunks: tuple[tuple[int, int], ...], tied: bool) -> str:
    """The global name of an entry (a parameter, a sharded state dict key) of a stage model whose
    model chunks hold the layer ranges ``chunks``: a stage of several chunks (an interleaved
    pipeline's) names an entry by its chunk's index and its name in the chunk
    (``1.decoder.layers.0.mlp.linear_fc1.weight``; runtime/stage_model.py ``ModelChunks``)."""
    if len(chunks) == 1:
        return global_param_name(local_name, chunks[0][0], tied)
    index, name = local_name.split(".", 1)
    return global_param_name(name, chunks[int(index)][0], tied)


def _cat(tensors: list[torch.Tensor], dim: int) -> torch.Tensor:
    import torch        # torch only when shards are merged: the cost model imports layout/

    return torch.cat(tensors, dim=dim)


@dataclass(frozen=True)
class ParamLayout:
    global_name: str
    full_shape: tuple[int, ...]
    partition_dim: int | None          # None: TP-replicated
    tp_rank: int
    tp_size: int
    num_chunks: int = 1                # fused blocks split over TP separately (SwiGLU fc1)

    @property
    def local_shape(self) -> tuple[int, ...]:
        if self.partition_dim is None:
            return self.full_shape
        shape = list(self.full_shape)
        shape[self.partition_dim] //= self.tp_size
        return tuple(shape)

    def shard_ranges(self) -> list[tuple[int, int]]:
        """The [start, end) index ranges along ``partition_dim`` of the full tensor that this
        rank's shard covers, one per fused block (what :meth:`shard` takes)."""
        if self.partition_dim is None:
            raise ValueError(f"{self.global_name} is TP-replicated: it has no shard ranges")
        block = self.full_shape[self.partition_dim] // self.num_chunks
        step = block // self.tp_size
        return [(c * block + self.tp_rank * step, c * block + (self.tp_rank + 1) * step)
                for c in range(self.num_chunks)]

    def _pieces(self, full: torch.Tensor, tp_rank: int) -> list[torch.Tensor]:
        chunks = full.chunk(self.num_chunks, dim=self.partition_dim)
        return [c.chunk(self.tp_size, dim=self.partition_dim)[tp_rank] for c in chunks]

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's TP shard of a full tensor (a view when ``num_chunks == 1``)."""
        if tuple(full.shape) != tuple(self.full_shape):
            raise ValueError(f"{self.global_name}: full tensor has shape {tuple(full.shape)}, "
                             f"expected {self.full_shape}")
        if self.partition_dim is None:
            return full
        pieces = self._pieces(full, self.tp_rank)
        return pieces[0] if len(pieces) == 1 else _cat(pieces, dim=self.partition_dim)

    def write_shard(self, full: torch.Tensor, shard: torch.Tensor) -> None:
        """Copy this rank's shard into its place in ``full`` (the inverse of :meth:`shard`)."""
        if self.partition_dim is None:
            full.copy_(shard)
            return
        for piece, part in zip(self._pieces(full, self.tp_rank),
                               shard.chunk(self.num_chunks, dim=self.partition_dim)):
            piece.copy_(part)

    def merge(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor from the shards of TP ranks 0..tp_size-1 (inverse of :meth:`shard`)."""
        if self.partition_dim is None:
            return shards[0]
        if len(shards) != self.tp_size:
            raise ValueError(f"{self.global_name}: {len(shards)} shards for TP {self.tp_size}")
        dim = self.partition_dim
        per_rank = [s.chunk(self.num_chunks, dim=dim) for s in shards]
        return _cat([_cat([per_rank[r][c] for r in range(self.tp_size)], dim=dim)
                     for c in range(self.num_chunks)], dim=dim)


def layer_param_layouts(model: ModelSpec, layer: int) -> list[ParamLayout]:
    """Full-tensor layouts of global layer ``layer``'s parameters: column-parallel QKV and fc1
    (dim 0; fc1 two fused blocks when gated), row-parallel proj and fc2 (dim 1, bias
    replicated), two norms (replicated); biases only when ``model.linear_biases``."""
    h, f = model.hidden_size, model.ffn_hidden_size
    qkv = h + 2 * h * model.num_query_groups // model.num_attention_heads
    chunks = 2 if model.gated_linear_unit else 1
    prefix = f"decoder.layers.{layer}."
    shapes = [("input_layernorm.weight", (h,), None, 1),
              ("self_attention.linear_qkv.weight", (qkv, h), 0, 1),
              ("self_attention.linear_proj.weight", (h, h), 1, 1),
              ("pre_mlp_layernorm.weight", (h,), None, 1),
              ("mlp.linear_fc1.weight", (chunks * f, h), 0, chunks),
              ("mlp.linear_fc2.weight", (h, f), 1, 1)]
    if model.normalization == "LayerNorm":
        shapes += [("input_layernorm.bias", (h,), None, 1),
                   ("pre_mlp_layernorm.bias", (h,), None, 1)]
    if model.linear_biases:
        shapes += [("self_attention.linear_qkv.bias", (qkv,), 0, 1),
                   ("self_attention.linear_proj.bias", (h,), None, 1),
                   ("mlp.linear_fc1.bias", (chunks * f,), 0, chunks),
                   ("mlp.linear_fc2.bias", (h,), None, 1)]
    return [ParamLayout(prefix + name, shape, dim, 0, 1, n) for name, shape, dim, n in shapes]


def non_layer_param_layouts(model: ModelSpec, padded_vocab: int) -> dict[str, list[ParamLayout]]:
    """Full-tensor layouts of the parameters outside the layers, by holder kind (topology's
    sync group kinds): the vocab-parallel word embedding (which is also the tied output layer),
    the learned position table (replicated; GPTModel sizes it by the model's seq_length), and
    the last stages' final norm and untied output layer."""
    h = model.hidden_size
    out = {"word_embeddings": [ParamLayout("embedding.word_embeddings.weight",
                                           (padded_vocab, h), 0, 0, 1)],
           "post_process": [ParamLayout("decoder.final_layernorm.weight", (h,), None, 0, 1)]}
    if model.normalization == "LayerNorm":
        out["post_process"].append(ParamLayout("decoder.final_layernorm.bias", (h,), None, 0, 1))
    if not model.tie_embeddings:
        out["post_process"].append(ParamLayout("output_layer.weight", (padded_vocab, h), 0, 0, 1))
    if model.position_embedding_type == "learned_absolute":
        out["position_embeddings"] = [ParamLayout("embedding.position_embeddings.weight",
                                                  (model.seq_length, h), None, 0, 1)]
    return out
