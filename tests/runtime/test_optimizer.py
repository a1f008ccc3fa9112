"""runtime/optimizer.py: megatron-core's no-decay rule on global names, settings validation, and the
learning-rate schedule megatron-core's scheduler writes into our AdamW groups."""

from dataclasses import replace
from pathlib import Path

import pytest

from helpers.dist_utils import run_on_ranks
from megatron_autohet.errors import ConfigError
from megatron_autohet.runtime.optimizer import OptimizerSettings
from megatron_autohet.spec.model import load_model

ROOT = Path(__file__).resolve().parents[2]
TINY = load_model(ROOT / "configs/models/tiny.yaml")
# untied output layer, SwiGLU, rope, GQA: another parameter set (no biases, no position table)
LLAMA_TINY = replace(TINY, name="llama-tiny", num_layers=2, num_query_groups=2,
                     gated_linear_unit=True, position_embedding_type="rope",
                     tie_embeddings=False)
SETTINGS = OptimizerSettings(lr=1e-3, weight_decay=0.1)


def _groups(rank, world, model_spec):
    """Not-decayed global names by megatron-core's _get_param_groups and by our optimizer."""
    from megatron.core.optimizer import OptimizerConfig, _get_param_groups

    from megatron_autohet.runtime.optimizer import make_optimizer
    from megatron_autohet.runtime.parallel_state import build_parallel_state
    from megatron_autohet.testing.reference import reference_plan
    from megatron_autohet.runtime.stage_model import build_stage_model, param_layouts

    plan = reference_plan(model_spec, micro_batch_size=1, num_microbatches=1, seq_length=16)
    state = build_parallel_state(plan, 0)
    model = build_stage_model(model_spec, state, seed=1)
    layouts = param_layouts(model, state)
    name_of = {id(p): layouts[n].global_name for n, p in model.named_parameters()}

    config = OptimizerConfig(optimizer="adam", lr=SETTINGS.lr, weight_decay=SETTINGS.weight_decay)
    megatron = _get_param_groups([model], config, None)       # None: megatron's standard rule
    megatron_no_decay = {name_of[id(p)] for g in megatron if g["wd_mult"] == 0.0
                         for p in g["params"]}
    ours = make_optimizer(model, layouts, SETTINGS)
    by_wd = {g["wd_mult"]: g for g in ours.param_groups}
    ours_no_decay = {name_of[id(p)] for p in by_wd[0.0]["params"]}
    assert by_wd[0.0]["weight_decay"] == 0.0 and by_wd[1.0]["weight_decay"] == 0.1
    assert ours.param_groups[0]["wd_mult"] == 1.0           # the decayed group comes first
    return megatron_no_decay, ours_no_decay, set(name_of.values())


@pytest.mark.integration
@pytest.mark.parametrize("model_spec", [TINY, LLAMA_TINY], ids=["gpt", "llama"])
def test_no_decay_rule_is_megatron_cores(model_spec):
    megatron, ours, every = run_on_ranks(1, _groups, model_spec)[0]
    assert ours == megatron
    decayed = every - ours
    # biases and norms (weight and bias) are not decayed ...
    assert all(n.endswith(".bias") or "norm" in n for n in ours)
    assert any("final_layernorm" in n for n in ours)
    qkv_bias = "decoder.layers.0.self_attention.linear_qkv.bias"
    assert (qkv_bias in ours) == (qkv_bias in every) == (model_spec is TINY)  # LLaMA: no biases
    # ... matrices and embeddings are (megatron's rule: only 1-D and *.bias are exempt)
    assert "embedding.word_embeddings.weight" in decayed
    assert "decoder.layers.0.self_attention.linear_qkv.weight" in decayed
    if model_spec.position_embedding_type == "learned_absolute":
        assert "embedding.position_embeddings.weight" in decayed
    if not model_spec.tie_embeddings:
        assert "output_layer.weight" in decayed


def _scheduled_rates(rank, world, settings, train_iters, global_batch_size=8, state=None):
    import torch

    from megatron_autohet.runtime.optimizer import make_lr_scheduler

    param = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.AdamW([{"params": [param], "wd_mult": 1.0},
                                   {"params": [], "wd_mult": 0.0}], lr=1.0)
    scheduler = make_lr_scheduler(optimizer, settings, train_iters, global_batch_size)
    rates = []
    for _ in range(train_iters):
        rates.append([(g["lr"], g["weight_decay"]) for g in optimizer.param_groups])
        scheduler.step(global_batch_size)
    return (rates, scheduler.state_dict()) if state else rates


@pytest.mark.integration
def test_schedule_warmup_then_linear_decay_with_group_weight_decay():
    settings = OptimizerSettings(lr=1e-3, min_lr=1e-4, weight_decay=0.05, lr_warmup_iters=2,
                                 lr_decay_iters=6, lr_decay_style="linear")
    rates = run_on_ranks(1, _scheduled_rates, settings, 8)[0]
    lrs = [r[0][0] for r in rates]
    # warm-up 0 -> peak over 2 iterations, linear decay to the minimum at 6, then the minimum
    expected = [0.0, 5e-4, 1e-3, 1e-3 - 0.25 * 9e-4, 1e-3 - 0.5 * 9e-4, 1e-3 - 0.75 * 9e-4,
                1e-4, 1e-4]
    assert lrs == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert all(r[0][1] == 0.05 and r[1][1] == 0.0 for r in rates)   # wd * wd_mult per group
    assert all(r[0][0] == r[1][0] for r in rates)


@pytest.mark.integration
def test_schedule_counts_samples_with_the_rates_of_iterations():
    """Megatron-LM's scheduler state counts samples (what a checkpoint holds and a loading
    Megatron-LM compares with its own); the learning rates stay those of iterations: bit for bit
    after the warm-up, within an ulp during it (megatron multiplies before it divides)."""
    settings = OptimizerSettings(lr=2e-3, min_lr=2e-4, weight_decay=0.1, lr_warmup_iters=2,
                                 lr_decay_style="cosine")
    (per_sample, state), per_iteration = run_on_ranks(
        1, lambda r, w: (_scheduled_rates(r, w, settings, 6, 12, state=True),
                         _scheduled_rates(r, w, settings, 6, 1)))[0]
    assert per_sample[3:] == per_iteration[3:]                       # decay: bit for bit
    assert [x[0][0] for x in per_sample[:3]] == pytest.approx(
        [x[0][0] for x in per_iteration[:3]], rel=1e-15)
    assert (state["num_steps"], state["lr_warmup_steps"], state["lr_decay_steps"],
            state["wd_incr_steps"]) == (6 * 12, 2 * 12, 6 * 12, 6 * 12)


@pytest.mark.unit
@pytest.mark.parametrize("changes,flag", [
    (dict(weight_decay=-0.01), "--weight-decay"),
    (dict(min_lr=2e-3), "--min-lr"),
    (dict(lr=0.0, min_lr=0.0), "--lr"),
    (dict(lr_decay_style="WSD"), "--lr-decay-style"),
    (dict(clip_grad=-1.0), "--clip-grad"),
    (dict(adam_eps=0.0), "--adam-eps"),
    (dict(lr_decay_iters=0), "--lr-decay-iters"),
])
def test_bad_settings_name_the_flag(changes, flag):
    with pytest.raises(ConfigError) as err:
        replace(OptimizerSettings(lr=1e-3), **changes).validate()
    assert err.value.field == flag


@pytest.mark.unit
def test_warmup_must_end_before_the_decay():
    settings = OptimizerSettings(lr=1e-3, lr_warmup_iters=5)
    settings.validate()                                   # length unknown: fine
    settings.validate(train_iters=6)
    with pytest.raises(ConfigError, match="fewer than the decay iterations"):
        settings.validate(train_iters=5)
    with pytest.raises(ConfigError, match="--lr-warmup-iters"):
        replace(settings, lr_decay_iters=4).validate(train_iters=100)
