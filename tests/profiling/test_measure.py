"""A real measurement of the tiny model on this machine's CPU, through `autohet profile`.

One run (TP 1, two sequence lengths) is shared by the tests: it spawns one gloo process that
builds megatron-core's TransformerLayer, embedding and output layer and times them (~10 s).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_autohet.cli.main import main
from megatron_autohet.errors import ConfigError
from megatron_autohet.profiling.estimate import layer_param_count
from megatron_autohet.profiling.measure import catalog_name_for_device
from megatron_autohet.profiling.profile import Profile
from megatron_autohet.spec import load_gpu_catalog, load_model

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TINY = CONFIGS / "models" / "tiny.yaml"


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    out = tmp_path_factory.mktemp("profile") / "tiny.yaml"
    rc = main(["profile", "--model", str(TINY), "--seq-length", "32", "64", "--as-gpu",
               "A100-80GB", "--cluster", str(CONFIGS / "clusters" / "local-4.yaml"),
               "--warmup", "1", "--iters", "2", "-o", str(out)])
    assert rc == 0
    return Profile.load(out)


@pytest.mark.integration
def test_measured_entries_are_real_and_positive(measured):
    for seq in (32, 64):
        entry = measured.get("A100-80GB", 1, 1, seq)
        for part in (entry.layer, entry.embedding, entry.output):
            assert part.source == "measured"
            assert part.forward_s > 0 and part.backward_s > 0
            assert part.activation_bytes > 0 and part.param_count > 0


@pytest.mark.integration
def test_activation_bytes_grow_with_sequence_length(measured):
    short, long = measured.get("A100-80GB", 1, 1, 32), measured.get("A100-80GB", 1, 1, 64)
    for part in ("layer", "embedding", "output"):
        assert getattr(long, part).activation_bytes > getattr(short, part).activation_bytes
    # The runtime's layer runs torch SDPA, which keeps no s x s scores (the profile says so):
    # doubling s exactly doubles a layer's saved activations (megatron's unfused attention
    # more than doubled them).
    assert measured.attention == "flash"
    assert long.layer.activation_bytes == 2 * short.layer.activation_bytes


@pytest.mark.integration
def test_recompute_keeps_only_the_layer_input(measured):
    model = load_model(TINY)
    for seq in (32, 64):
        layer = measured.get("A100-80GB", 1, 1, seq).layer
        # megatron's checkpoint saves the fp32 input [s, b, h] and nothing else.
        assert layer.activation_bytes_recompute == seq * 1 * model.hidden_size * 4
        assert layer.activation_bytes > 10 * layer.activation_bytes_recompute


@pytest.mark.integration
def test_parameter_counts_match_megatron_shapes(measured):
    model = load_model(TINY)
    entry = measured.get("A100-80GB", 1, 1, 64)
    assert entry.layer.param_count == layer_param_count(model, 1)
    vocab = model.padded_vocab_size([1])
    assert entry.embedding.param_count == (vocab + model.seq_length) * model.hidden_size
    assert entry.output.param_count == vocab * model.hidden_size + 2 * model.hidden_size


def _bench_modules(rank, world, model):
    from megatron.core import parallel_state

    from megatron_autohet.profiling.measure import MeasureRequest, _Bench
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    try:
        bench = _Bench(MeasureRequest(model, 1, (1,), (32,), "CPU", 0, 1, 0), on_gpu=False)

        def count(*modules):
            return sum(p.numel() for m in modules for p in m.parameters())

        return (count(bench.layer), count(bench.embedding),
                count(bench.final_norm, bench.output_layer), bench.config.normalization,
                sorted(n for n, _ in bench.layer.named_parameters() if n.endswith("bias")))
    finally:
        parallel_state.destroy_model_parallel()


def _bench_and_runtime_configs(rank, world, model):
    """The profiler's layer config and attention as a GPU measures them (bf16, on_gpu: the only
    difference a GPU makes to _Bench is the precision; the modules stay on this CPU), and the
    runtime's config of the same stage in bf16: their plain fields (flags, sizes, dtypes)."""
    from dataclasses import fields

    import torch
    from megatron.core import parallel_state

    from megatron_autohet.profiling.measure import MeasureRequest, _Bench
    from megatron_autohet.runtime.stage_model import transformer_config
    from megatron_autohet.spec.precision import BF16

    def plain(config):
        return {f.name: getattr(config, f.name) for f in fields(config)
                if isinstance(getattr(config, f.name), (bool, int, float, str, torch.dtype))}

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    try:
        bench = _Bench(MeasureRequest(model, 1, (1,), (32,), "H100", 0, 1, 0), on_gpu=True)
        return (plain(bench.config), plain(transformer_config(model, 1, precision=BF16)),
                type(bench.layer.self_attention.core_attention).__name__, bench.attention)
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.integration
def test_a_gpu_profile_measures_the_runtimes_layer():
    """One layer, one truth: on a GPU the profiler once switched megatron's fused softmax on
    (which needs Apex: "No module named 'scaled_masked_softmax_cuda'" on an H100) and other
    fusions the runtime leaves off; it now builds the runtime's own config and attention."""
    from helpers.dist_utils import run_on_ranks

    profiled, trained, core_attention, attention = run_on_ranks(
        1, _bench_and_runtime_configs, load_model(TINY))[0]
    assert {k: v for k, v in profiled.items() if trained.get(k) != v} == {}
    assert profiled == trained
    assert (core_attention, attention) == ("SDPAttention", "flash")


def _main_grads_of_two_backwards(rank, world, model, on_gpu):
    """Two identical backwards through the profiler's layer (bf16 as a GPU builds it, on this
    CPU; fp32 as the CPU does): per parameter, (its dtype, its main grad's dtype, whether
    ``.grad`` is the main grad, main grad after two == twice the one after one, nonzero)."""
    import torch
    from megatron.core import parallel_state

    from megatron_autohet.profiling.measure import MeasureRequest, _Bench

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    try:
        bench = _Bench(MeasureRequest(model, 1, (1,), (32,), "H100" if on_gpu else "CPU", 0, 1,
                                      0), on_gpu=on_gpu)
        x = torch.randn(32, 1, bench.config.hidden_size, dtype=bench.dtype)
        after = []
        for _ in range(2):
            out, _ = bench.layer(x, attention_mask=None)
            out.float().square().sum().backward()
            after.append({n: p.main_grad.clone() for n, p in bench.layer.named_parameters()})
        return {n: (p.dtype, p.main_grad.dtype,
                    p.grad is not None and p.grad.data_ptr() == p.main_grad.data_ptr(),
                    torch.equal(after[1][n], 2 * after[0][n]), bool(after[0][n].any()))
                for n, p in bench.layer.named_parameters()}
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.integration
@pytest.mark.parametrize("on_gpu", [True, False], ids=["bf16 (GPU)", "fp32 (CPU)"])
def test_the_profiled_backward_accumulates_into_fp32_main_grads(on_gpu):
    """A measured backward pays what a trained one does: every gradient is added into an fp32
    main gradient by the runtime's mechanism (runtime/grad_sync.py ``attach_main_grads``), a
    bf16 one by the hook that frees ``.grad``, an fp32 one in place as ``.grad`` itself."""
    from helpers.dist_utils import run_on_ranks

    import torch

    found = run_on_ranks(1, _main_grads_of_two_backwards, load_model(TINY), on_gpu)[0]
    dtype = torch.bfloat16 if on_gpu else torch.float32
    assert found == {n: (dtype, torch.float32, not on_gpu, True, True) for n in found}


@pytest.mark.integration
def test_llama_style_layer_is_measured_as_the_runtime_builds_it():
    """SwiGLU models train with RMSNorm and no linear biases (runtime/stage_model.py); the measured
    modules must be those, with the parameter counts the estimate (and the runtime) have."""
    from dataclasses import replace

    from helpers.dist_utils import run_on_ranks
    from megatron_autohet.profiling.estimate import estimate_entry
    model = replace(load_model(TINY), name="llama-tiny", num_layers=2, num_query_groups=2,
                    gated_linear_unit=True, position_embedding_type="rope",
                    tie_embeddings=False)
    layer, embedding, output, norm, biases = run_on_ranks(1, _bench_modules, model)[0]
    assert norm == "RMSNorm" and biases == []
    estimate = estimate_entry(model, load_gpu_catalog()["A100-80GB"], 1, 1, 32, 300)
    assert (layer, embedding, output) == (estimate.layer.param_count,
                                          estimate.embedding.param_count,
                                          estimate.output.param_count)


@pytest.mark.integration
def test_cluster_types_not_measured_are_calibrated_estimates(measured):
    """The types `autohet profile --cluster` could not measure are estimated, then scaled by
    how far the estimate missed on the measured type (Profile.calibrated_over)."""
    for gpu in ("H800", "H20"):
        for seq in (32, 64):
            assert measured.get(gpu, 1, 1, seq).layer.source == "calibrated"
    assert len(measured.entries) == 6


@pytest.mark.integration
def test_a_cpu_profile_is_in_the_precision_the_cpu_trains_in(measured, tmp_path):
    """Measured on a CPU, where the runtime trains fp32: the profile says so (and keeps it
    through the calibrated estimates and a save/load), so the cost model counts fp32 bytes. It
    records the fusions its layers ran, none on a CPU (asked for Megatron-LM's defaults), which
    a job compares with its own (job.py)."""
    assert measured.precision.name == "fp32"
    assert measured.fusions == {"bias_activation_fusion": False, "bias_dropout_fusion": False}
    measured.save(tmp_path / "again.yaml")
    again = Profile.load(tmp_path / "again.yaml")
    assert again.precision.name == "fp32" and again.fusions == measured.fusions


@pytest.mark.unit
def test_a_bad_fusions_record_is_one_line(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("model: tiny\nfusions: {bias_dropout_fusion: 1}\nentries: []\n")
    with pytest.raises(ConfigError) as info:
        Profile.load(path)
    assert str(info.value) == (
        f"{path}: field 'fusions': got {{'bias_dropout_fusion': 1}} (allowed: a mapping of "
        "TransformerConfig fusion fields to true/false)")


@pytest.mark.unit
def test_bad_tp_degree_is_a_config_error(capsys):
    assert main(["profile", "--model", str(TINY), "--tp", "3", "-o", "unused.yaml"]) == 2
    assert capsys.readouterr().err.strip() == (
        "autohet profile: error: <command line>: field '--tp': TP degree 3 does not divide the "
        "model's num_attention_heads (4) (allowed: a TP degree in [1, 2, 4])")


@pytest.mark.unit
def test_megatron_lm_fusion_flags_reach_the_measurement(monkeypatch, tmp_path, capsys):
    """`autohet profile` takes `autohet train`'s --no-bias-*-fusion flags (Megatron-LM's), so a
    job trained unfused is planned from its own layer: each flag turns its fusion off in what
    measure_profile is asked for (on where the machine can, as in training: a CPU never fuses);
    the other MLP's flag is refused as in train."""
    import megatron_autohet.cli.profile as profile_cli

    class Asked(Exception):
        pass

    def asked(*flags):
        def measure_profile(*args, jit_fusions, **kwargs):
            raise Asked(jit_fusions)
        monkeypatch.setattr(profile_cli, "measure_profile", measure_profile)
        with pytest.raises(Asked) as found:
            main(["profile", "--model", str(TINY), "-o", str(tmp_path / "p.yaml"), *flags])
        return found.value.args[0]

    assert asked() == {"bias_activation_fusion": True, "bias_dropout_fusion": True}
    assert asked("--no-bias-gelu-fusion") == {"bias_activation_fusion": False,
                                              "bias_dropout_fusion": True}
    assert asked("--no-bias-dropout-fusion") == {"bias_activation_fusion": True,
                                                 "bias_dropout_fusion": False}
    assert main(["profile", "--model", str(TINY), "--no-bias-swiglu-fusion", "-o",
                 str(tmp_path / "p.yaml")]) == 2
    assert capsys.readouterr().err.strip() == (
        "autohet profile: error: <command line>: field '--no-bias-swiglu-fusion': the model's "
        "MLP is GELU (allowed: --no-bias-gelu-fusion)")


@pytest.mark.unit
@pytest.mark.parametrize("device, memory, expected", [
    ("NVIDIA A100-SXM4-80GB", 79.2, "A100-80GB"),
    ("NVIDIA A100-PCIE-40GB", 39.4, "A100-40GB"),
    ("NVIDIA H200", 139.8, "H200"),
    ("NVIDIA H20", 95.0, "H20"),
    ("NVIDIA H100 80GB HBM3", 79.1, "H100"),
    ("Tesla V100-SXM2-32GB", 31.7, "V100-32GB"),
    ("Tesla T4", 14.7, "T4"),
    ("NVIDIA L4", 22.0, "L4"),
    ("NVIDIA L40S", 44.5, "L40S"),
    ("NVIDIA GeForce RTX 4090", 23.6, "RTX-4090"),
    ("NVIDIA B200", 180.0, None),
])
def test_local_gpu_names_map_to_catalog_types(device, memory, expected):
    assert catalog_name_for_device(device, memory, load_gpu_catalog()) == expected
