"""torch SDPA as megatron-core's core attention (runtime/attention.py) and the one layer spec per
job (runtime/stage_model.py ``stage_layer_spec`` / ``agree_layer_spec``)."""

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from helpers.dist_utils import run_on_ranks
from megatron_autohet.plan import load_plan
from megatron_autohet.spec.model import load_model

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TINY = load_model(ROOT / "configs" / "models" / "tiny.yaml")      # 4 heads, hidden 64
PLAN_FILE = ROOT / "configs" / "plans" / "tiny-two-pipelines.yaml"

# (what, model overrides, config overrides, core-attention kwargs)
CASES = [
    ("MHA", {}, {}, {}),
    ("GQA 4 heads / 2 groups", {"num_query_groups": 2}, {}, {}),
    ("GQA 4 heads / 1 group", {"num_query_groups": 1}, {}, {}),
    ("query-key layer scaling, layer 3", {}, {"apply_query_key_layer_scaling": True},
     {"layer_number": 3}),
    ("explicit softmax scale", {}, {}, {"softmax_scale": 0.3}),
]


def _compare_with_megatron(rank, world):
    """Per case: max |difference| of output and of q/k/v gradients, SDPA vs megatron's
    DotProductAttention (fp32, causal, same inputs)."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_autohet.runtime.attention import SDPAttention
    from megatron_autohet.runtime.stage_model import transformer_config

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    tensor_parallel.model_parallel_cuda_manual_seed(1)      # megatron's dropout RNG fork
    out = {}
    try:
        for what, model_changes, config_changes, kwargs in CASES:
            config = transformer_config(replace(TINY, **model_changes), 1, **config_changes)
            kwargs = dict(dict(layer_number=1), **kwargs)
            results = []
            for cls in (DotProductAttention, SDPAttention):
                torch.manual_seed(0)
                module = cls(config, attn_mask_type=AttnMaskType.causal, attention_type="self",
                             **kwargs)
                sq, b, heads = 16, 3, config.num_attention_heads
                d = config.kv_channels
                q = torch.randn(sq, b, heads, d, requires_grad=True)
                k = torch.randn(sq, b, config.num_query_groups, d, requires_grad=True)
                v = torch.randn(sq, b, config.num_query_groups, d, requires_grad=True)
                context = module(q, k, v, None, AttnMaskType.causal)
                assert context.shape == (sq, b, heads * d), context.shape
                (context * torch.linspace(-1, 1, context.numel()).view_as(context)).sum().backward()
                results.append([context.detach(), q.grad, k.grad, v.grad])
            out[what] = [float((a - b).abs().max()) / float(a.abs().max())
                         for a, b in zip(*results)]
    finally:
        parallel_state.destroy_model_parallel()
    return out


def _fallback(rank, world):
    """SDPA with an explicit mask tensor, twice: megatron's unfused path computes it (same
    output as DotProductAttention), and the log says so once."""
    import logging

    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_autohet.runtime.attention import SDPAttention
    from megatron_autohet.runtime.stage_model import transformer_config

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("megatron_autohet.runtime.attention").addHandler(handler)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    try:
        config = transformer_config(TINY, 1)
        q, k, v = (torch.randn(8, 2, 4, config.kv_channels) for _ in range(3))
        mask = torch.rand(2, 1, 8, 8) > 0.7          # megatron's convention: True = masked
        outputs = []
        for cls in (DotProductAttention, SDPAttention, SDPAttention):
            module = cls(config, layer_number=1, attn_mask_type=AttnMaskType.padding,
                         attention_type="self")
            outputs.append(module(q, k, v, mask, AttnMaskType.padding))
    finally:
        parallel_state.destroy_model_parallel()
    return ([torch.equal(outputs[0], o) for o in outputs[1:]],
            [r.getMessage() for r in records])


def test_unfused_path_where_sdpa_cannot_serve_said_once():
    same, messages = run_on_ranks(1, _fallback)[0]
    assert same == [True, True]
    assert messages == [
        "attention runs megatron-core's unfused DotProductAttention (scores, softmax and dropout "
        "mask kept per layer) where SDPA cannot serve: an explicit attention mask (megatron fills "
        "masked scores with -10000)"]


def test_sdpa_core_attention_equals_megatrons_dot_product_attention():
    errors = run_on_ranks(1, _compare_with_megatron)[0]
    for what, (context, dq, dk, dv) in errors.items():
        assert max(context, dq, dk, dv) < 1e-5, (what, context, dq, dk, dv)


def _stage_attention(rank, world):
    """The core attention of the runtime's and of the stock baseline's layers, and how many SDPA
    calls one forward of the runtime's stage model makes."""
    from megatron_autohet.runtime import attention
    from megatron_autohet.runtime.optimizer import OptimizerSettings
    from megatron_autohet.runtime.parallel_state import build_parallel_state
    from megatron_autohet.runtime.stage_model import build_stage_model, layer_spec_name
    from megatron_autohet.testing.stock import StockMegatronTrainer
    from megatron_autohet.testing.reference import reference_plan

    plan = reference_plan(TINY, micro_batch_size=2, num_microbatches=1, seq_length=16)
    model = build_stage_model(plan.model, build_parallel_state(plan, rank), seed=1)
    ours = {type(layer.self_attention.core_attention).__name__ for layer in model.decoder.layers}
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counting(*args, **kwargs):
        calls.append(kwargs["is_causal"])
        return sdpa(*args, **kwargs)

    torch.nn.functional.scaled_dot_product_attention = counting
    try:
        tokens = torch.randint(0, TINY.vocab_size, (2, 16))
        model(tokens, torch.arange(16).expand(2, 16), None)
    finally:
        torch.nn.functional.scaled_dot_product_attention = sdpa
    stock = StockMegatronTrainer(plan, rank=rank, seed=1, optimizer=OptimizerSettings(lr=1e-3))
    try:
        theirs = {type(layer.self_attention.core_attention).__name__
                  for layer in stock.model.module.decoder.layers}
    finally:
        stock.close()
    return layer_spec_name(), ours, theirs, calls, attention.__name__


def test_runtime_and_stock_layers_use_sdpa():
    name, ours, theirs, calls, _ = run_on_ranks(1, _stage_attention)[0]
    assert name == "sdpa"
    assert ours == theirs == {"SDPAttention"}
    assert calls == [True] * TINY.num_layers        # one causal SDPA call per layer


def _sharded_keys(rank, world, use_sdpa):
    """Keys of the runtime stage model's checkpoint (GPTModel.sharded_state_dict) with the SDPA
    spec or megatron-core's local spec (unfused attention)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_autohet.runtime import attention
    from megatron_autohet.runtime.parallel_state import build_parallel_state
    from megatron_autohet.runtime.stage_model import build_stage_model

    if not use_sdpa:        # the spec as it was before SDPA: megatron's own core attention
        attention.SDPAttention = DotProductAttention
    plan = load_plan(PLAN_FILE)
    model = build_stage_model(plan.model, build_parallel_state(plan, rank), seed=1)
    kinds = {type(layer.self_attention.core_attention).__name__ for layer in model.decoder.layers}
    # the checkpoint's keys: each ShardedTensor's / ShardedObject's global key
    return sorted(v.key for v in nested_values(model.sharded_state_dict())), kinds


def test_checkpoint_keys_do_not_depend_on_the_attention():
    world = load_plan(PLAN_FILE).world_size
    sdpa = run_on_ranks(world, _sharded_keys, True)
    local = run_on_ranks(world, _sharded_keys, False)
    assert {k for _, kinds in sdpa for k in kinds} == {"SDPAttention"}
    assert {k for _, kinds in local for k in kinds} == {"DotProductAttention"}
    assert [keys for keys, _ in sdpa] == [keys for keys, _ in local]
    # megatron's local spec names the norms as Transformer Engine's layer does
    keys = {k for keys, _ in sdpa for k in keys}
    assert "decoder.layers.self_attention.linear_qkv.layer_norm_weight" in keys
    assert "decoder.layers.mlp.linear_fc1.layer_norm_weight" in keys
    assert not any("input_layernorm" in k or "pre_mlp_layernorm" in k for k in keys)


def _agree(rank, world, te_ranks):
    from megatron_autohet.errors import JobConfigError
    from megatron_autohet.runtime import stage_model

    if rank in te_ranks:    # as if Transformer Engine imported on this rank's node
        stage_model._use_transformer_engine = lambda: True
    try:
        return stage_model.agree_layer_spec(torch.device("cpu"))
    except JobConfigError as err:   # every rank raises it: the job prints it once, status 2
        return str(err)


def test_ranks_agree_on_one_layer_spec():
    assert run_on_ranks(3, _agree, ()) == ["sdpa"] * 3
    error = ("<fleet>: field 'layer spec': ranks build different layers: te on ranks [2], sdpa "
             "on ranks [0, 1] (allowed: one spec per job: Transformer Engine importable on every "
             "GPU node (te) or on none (sdpa))")
    assert run_on_ranks(3, _agree, (2,)) == [error] * 3
