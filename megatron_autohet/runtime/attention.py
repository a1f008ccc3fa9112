"""torch's scaled_dot_product_attention as megatron-core's core attention (no Transformer Engine).

Public API
----------
``SDPAttention``
    A ``core_attention`` submodule for megatron-core's ``SelfAttention`` (a ModuleSpec's
    ``core_attention=SDPAttention``): megatron's ``DotProductAttention`` with the same
    constructor, ``forward(query, key, value, attention_mask, attn_mask_type,
    attention_bias=None, packed_seq_params=None)`` (query/key/value [sq, b, heads, head dim] ->
    [sq, b, heads * head dim]) and the same (parameter-free, for megatron's vanilla softmax)
    state dict, whose scores, softmax, dropout and context are one
    ``torch.nn.functional.scaled_dot_product_attention`` call. torch picks the kernel (flash,
    memory-efficient or cuDNN on a GPU; its own flash kernel or the math path on a CPU): none of
    the fused ones keeps the [b, heads, s, s] score, probability and dropout-mask tensors that
    megatron's unfused path keeps for backward (on one H100, GPT-3 1.3B at seq 2048, micro-batch
    2: 2.19x faster and 18 GiB less than the unfused path).
``sdpa_unusable_reason(config, layer_number) -> str | None``
    Why a layer's configuration needs megatron's unfused path, or None.
``attention_kind(core_attention) -> str``
    What a built layer's core attention keeps for backward, as the cost model names it
    (profiling/profile.py ``ATTENTIONS``): "flash" for SDPA and Transformer Engine, "unfused"
    for megatron's DotProductAttention (or SDPA falling back to it for the whole layer).

Semantics (megatron-core 0.16.1 transformer/dot_product_attention.py)
-------------------------------------------------------------------
* Scale: megatron multiplies the scores by ``softmax_scale`` (the constructor's, else
  1/sqrt(kv_channels)) divided by ``layer_number`` under ``apply_query_key_layer_scaling``, and
  its softmax multiplies by ``layer_number`` again (an fp16 range trick): the softmax sees
  scores x ``softmax_scale``, which is the scale given to SDPA.
* Mask: megatron's unfused path builds the causal (upper-triangular) mask itself when the mask
  type is causal, no mask is given and sq > 1; SDPA's ``is_causal`` is the same mask when
  sq == sk (GPT training). Any other case (an explicit mask tensor, whose masked scores megatron
  fills with -10000 where SDPA uses -inf; sq != sk) runs megatron's own path.
* GQA: megatron repeats each key/value group over its heads; SDPA's ``enable_gqa`` computes the
  same without the copy (the flash kernels read the groups directly).
* Dropout: ``config.attention_dropout`` (or the constructor's) as SDPA's ``dropout_p`` in
  training, 0 in eval, drawn inside megatron's model-parallel RNG fork as megatron's dropout is
  (outside it with sequence parallelism, also as megatron does), so masks are seeded and resumed
  as runtime/stage_model.py describes. SDPA draws its mask differently from torch.nn.Dropout: a
  job with attention dropout is not bit-comparable with one on the unfused path (without
  dropout the two agree to rounding).
* Where SDPA cannot serve - megatron's off-by-one/learnable softmax, sliding-window layers, an
  explicit mask, sq != sk - the layer runs megatron's unfused ``DotProductAttention.forward``;
  each reason is logged once per process (``sdpa_unusable_reason`` names it).
"""

from __future__ import annotations

import logging
import math

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.utils import is_layer_window_attention

logger = logging.getLogger(__name__)

_reported: set[str] = set()      # reasons for the unfused path already logged in this process


def sdpa_unusable_reason(config, layer_number: int) -> str | None:
    if config.softmax_type != "vanilla":
        return f"softmax_type {config.softmax_type!r} (SDPA has no softmax offset)"
    if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
        return f"sliding-window attention (window_size {config.window_size})"
    return None


def _report_unfused(reason: str) -> None:
    if reason not in _reported:
        _reported.add(reason)
        logger.warning("attention runs megatron-core's unfused DotProductAttention (scores, "
                       "softmax and dropout mask kept per layer) where SDPA cannot serve: %s",
                       reason)


def attention_kind(core_attention) -> str:
    if isinstance(core_attention, SDPAttention):
        unfused = core_attention.unusable_reason is not None
    else:       # Transformer Engine's fused attention keeps softmax statistics only
        unfused = isinstance(core_attention, DotProductAttention)
    return "unfused" if unfused else "flash"


class SDPAttention(DotProductAttention):
    """megatron-core core attention computed by torch SDPA (module doc)."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: float | None = None,
                 softmax_scale: float | None = None, cp_comm_type: str | None = None,
                 pg_collection=None):
        super().__init__(config, layer_number, attn_mask_type, attention_type,
                         attention_dropout=attention_dropout, softmax_scale=softmax_scale,
                         cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        # What the softmax sees the scores multiplied by (module doc: the layer-scaling divisor
        # megatron puts into self.softmax_scale is multiplied back inside its softmax).
        self.sdpa_scale = (softmax_scale if softmax_scale is not None
                           else 1.0 / math.sqrt(self.hidden_size_per_attention_head))
        self.unusable_reason = sdpa_unusable_reason(config, self.layer_number)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        reason = self.unusable_reason or self._call_reason(query, key, attention_mask)
        if reason is not None:
            _report_unfused(reason)
            return super().forward(query, key, value, attention_mask, attn_mask_type,
                                   attention_bias=attention_bias,
                                   packed_seq_params=packed_seq_params)
        assert packed_seq_params is None, "packed sequences need Transformer Engine's attention"
        assert attention_bias is None, "megatron's core attention takes no attention bias"
        sq, b = query.shape[0], query.shape[1]
        # [s, b, heads, d] -> [b, heads, s, d] as views (SDPA copies an input whose layout a
        # kernel cannot take; the last dimension, the one every kernel needs dense, already is)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        dropout_p = self.attention_dropout.p if self.training else 0.0
        kwargs = dict(dropout_p=dropout_p, is_causal=self.attn_mask_type == AttnMaskType.causal,
                      scale=self.sdpa_scale,
                      enable_gqa=self.num_query_groups_per_partition
                      < self.num_attention_heads_per_partition)
        if dropout_p > 0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                context = torch.nn.functional.scaled_dot_product_attention(q, k, v, **kwargs)
        else:
            context = torch.nn.functional.scaled_dot_product_attention(q, k, v, **kwargs)
        # [b, heads, sq, d] -> [sq, b, heads * d]
        return context.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)

    def _call_reason(self, query, key, attention_mask) -> str | None:
        if attention_mask is not None:
            return "an explicit attention mask (megatron fills masked scores with -10000)"
        if self.attn_mask_type == AttnMaskType.causal and query.shape[0] != key.shape[0]:
            return "causal attention with query and key lengths that differ"
        if self.attn_mask_type not in (AttnMaskType.causal, AttnMaskType.no_mask):
            return f"attention mask type {self.attn_mask_type.name} without a mask tensor"
        return None
