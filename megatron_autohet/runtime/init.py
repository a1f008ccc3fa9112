"""Layout-independent parameter initialisation.

Public API
----------
``initial_value(layout, model_spec, seed) -> Tensor``
    The FULL initial tensor of a parameter (``layout``: its layout.params.ParamLayout): depends
    only on the seed, the global name and the full shape (plus the model's true vocabulary size),
    never on TP/PP layout.
``initialize_parameters(params_with_layouts, model_spec, seed)``
    Copies each parameter's shard of its full initial value into it (no autograd).

Design (why)
------------
Every layout must be trainable to the same result as the single-process reference, so every
layout must start from the *same* model. Megatron's own init draws from per-TP-rank RNG streams,
so TP2 and TP1 models differ. Here every parameter's full tensor is drawn from a CPU
``torch.Generator`` seeded with a stable hash (SHA-256) of ``(seed, global name, full shape)`` and
then sliced to the local shard (the shard layout is layout/params.py's), so any plan - any TP
degree, layer split or pipeline - holds slices of one and the same model, and a tied output layer
starts equal to the embedding. Values follow Megatron's defaults: weights N(0, 0.02), output
projections of each layer (``linear_proj``, ``linear_fc2``) N(0, 0.02 / sqrt(2 * num_layers)),
biases 0, norm weights 1.

Vocabulary rows: the embedding/output full shape uses the plan's padded vocabulary. Rows below the
true vocabulary size are drawn from the hash of the *true* shape and padding rows are 0, so the
initial values of real tokens do not depend on how much padding a plan needs.
"""
from __future__ import annotations

import hashlib
import math

import torch

from megatron_autohet.layout.params import ParamLayout
from megatron_autohet.spec.model import ModelSpec

INIT_METHOD_STD = 0.02
_OUTPUT_PROJECTIONS = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")
_VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")


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
