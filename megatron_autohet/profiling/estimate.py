"""Analytic profile estimates: what a layer costs on a GPU type we cannot measure here.

For every (GPU type, TP degree) the estimate counts the FLOPs and the memory traffic of one
micro-batch through a transformer layer, the embedding and the output layer, and turns them into
time with the GPU catalog's datasheet rates scaled by efficiency factors::

    time = max(flops / (peak_flops * MATMUL_EFFICIENCY), bytes / (mem_bw * MEMORY_EFFICIENCY))
           / achieved_efficiency + TP all-reduce time

``achieved_efficiency`` is the GPU type's entry in the catalog (configs/gpus.yaml, default 1):
how much of this analytic speed a training step reached when measured on the type. The two
efficiencies above are generic; a real kernel mix misses them by a type-specific amount (on an
H100, GPT-3 1.3B with SDPA flash attention trained at 0.705 s per iteration where the
estimate said 0.562 s). :func:`achieved_efficiency` derives it from a measured profile, and
``autohet profile --update-catalog`` writes it into a catalog.

Symbols: b micro-batch size, s sequence length, h hidden size, a attention heads, g query groups
(GQA; g = a without it), f FFN hidden size, V vocabulary (padded as Megatron pads it), t TP degree.

* FLOPs of one layer's forward (a matmul of m x k by k x n is 2mkn FLOPs)::

      QKV projection     2 b s h (h + 2 h g / a)
      scores, context    2 * 2 b s^2 h                 (QK^T and attention x V)
      output projection  2 b s h^2
      MLP                2 b s h f * (3 if gated linear unit else 2)

  all divided by t (Megatron TP splits every matmul). Backward = 2 x forward (gradients of the
  input and of the weights are one matmul each).
* Megatron TP (no sequence parallelism) all-reduces the layer's activations (b s h, 2 bytes)
  twice in forward (after attention and after the MLP) and twice in backward; a ring all-reduce
  moves 2 (t - 1) / t of the bytes over the intra-node link.
* Activation memory per layer and micro-batch follows Korthikanti et al. ("Reducing Activation
  Recomputation in Large Transformer Models", 2022), whose GPT layer keeps
  ``s b h (10 + 24 / t + 5 a s / (h t))`` bytes with TP and no sequence parallelism. We derive the
  same terms for general f, GQA and gated MLPs (see :func:`layer_activation_bytes`); with fused
  attention (``attention="flash"``: the runtime's torch SDPA or Transformer Engine, see
  profiling/profile.py ``ATTENTIONS``) the ``a s^2`` score terms are replaced by the softmax
  statistics (fp32 per row); ``"unfused"`` (megatron's DotProductAttention) keeps them.
  Under full activation recompute only the layer input (2 s b h bytes) stays alive.
* Parameters are counted per TP shard, as megatron-core builds the layer: weight matrices are
  divided by t, biases of row-parallel layers and norms are replicated. GPT layers have linear
  biases and LayerNorm (weight and bias); LLaMA-family (SwiGLU) layers have neither biases nor a
  norm bias (RMSNorm), see ``ModelSpec.normalization`` / ``ModelSpec.linear_biases``.

Every OpCost made here has ``source="estimated"``; measured profiles replace these entries via
:meth:`Profile.merged_over`.
"""

from __future__ import annotations

import math
from dataclasses import replace

from megatron_autohet.profiling.profile import (DEFAULT_ATTENTION, PARTS, OpCost, Profile,
                                                ProfileEntry, check_attention)
from megatron_autohet.spec.cluster import Cluster
from megatron_autohet.spec.gpus import GPUType
from megatron_autohet.spec.model import ModelSpec
from megatron_autohet.spec.precision import PLANNING_PRECISION

# Fraction of the datasheet tensor-core peak a transformer layer's matmuls reach in Megatron.
# Well-tuned Megatron runs report 40-55% model FLOPs utilisation on A100/H100; the layer alone
# (no pipeline bubble, no communication) sits near the top of that range.
MATMUL_EFFICIENCY = 0.55
# Fraction of the datasheet memory bandwidth element-wise kernels (norms, softmax, GeLU, dropout,
# embedding gathers, the cross-entropy) sustain; STREAM-like kernels reach 80-90%.
MEMORY_EFFICIENCY = 0.8
# Fraction of the link bandwidth NCCL ring all-reduces sustain for the message sizes a layer
# produces (a few MB to a few hundred MB).
LINK_EFFICIENCY = 0.8
# Bytes of one activation element in the precision plans are priced for (bf16).
ACTIVATION_DTYPE_BYTES = PLANNING_PRECISION.element_bytes


def ring_allreduce_s(num_bytes: float, ranks: int, bandwidth_gbs: float) -> float:
    """Time of a ring all-reduce of ``num_bytes`` among ``ranks`` GPUs over a link of this speed."""
    if ranks <= 1:
        return 0.0
    return 2.0 * (ranks - 1) / ranks * num_bytes / (bandwidth_gbs * 1e9 * LINK_EFFICIENCY)


def layer_forward_flops(model: ModelSpec, tp: int, micro_batch_size: int, seq_length: int) -> float:
    b, s, h, f = micro_batch_size, seq_length, model.hidden_size, model.ffn_hidden_size
    kv = 2 * h * model.num_query_groups / model.num_attention_heads
    qkv = 2 * b * s * h * (h + kv)
    attention = 2 * 2 * b * s * s * h
    projection = 2 * b * s * h * h
    mlp = 2 * b * s * h * f * (3 if model.gated_linear_unit else 2)
    return (qkv + attention + projection + mlp) / tp


def norm_param_count(model: ModelSpec) -> int:
    """Parameters of one norm over the hidden size: LayerNorm has a weight and a bias, RMSNorm
    only a weight."""
    return model.hidden_size * (2 if model.normalization == "LayerNorm" else 1)


def layer_param_count(model: ModelSpec, tp: int) -> int:
    """Parameters of one layer held by one GPU of a TP group of degree ``tp``, as megatron-core
    builds the layer (runtime/stage_model.py: biases only when ``model.linear_biases``)."""
    h, f = model.hidden_size, model.ffn_hidden_size
    kv = 2 * h * model.num_query_groups // model.num_attention_heads
    fc1_out = f * (2 if model.gated_linear_unit else 1)
    split = h * (h + kv) + h * h + h * fc1_out + f * h      # QKV, proj, fc1, fc2 weights
    replicated = 2 * norm_param_count(model)                # input and pre-MLP norms
    if model.linear_biases:
        split += (h + kv) + fc1_out                         # column-parallel biases (QKV, fc1)
        replicated += 2 * h                                 # row-parallel biases (proj, fc2)
    return split // tp + replicated


def layer_activation_bytes(model: ModelSpec, tp: int, micro_batch_size: int, seq_length: int,
                           attention: str) -> float:
    """Bytes one layer keeps from forward to backward for one micro-batch (bf16, dropout masks 1B).

    Korthikanti et al.'s terms, generalised (sbh = s*b*h):

    * not split by TP (each GPU holds the full tensor): two norm inputs (4 sbh), the QKV input
      (2 sbh), the MLP input (2 sbh), two dropout masks after the row-parallel layers (2 sbh);
    * split by TP: Q (2 sbh), K and V (2 * 2 sbh g/a), the projection input (2 sbh), the MLP's
      activation-function input and output (2 * 2 s b f, three f-wide tensors when gated);
    * attention scores (split by TP): softmax output (2 a s^2 b), dropout mask (a s^2 b), dropout
      output (2 a s^2 b) with ``attention="unfused"``; with ``"flash"`` only the fp32
      log-sum-exp statistics (4 a s b).

    With f = 4h, g = a and unfused attention this is s b h (10 + 24/t + 5 a s / (h t)), the
    paper's formula.
    """
    check_attention(attention)
    b, s, h, f, a = micro_batch_size, seq_length, model.hidden_size, model.ffn_hidden_size, \
        model.num_attention_heads
    sbh = s * b * h
    kv_ratio = model.num_query_groups / a
    replicated = 10 * sbh
    split = (2 + 4 * kv_ratio + 2) * sbh + (6 if model.gated_linear_unit else 4) * s * b * f
    scores = 4 * a * s * b if attention == "flash" else 5 * a * s * s * b
    return replicated + (split + scores) / tp


def _timed(flops: float, traffic_bytes: float, gpu: GPUType) -> float:
    compute = flops / (gpu.dense_tflops * 1e12 * MATMUL_EFFICIENCY)
    memory = traffic_bytes / (gpu.memory_bandwidth_gbs * 1e9 * MEMORY_EFFICIENCY)
    return max(compute, memory) / gpu.achieved_efficiency


def estimate_entry(model: ModelSpec, gpu: GPUType, tp: int, micro_batch_size: int,
                   seq_length: int, intra_node_bandwidth_gbs: float,
                   attention: str = DEFAULT_ATTENTION) -> ProfileEntry:
    """Estimated costs of one micro-batch on one GPU of a TP group of ``tp`` GPUs of type ``gpu``
    whose layers run ``attention`` (profile.py ``ATTENTIONS``)."""
    b, s, h = micro_batch_size, seq_length, model.hidden_size
    act_elem_bytes = ACTIVATION_DTYPE_BYTES
    hidden_bytes = b * s * h * act_elem_bytes              # one [s, b, h] activation tensor
    tp_allreduce = ring_allreduce_s(hidden_bytes, tp, intra_node_bandwidth_gbs)

    # Transformer layer. Memory traffic: read the weight shard once per pass, write and read back
    # every stored activation (forward writes them, backward reads them and writes gradients).
    params = layer_param_count(model, tp)
    activations = layer_activation_bytes(model, tp, b, s, attention)
    flops = layer_forward_flops(model, tp, b, s)
    fwd_traffic = params * act_elem_bytes + 2 * activations
    layer = OpCost(
        forward_s=_timed(flops, fwd_traffic, gpu) + 2 * tp_allreduce,
        backward_s=_timed(2 * flops, 2 * fwd_traffic, gpu) + 2 * tp_allreduce,
        activation_bytes=activations,
        activation_bytes_recompute=hidden_bytes,
        param_count=params,
        source="estimated")

    # Embedding: a vocab-parallel gather (memory-bound) whose partial sums are all-reduced over TP;
    # backward scatter-adds into the table shard. Learned positions add the model's position
    # table (GPTModel sizes it by the model's seq_length, whatever length is trained).
    vocab = model.padded_vocab_size([tp])
    positions = model.seq_length * h if model.position_embedding_type == "learned_absolute" else 0
    embedding = OpCost(
        forward_s=_timed(0.0, 3 * hidden_bytes, gpu) + tp_allreduce,
        backward_s=_timed(0.0, 3 * hidden_bytes, gpu),
        activation_bytes=b * s * h,                       # embedding dropout mask
        activation_bytes_recompute=b * s * h,
        param_count=vocab * h // tp + positions,
        source="estimated")

    # Output layer: final norm, vocab-parallel projection h -> V/t, cross-entropy in fp32 over the
    # shard (logits kept for backward). Backward all-reduces the projection's input gradient.
    logits_fp32 = 4 * b * s * vocab / tp
    out_flops = 2 * b * s * h * vocab / tp
    out_traffic = vocab * h // tp * act_elem_bytes + 3 * logits_fp32 + 2 * hidden_bytes
    output = OpCost(
        forward_s=_timed(out_flops, out_traffic, gpu),
        backward_s=_timed(2 * out_flops, 2 * out_traffic, gpu) + tp_allreduce,
        activation_bytes=logits_fp32 + 2 * hidden_bytes,  # logits, norm and projection inputs
        activation_bytes_recompute=logits_fp32 + 2 * hidden_bytes,  # never recomputed
        param_count=vocab * h // tp + norm_param_count(model),
        source="estimated")
    return ProfileEntry(gpu=gpu.name, tp=tp, micro_batch_size=b, seq_length=s,
                        layer=layer, embedding=embedding, output=output)


def estimate_profile(model: ModelSpec, cluster: Cluster, micro_batch_size: int, seq_length: int,
                     tp_degrees: list[int] | None = None,
                     attention: str = DEFAULT_ATTENTION) -> Profile:
    """Estimated entries for every GPU type of the cluster x TP degree (default: all valid ones
    that fit in a node of that type), for layers that run ``attention``."""
    profile = Profile(model.name, attention=attention)
    for node in cluster.nodes:
        gpu = cluster.gpu_types[node.gpu]
        degrees = tp_degrees if tp_degrees is not None else model.valid_tp_degrees(node.num_gpus)
        for tp in degrees:
            if profile.has(gpu.name, tp, micro_batch_size, seq_length):
                continue
            profile.add(estimate_entry(model, gpu, tp, micro_batch_size, seq_length,
                                       node.intra_node_bandwidth_gbs, attention))
    return profile


def _micro_batch_s(entry: ProfileEntry, num_layers: int) -> float:
    """Forward + backward of one micro-batch through the whole model on one TP group."""
    return sum(op.forward_s + op.backward_s for op in
               [entry.layer] * num_layers + [entry.embedding, entry.output])


def achieved_efficiency(profile: Profile, model: ModelSpec, catalog: dict[str, GPUType]
                        ) -> dict[str, float]:
    """Per GPU type of the catalog with measured entries in ``profile`` (every part measured):
    the ``achieved_efficiency`` that makes the estimate of one micro-batch through the whole
    model (every layer, the embedding, the output layer) equal the measurement; the geometric
    mean over the type's entries (TP degrees, micro-batch sizes, sequence lengths). The estimate
    is ``A / e + B`` (kernels scaled by ``e``, TP all-reduces not), so ``e = A / (measured -
    B)``; an entry measured faster than its all-reduces alone (B) says nothing and is skipped."""
    logs: dict[str, list[float]] = {}
    for entry in profile.entries.values():
        gpu = catalog.get(entry.gpu)
        if gpu is None or any(getattr(entry, part).source != "measured" for part in PARTS):
            continue
        at = {e: _micro_batch_s(estimate_entry(
            model, replace(gpu, achieved_efficiency=e), entry.tp, entry.micro_batch_size,
            entry.seq_length, gpu.intra_node_bandwidth_gbs, profile.attention), model.num_layers)
            for e in (1.0, 0.5)}
        kernels = at[0.5] - at[1.0]
        links = at[1.0] - kernels
        measured = _micro_batch_s(entry, model.num_layers)
        if measured > links:
            logs.setdefault(entry.gpu, []).append(math.log(kernels / (measured - links)))
    return {g: math.exp(sum(v) / len(v)) for g, v in logs.items()}
