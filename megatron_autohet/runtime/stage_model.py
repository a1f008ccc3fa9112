"""This rank's stage of the model: megatron-core's own GPTModel holding exactly the plan's layers.

Public API
----------
``plan_padded_vocab_size(plan) -> int``
    The padded vocabulary of a plan: ``ModelSpec.padded_vocab_size`` over every TP degree in it.
``transformer_config(model_spec, tp_size, *, sequence_parallel=False, pipeline_layers=None,
                     precision=FP32, **overrides) -> TransformerConfig``
    CPU-safe megatron config of one stage whose weights, activations and P2P messages are in
    ``precision``'s dtype (spec/precision.py; ``bf16``/``fp16`` set as Megatron-LM's flags do).
    ``pipeline_layers``: the [start, end) layer ranges of every stage of this rank's pipeline (None:
    the whole model in one stage).
``build_stage_model(model_spec, state, *, seed, sequence_parallel=False, padded_vocab=None,
                    precision=FP32, initialize=True, **config_overrides) -> GPTModel | ModelChunks``
    A stage of an interleaved pipeline (plan.py ``virtual_stages``) is a :class:`ModelChunks`
    of one GPTModel per chunk, each built with its ``vp_stage`` (below); any other a GPTModel.
    ``state``: runtime.parallel_state.HeteroParallelState. Layout-independent initial weights
    (runtime/init.py), or with ``initialize`` False none at all (the values are whatever the
    allocation held: for a job that loads a checkpoint over them, below); also seeds megatron's
    dropout RNG streams (``model_parallel_cuda_manual_seed``) as Megatron-LM does (below). Dropout
    is off unless ``hidden_dropout``/``attention_dropout`` are given (Megatron-LM's flags of those
    names).
``recompute_config(activation_recompute) -> dict``
    The TransformerConfig fields of a plan's ``activation_recompute``: megatron-core's full
    recompute of every layer (``recompute_granularity="full"``, ``recompute_method="uniform"``,
    ``recompute_num_layers=1``), the mode the cost model prices (profiling/estimate.py: only the
    layer input stays alive); ``{}`` when off. Pass it to ``build_stage_model``.
``param_layouts(model, state) -> dict[str, ParamLayout]``
    For every local parameter name (``model.named_parameters()``): its global name and where the
    local tensor sits in the full one (layout/params.py).
``stage_chunks(model) -> list``: the stage's model chunks (``[model]`` for a GPTModel).
``stage_layer_spec(config)``, ``TorchNorm``: the layer spec the stage uses and its norm.
``layer_spec_name() -> str``: which spec that is here, ``"te"`` or ``"sdpa"`` (``LAYER_SPECS``:
    name -> what the log says).
``agree_layer_spec(device) -> str``: every rank builds the same spec, or a JobConfigError on all.
``model_device() -> torch.device``: the current CUDA device, or the CPU in CPU mode.

Design (why)
------------
* Global layer numbers come from megatron's own mechanism, not a patch: each rank's config
  carries a ``PipelineParallelLayerLayout`` of *its* pipeline (``[[embedding, decoder*n0],
  [decoder*n1], ..., [decoder*nk, loss]]``) and ``pipeline_model_parallel_size`` = its number of
  stages; megatron's ``get_transformer_layer_offset`` / ``get_num_layers_to_build`` read the
  stage index from ``pg_collection.pp.rank()`` and the parallel_state globals (both installed by
  ``build_parallel_state``), so ``TransformerLayer.layer_number`` is the 1-based GLOBAL number.
  An interleaved pipeline's layout lists its ``n * v`` virtual stages in megatron's order (chunk
  c of stage s at c * n + s, the plan's order too); each chunk is a GPTModel built with
  ``vp_stage=c``, the first stage's chunk 0 holding the embedding and the last stage's last chunk
  the output layer, and the layer offsets come from the same layout (megatron reads v from the
  virtual-pipeline size global, runtime/parallel_state.py). The build checks every layer's
  number against the plan.
  The config is per rank anyway: pipelines differ in depth and stages in TP degree.
* TE spec on a GPU where Transformer Engine imports; elsewhere megatron-core's local layer with
  torch's scaled_dot_product_attention as core attention (runtime/attention.py: flash /
  memory-efficient / cuDNN kernels instead of megatron's unfused scores and softmax, which on
  one H100 ran 2.19x slower and held 18 GiB more for GPT-3 1.3B). The profiler
  (profiling/measure.py) and the stock baseline (testing/stock.py) build the same layer.
  The TE layer names its parameters differently (norms inside ``linear_qkv``/``linear_fc1``,
  ``_extra_state``), so one job runs one spec: ``agree_layer_spec`` refuses a fleet where some
  nodes import TE and others do not (their name-sorted gradient buckets would pair different
  parameters). Checkpoint keys do not depend on the core attention: both the SDPA and the
  unfused local layer name the norms TE-style (``linear_qkv.layer_norm_weight``) in
  ``sharded_state_dict`` (tests/runtime/test_attention.py).
* megatron's torch-norm fallback (``WrappedTorchNorm``, used when Apex is absent) refuses
  ``sequence_parallel`` (transformer/torch_norm.py); :class:`TorchNorm` is the same torch norm
  but tags its parameters ``.sequence_parallel`` as Megatron's fused norms do, so the grad sync
  sums their partial gradients over TP (runtime/grad_sync.py). This is not a CPU issue (a GPU
  without Apex/TE hits it too), so it lives here and not in cpu_mode.
* Vocabulary padding: Megatron pads to a multiple of ``128 * TP``. A plan mixes TP degrees, and
  stages holding the tied embedding/output must agree on its full shape (the output layer's
  padding rows also enter the softmax), so the padding unit is ``128 * lcm(all TP degrees of the
  plan)``: for a homogeneous plan exactly Megatron's padding. The single-process reference uses
  the same size.
* Dropout RNG streams are seeded as Megatron-LM's ``_set_random_seed`` does: ``seed + 100 *``
  the stage's index in its pipeline (stages draw different masks), the same for every TP rank
  of a stage and every replica (the hidden-state dropout outside tensor-parallel regions uses
  the default stream, which TP ranks must draw identically or their replicated activations
  diverge), and megatron-core's model-parallel stream per TP rank for dropout inside them.
  Masks therefore depend on the plan: with dropout a plan is not bit-comparable with another
  plan or the single-process reference (the proofs train without it), but one plan resumed from
  its own checkpoint continues bit for bit (the RNG states are saved per rank).
* Initialisation is runtime/init.py's alone: megatron's init methods are no-ops here, since
  every value they would draw is overwritten (megatron's CPU path still runs for the TP
  attributes it sets); that saves its draws in every build (so the default CPU generator, the
  dropout stream in CPU mode, no longer advances by them). runtime/init.py draws from
  generators of its own, so a build with ``initialize`` False - for a resume, whose checkpoint
  replaces every weight, skipping the full fp32 tensors runtime/init.py draws (together about 4
  of 6 CPU-s per rank of GPT-3 350M) - leaves every RNG stream where a build with it does.
* Tied embeddings: megatron's own all-reduce initialisation over ``pg_collection.embd`` is off
  (embd is None, see parallel_state); both copies get the same layout-independent values instead.
"""

from __future__ import annotations

import dataclasses
import re

import torch
import torch.distributed as dist

from megatron_autohet.errors import JobConfigError
from megatron_autohet.layout.params import ParamLayout, stage_global_name
from megatron_autohet.plan import Plan
from megatron_autohet.runtime.cpu_mode import cpu_mode_enabled
from megatron_autohet.runtime.init import INIT_METHOD_STD, initialize_parameters
from megatron_autohet.runtime.mixed_precision import param_dtype
from megatron_autohet.spec.model import ModelSpec
from megatron_autohet.spec.precision import FP32, Precision


def plan_padded_vocab_size(plan: Plan) -> int:
    return plan.model.padded_vocab_size({s.tp for p in plan.pipelines for s in p.stages})


def transformer_config(model_spec: ModelSpec, tp_size: int, *, sequence_parallel: bool = False,
                       pipeline_layers: list[tuple[int, int]] | None = None,
                       virtual_stages: int = 1, precision: Precision = FP32, **overrides):
    # megatron-core: on first use, not with this module
    from megatron.core.transformer import TransformerConfig

    # An interleaved pipeline's layout lists its virtual stages (chunk c of stage s at c * n + s,
    # megatron's order); megatron reads v as len(layout) / n.
    num_stages = len(pipeline_layers) // virtual_stages if pipeline_layers else 1
    layout = None
    if pipeline_layers and len(pipeline_layers) > 1:
        layout = [["decoder"] * (end - start) for start, end in pipeline_layers]
        layout[0].insert(0, "embedding")
        layout[-1].append("loss")
    kwargs = dict(
        num_layers=model_spec.num_layers,
        hidden_size=model_spec.hidden_size,
        num_attention_heads=model_spec.num_attention_heads,
        num_query_groups=model_spec.num_query_groups,
        ffn_hidden_size=model_spec.ffn_hidden_size,
        tensor_model_parallel_size=tp_size,
        sequence_parallel=sequence_parallel and tp_size > 1,
        pipeline_model_parallel_size=num_stages,
        pipeline_model_parallel_layout=layout,
        pipeline_dtype=param_dtype(precision),
        params_dtype=param_dtype(precision),
        bf16=precision.name == "bf16",
        fp16=precision.name == "fp16",
        hidden_dropout=0.0,                 # Megatron's default is 0.1: a job asks for dropout
        attention_dropout=0.0,
        init_method_std=INIT_METHOD_STD,
        # SwiGLU models (LLaMA family) also use RMSNorm and no linear biases (ModelSpec says which;
        # profiling/estimate.py counts parameters from the same properties).
        gated_linear_unit=model_spec.gated_linear_unit,
        activation_func=(torch.nn.functional.silu if model_spec.gated_linear_unit
                         else torch.nn.functional.gelu),
        normalization=model_spec.normalization,
        add_bias_linear=model_spec.linear_biases,
        # Megatron's CPU init path needs no device RNG and is what sets the TP attributes
        # (tensor_model_parallel, partition_dim) that param_layouts reads; runtime/init.py then
        # overwrites the values with the layout-independent ones.
        use_cpu_initialization=True,
        # Off here. megatron-core's bias + activation and bias + dropout fusions come as overrides
        # where they run (runtime/fusions.py); the others need Apex or Transformer Engine kernels.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        cross_entropy_loss_fusion=False,
        persist_layer_norm=False,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def recompute_config(activation_recompute: bool) -> dict:
    if not activation_recompute:
        return {}
    return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


class TorchNorm:
    """torch LayerNorm/RMSNorm built like megatron's WrappedTorchNorm, sequence-parallel aware."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused):
        if config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        elif config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        else:
            raise ValueError(f"normalization {config.normalization!r} is not supported")
        for param in norm.parameters():
            param.sequence_parallel = bool(config.sequence_parallel)
        return norm


def _use_transformer_engine() -> bool:
    if cpu_mode_enabled() or not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


# The layer specs a rank can build, by the name ranks compare at start-up (agree_layer_spec),
# and what a job's log says about each.
LAYER_SPECS = {"te": "Transformer Engine's layer spec (its fused attention)",
               "sdpa": "megatron-core's local layer spec with torch scaled_dot_product_attention "
                       "as core attention (flash / memory-efficient / cuDNN)"}


def layer_spec_name() -> str:
    """"te" (Transformer Engine's layer: on a GPU where it imports) or "sdpa" (megatron-core's
    local layer with torch SDPA as core attention, runtime/attention.py)."""
    return "te" if _use_transformer_engine() else "sdpa"


def stage_layer_spec(config):
    """(layer spec, final-norm module) for this stage's TransformerBlock (:func:`layer_spec_name`
    says which)."""
    # megatron-core: on first use, not with this module
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if layer_spec_name() == "te":
        # megatron-core: on first use, not with this module
        from megatron.core.extensions.transformer_engine import TENorm
        from megatron.core.models.gpt.gpt_layer_specs import \
            get_gpt_layer_with_transformer_engine_spec
        # TE's norms follow config.normalization; the layer norms are fused into the linears.
        return get_gpt_layer_with_transformer_engine_spec(), TENorm
    # megatron-core: on first use, not with this module
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_autohet.runtime.attention import SDPAttention
    spec = get_gpt_layer_local_spec(normalization=config.normalization)
    sub = spec.submodules
    swap = {f.name: TorchNorm for f in dataclasses.fields(sub)
            if f.name in ("input_layernorm", "pre_mlp_layernorm")
            and getattr(sub, f.name) is WrappedTorchNorm}
    attention = sub.self_attention
    attention = dataclasses.replace(attention, submodules=dataclasses.replace(
        attention.submodules, core_attention=SDPAttention))
    spec = dataclasses.replace(spec, submodules=dataclasses.replace(
        sub, self_attention=attention, **swap))
    return spec, spec.submodules.input_layernorm


def agree_layer_spec(device, file: str = "<fleet>") -> str:
    """This rank's :func:`layer_spec_name`, once every rank of the default group has checked it
    builds the same one (collective; ``device``: where the default group's tensors live - CUDA
    for NCCL). Transformer Engine's layer names its parameters differently (the norms inside
    ``linear_qkv``/``linear_fc1``), so ranks of one job on different specs would pair different
    parameters in the name-sorted gradient buckets; a mismatch is a JobConfigError on every rank
    (the job prints it once and exits with status 2)."""
    name = layer_spec_name()
    specs = list(LAYER_SPECS)
    mine = torch.tensor([specs.index(name)], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    names = [specs[i] for i in torch.cat(gathered).tolist()]
    if len(set(names)) > 1:
        by_spec = {spec: [r for r, n in enumerate(names) if n == spec]
                   for spec in LAYER_SPECS if spec in names}
        raise JobConfigError(file, "layer spec",
                          "ranks build different layers: " + ", ".join(
                              f"{spec} on ranks {ranks}" for spec, ranks in by_spec.items()),
                          "one spec per job: Transformer Engine importable on every GPU node "
                          "(te) or on none (sdpa)")
    return name


def _no_init(tensor: torch.Tensor) -> None:
    """megatron's init method here: runtime/init.py sets the values (module doc)."""


def build_stage_model(model_spec: ModelSpec, state, *, seed: int, sequence_parallel: bool = False,
                      padded_vocab: int | None = None, precision: Precision = FP32,
                      initialize: bool = True, **config_overrides):
    # megatron-core: on first use, not with this module
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    role = state.role
    # Megatron's dropout RNG streams (module doc).
    tensor_parallel.model_parallel_cuda_manual_seed(seed + 100 * role.stage.stage,
                                                    tp_rank=role.tp_rank, ep_rank=0, etp_rank=0)
    pipeline = state.plan.pipelines[role.stage.pipeline]
    config = transformer_config(model_spec, role.stage.tp_size,
                                sequence_parallel=sequence_parallel,
                                pipeline_layers=pipeline.virtual_stage_layers(),
                                virtual_stages=pipeline.virtual_stages,
                                precision=precision, **{
                                    "init_method": _no_init, "output_layer_init_method": _no_init,
                                    "embedding_init_method": _no_init, **config_overrides})
    layer_spec, final_norm = stage_layer_spec(config)
    chunks = []
    last_chunk = role.stage.num_chunks - 1
    for c, (start, end) in enumerate(role.stage.chunks):
        chunk = GPTModel(
            config,
            TransformerBlockSubmodules(layer_specs=[layer_spec] * (end - start),
                                       layer_norm=final_norm),
            vocab_size=padded_vocab or plan_padded_vocab_size(state.plan),
            max_sequence_length=model_spec.seq_length,
            pre_process=role.stage.is_first and c == 0,
            post_process=role.stage.is_last and c == last_chunk,
            parallel_output=True,
            share_embeddings_and_output_weights=model_spec.tie_embeddings,
            position_embedding_type=model_spec.position_embedding_type,
            pg_collection=state.pg_collection,
            vp_stage=c if last_chunk else None)
        # What megatron-LM's Float16Module does to a 16-bit model: some modules (the learned
        # position embedding, a torch.nn.Embedding) are built in fp32 whatever params_dtype says.
        chunk.to(model_device(), config.params_dtype)
        for local_index, layer in enumerate(chunk.decoder.layers):
            expected = start + local_index + 1
            if layer.layer_number != expected:              # megatron's offset logic disagrees
                raise RuntimeError(f"chunk {c} layer {local_index} got megatron layer_number "
                                   f"{layer.layer_number}, expected global {expected}")
        chunks.append(chunk)
    model = chunks[0] if len(chunks) == 1 else ModelChunks(chunks)
    if initialize:
        layouts = param_layouts(model, state)
        initialize_parameters(((p, layouts[n]) for n, p in model.named_parameters()), model_spec,
                              seed)
    return model


def model_device() -> torch.device:
    """Where a stage model lives: this process's current CUDA device, or the CPU (CPU mode)."""
    if torch.cuda.is_available() and not cpu_mode_enabled():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def param_layouts(model, state) -> dict[str, ParamLayout]:
    role = state.role
    tp_size, tp_rank = role.stage.tp_size, role.tp_rank
    tied = state.plan.model.tie_embeddings
    gated = state.plan.model.gated_linear_unit
    layouts = {}
    for name, param in model.named_parameters():
        partition_dim = param.partition_dim if getattr(param, "tensor_model_parallel", False) \
            else None
        full_shape = list(param.shape)
        if partition_dim is not None:
            full_shape[partition_dim] *= tp_size
        global_name = stage_global_name(name, role.stage.chunks, tied)
        num_chunks = 2 if gated and re.search(r"mlp\.linear_fc1\.(weight|bias)$", name) else 1
        layouts[name] = ParamLayout(global_name, tuple(full_shape), partition_dim, tp_rank,
                                    tp_size, num_chunks)
    return layouts


class ModelChunks(torch.nn.ModuleList):
    """The model chunks of a stage of an interleaved pipeline, in chunk order: what megatron's
    interleaved schedule takes (``list(chunks)``), and one module for everything that walks a
    stage's parameters. A parameter's local name is its chunk's index and its name in the chunk
    (``1.decoder.layers.0.mlp.linear_fc1.weight``); ``sharded_state_dict`` keys entries the same
    way, while the checkpoint keys megatron gives each entry stay per global layer."""

    @property
    def config(self):
        return self[0].config

    def sharded_state_dict(self, prefix: str = "", **kwargs) -> dict:
        return {f"{prefix}{c}.{key}": entry for c, chunk in enumerate(self)
                for key, entry in chunk.sharded_state_dict(**kwargs).items()}


def stage_chunks(model) -> list:
    """The stage's model chunks: megatron's schedule and layer walks take this list."""
    return list(model) if isinstance(model, ModelChunks) else [model]

