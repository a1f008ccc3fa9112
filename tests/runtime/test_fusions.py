"""runtime/fusions.py: megatron-core's fused kernels compute what the unfused layer computes (with
the tanh GELU), and a job fuses only where every rank can run them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers.dist_utils import run_on_ranks
from megatron_autohet.runtime import fusions
from megatron_autohet.runtime.fusions import JIT_FUSIONS, JitFusions
from megatron_autohet.spec import load_model

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TINY = load_model(ROOT / "configs/models/tiny.yaml")          # GELU, linear biases
ALL = dict.fromkeys(JIT_FUSIONS, True)


def _layer_outputs(rank, world):
    """Output and input gradient of one layer: fused (megatron-core's kernels through
    torch.compile, here on the CPU), unfused with torch's tanh GELU, unfused as the runtime
    builds it (exact GELU)."""
    import torch.nn.functional as F
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.transformer.spec_utils import build_module

    from megatron_autohet.runtime.stage_model import stage_layer_spec, transformer_config

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    variants = {"fused": JitFusions(**ALL).config_fields(),
                "tanh": {"activation_func": lambda x: F.gelu(x, approximate="tanh")},
                "exact": {}}
    out = {}
    try:
        for name, fields in variants.items():
            config = transformer_config(TINY, 1, **fields)
            layer = build_module(stage_layer_spec(config)[0], config=config, layer_number=1)
            for i, param in enumerate(layer.parameters()):
                # large enough that the MLP's GELU inputs reach where tanh and erf GELU differ
                param.data = torch.randn(param.shape, generator=torch.Generator().manual_seed(i))
                param.data *= 0.3
            x = torch.randn(16, 2, TINY.hidden_size, generator=torch.Generator().manual_seed(9),
                            requires_grad=True)
            y, _ = layer(x, attention_mask=None)
            (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
            out[name] = (y.detach(), x.grad)
            assert layer.mlp.config.bias_activation_fusion == (name == "fused")
    finally:
        parallel_state.destroy_model_parallel()
    return out


def test_the_fused_layer_computes_the_unfused_layer_with_the_tanh_gelu():
    (out,) = run_on_ranks(1, _layer_outputs, timeout=600)
    # Equal up to the rounding of a compiled kernel's operation order (fp32).
    for fused, tanh in zip(out["fused"], out["tanh"]):
        torch.testing.assert_close(fused, tanh, rtol=1e-4, atol=1e-5)
    # The comparison can fail: exact GELU is another function.
    assert (out["fused"][0] - out["exact"][0]).abs().max() > 1e-3


def _agreed(rank, world, problems):
    fusions.jit_fusion_problem = lambda: problems[rank]      # this rank's (pretended) machine
    return fusions.agree_jit_fusions(ALL, torch.device("cpu"))


def test_a_job_fuses_only_where_every_rank_can():
    assert run_on_ranks(2, _agreed, [None, None]) == [JitFusions(**ALL)] * 2
    assert run_on_ranks(2, _agreed, [None, "Triton is not installed"]) == [
        JitFusions(off_because="ranks [1] cannot run them (see their log)"),
        JitFusions(off_because="ranks [1] cannot run them (Triton is not installed)")]


def test_a_cpu_never_fuses():
    assert fusions.local_jit_fusions(ALL) == JitFusions(off_because="no CUDA device")
    assert fusions.local_jit_fusions({}) == JitFusions()


def test_a_plan_priced_on_other_fusions_is_named():
    """job.py's warning: the plan's profile recorded the fusions its layers ran (None: not
    recorded, as the analytic estimates); a job whose layers run others says so."""
    fused = fusions.MEGATRON_LM_DEFAULTS
    assert fusions.priced_on_other_fusions(None, JitFusions()) is None
    assert fusions.priced_on_other_fusions(fused, JitFusions(**fused)) is None
    # why the job's fusions are off does not matter, only what its layers run
    assert fusions.priced_on_other_fusions(dict.fromkeys(JIT_FUSIONS, False), JitFusions(
        off_because="no CUDA device")) is None
    assert fusions.priced_on_other_fusions(fused, JitFusions(
        bias_activation_fusion=True, bias_dropout_fusion=False)) == (
        "the plan's predicted times are for other layers: its profile measured fused bias + "
        "activation, bias + dropout + residual add (megatron-core's, torch.compile), this job "
        "runs fused bias + activation (megatron-core's, torch.compile); profile with this job's "
        "--no-bias-*-fusion flags on a machine like this one, then plan again")
