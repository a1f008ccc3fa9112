"""Layout-independent parameter initialisation and the TP-shard layout of every parameter.

Public API
----------
``ParamLayout(global_name, full_shape, partition_dim, tp_rank, tp_size, num_chunks=1)``
    Where a local parameter sits in the full (TP1) model tensor. ``global_name`` uses megatron's
    GPTModel naming with GLOBAL layer indices (``decoder.layers.7.mlp.linear_fc1.weight``); a tied
    output layer is named ``embedding.word_embeddings.weight`` (it is the same logical tensor).
    ``partition_dim`` is None for TP-replicated parameters. ``num_chunks`` > 1 marks fused
    tensors whose full form is ``num_chunks`` stacked blocks each split over TP separately (the
    gate/up halves of a SwiGLU ``linear_fc1``). Methods: ``local_shape``, ``shard(full)`` (this
    rank's shard of a full tensor), ``write_shard(full, shard)`` (its inverse, in place),
    ``merge(shards)`` (the full tensor from every TP rank's shard, in TP-rank order) - grad sync
    and checkpoints re-shard with these.
``initial_value(layout, model_spec, seed) -> Tensor``
    The FULL initial tensor of a parameter: depends only on the seed, the global name and the
    full shape (plus the model's true vocabulary size), never on TP/PP layout.
``initialize_parameters(params_with_layouts, model_spec, seed)``
    Copies each parameter's shard of its full initial value into it (no autograd).

Design (why)
------------
The equivalence proof (DESIGN.md section 3) needs every layout to start from the *same* model.
Megatron's own init draws from per-TP-rank RNG streams, so TP2 and TP1 models differ. Here every
parameter's full tensor is drawn from a CPU ``torch.Generator`` seeded with a stable hash
(SHA-256) of ``(seed, global name, full shape)`` and then sliced to the local shard, so any plan -
any TP degree, layer split or pipeline - holds slices of one and the same model, and a tied output
layer starts equal to the embedding. Values follow Megatron's defaults: weights N(0, 0.02), output
projections of each layer (``linear_proj``, ``linear_fc2``) N(0, 0.02 / sqrt(2 * num_layers)),
biases 0, norm weights 1.

Shard layout (verified against megatron-core 0.16.1 in tests/test_stage_model.py):
* ColumnParallelLinear (``linear_qkv``, ``linear_fc1``, ``output_layer``): dim 0; RowParallelLinear
  (``linear_proj``, ``linear_fc2``): dim 1, bias replicated; VocabParallelEmbedding: dim 0.
* ``linear_qkv``: megatron stores the fused QKV rows group-major (for each query group: its query
  heads, then its key head, then its value head), and TP rank k holds query groups
  [k*g/t, (k+1)*g/t): a contiguous dim-0 slice of the full tensor, so no special case.
* SwiGLU ``linear_fc1`` (``gated_linear_unit``): each rank holds [its gate rows; its up rows], i.e.
  ``num_chunks = 2``.
* Vocabulary rows: the embedding/output full shape uses the padded vocabulary
  (``stage_model.plan_padded_vocab_size``, one size for the whole plan). Rows below the true
  vocabulary size are drawn from the hash of the *true* shape and padding rows are 0, so the
  initial values of real tokens do not depend on how much padding a plan needs.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from megatron_autohet.spec.model import ModelSpec

INIT_METHOD_STD = 0.02
_OUTPUT_PROJECTIONS = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")
_VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")


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
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=self.partition_dim)

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
        return torch.cat([torch.cat([per_rank[r][c] for r in range(self.tp_size)], dim=dim)
                          for c in range(self.num_chunks)], dim=dim)


def _generator(seed: int, name: str, shape: tuple[int, ...]) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}|{name}|{tuple(shape)}".encode()).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def initial_value(layout: ParamLayout, model_spec: ModelSpec, seed: int) -> torch.Tensor:
    """The full fp32 initial tensor of one parameter (see the module docstring)."""
    name, shape = layout.global_name, tuple(layout.full_shape)
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "bias":
        return torch.zeros(shape)
    # input_/pre_mlp_/final_/q_/k_layernorm, and TE's fused linear_qkv/fc1 .layer_norm_weight
    if "layernorm" in name or "layer_norm" in name:
        return torch.ones(shape)
    std = INIT_METHOD_STD
    if name.endswith(_OUTPUT_PROJECTIONS):
        std = INIT_METHOD_STD / math.sqrt(2.0 * model_spec.num_layers)
    if name in _VOCAB_PARAMS:
        true_shape = (model_spec.vocab_size, *shape[1:])
        full = torch.zeros(shape)
        full[:model_spec.vocab_size] = torch.normal(
            0.0, std, true_shape, generator=_generator(seed, name, true_shape))
        return full
    return torch.normal(0.0, std, shape, generator=_generator(seed, name, shape))


@torch.no_grad()
def initialize_parameters(params_with_layouts, model_spec: ModelSpec, seed: int) -> None:
    """``params_with_layouts``: iterable of (parameter, ParamLayout). Fills each in place."""
    for param, layout in params_with_layouts:
        value = layout.shard(initial_value(layout, model_spec, seed))
        if tuple(value.shape) != tuple(param.shape):
            raise ValueError(f"{layout.global_name}: shard shape {tuple(value.shape)} != local "
                             f"parameter shape {tuple(param.shape)}")
        param.copy_(value.to(device=param.device, dtype=param.dtype))
