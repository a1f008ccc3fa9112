"""`autohet train`: bad input stops before any process starts; a heterogeneous plan trains with
Megatron's learning-rate schedule (the logged rates are megatron-core's scheduler's)."""

import json
import math
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from megatron_autohet.cli.main import build_parser, main
from megatron_autohet.cli.train import train_options
from megatron_autohet.runtime.train_log import IterationRecord, megatron_line

ROOT = Path(__file__).resolve().parents[2]
PLAN = ROOT / "configs/plans/tiny-two-pipelines.yaml"
MODEL = ROOT / "configs/models/tiny.yaml"


def _autohet(*args, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "megatron_autohet.cli.main", *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=timeout,
                          env=dict(os.environ, **(env or {})))


def _train_without_torch(*args) -> subprocess.CompletedProcess:
    """`autohet train ARGS` in a fresh interpreter whose last stdout line says whether torch got
    imported: no torch, no process started (a wall-clock bound said the same until a loaded
    machine broke it)."""
    code = ("import sys\nfrom megatron_autohet.cli.main import main\n"
            "code = main(['train', *sys.argv[1:]])\n"
            "print('torch imported' if 'torch' in sys.modules else 'no torch')\nsys.exit(code)")
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)


@pytest.mark.integration
def test_model_mismatch_is_a_clear_error_before_any_process(tmp_path):
    model = tmp_path / "tiny-4.yaml"
    model.write_text(MODEL.read_text().replace("num_layers: 6", "num_layers: 4"))
    result = _train_without_torch("--plan", PLAN, "--model", model, "--iters", "3")
    assert result.returncode == 2
    assert result.stdout.splitlines()[-1] == "no torch"
    assert (f"{PLAN}: field 'model.num_layers': the plan was made for 6 but {model} has 4"
            in result.stderr)


@pytest.mark.unit
def test_tp_not_dividing_heads_is_a_clear_error(tmp_path, capsys):
    plan = tmp_path / "plan.yaml"
    text = PLAN.read_text().replace("num_attention_heads: 4", "num_attention_heads: 1")
    plan.write_text(text.replace("num_query_groups: 4", "num_query_groups: 1"))
    assert main(["train", "--plan", str(plan), "--model", str(MODEL)]) == 2
    assert (f"{plan}: field 'pipelines[0].stages[0].ranks': TP degree 2 does not divide the "
            "model's num_attention_heads (1)") in capsys.readouterr().err


@pytest.mark.integration
def test_world_size_mismatch_under_torchrun_env(capsys):
    env = {"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0"}
    result = _autohet("train", "--plan", str(PLAN), "--model", str(MODEL), env=env, timeout=120)
    assert result.returncode == 2
    assert ("field 'ranks': the plan has 4 ranks but the job has WORLD_SIZE=3 processes"
            in result.stderr)


@pytest.mark.integration
@pytest.mark.parametrize("flags,field,message", [
    (["--weight-decay", "-0.1"], "--weight-decay", "got -0.1 (allowed: >= 0"),
    (["--lr", "1e-3", "--min-lr", "2e-3"], "--min-lr", "got 0.002 (allowed: 0 <= --min-lr <= --lr"),
    (["--iters", "3", "--lr-warmup-iters", "3"], "--lr-warmup-iters",
     "got 3 (allowed: fewer than the decay iterations (3"),
    (["--adam-beta2", "1.0"], "--adam-beta2", "got 1.0 (allowed: 0 <= beta < 1)"),
    (["--bf16", "--fp16"], "--fp16", "given with --bf16 (allowed: one of them)"),
    (["--fp16"], "--fp16", "fp16 mixed precision needs a dynamic loss scaler"),
    (["--no-bias-swiglu-fusion"], "--no-bias-swiglu-fusion",
     "the model's MLP is GELU (allowed: --no-bias-gelu-fusion)"),
])
def test_bad_optimizer_values_are_clear_errors_before_any_process(flags, field, message):
    result = _train_without_torch("--plan", PLAN, "--model", MODEL, *flags)
    assert result.returncode == 2
    assert result.stdout.splitlines()[-1] == "no torch"
    assert f"autohet train: error: <command line>: field '{field}': {message}" in result.stderr


@pytest.mark.unit
def test_megatron_lm_fusion_flags_reach_the_job_options():
    """Fused kernels by default (used on CUDA GPUs only, runtime/fusions.py); each flag turns
    its fusion off."""
    def options(*flags):
        args = build_parser().parse_args(["train", "--plan", str(PLAN), "--model", str(MODEL),
                                          *flags])
        job = train_options(args)
        return job.bias_activation_fusion, job.bias_dropout_fusion

    assert options() == (True, True)
    assert options("--no-bias-gelu-fusion") == (False, True)
    assert options("--no-bias-dropout-fusion") == (True, False)


@pytest.mark.unit
def test_unknown_lr_decay_style_is_refused_by_argparse(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--plan", str(PLAN), "--model", str(MODEL), "--lr-decay-style", "WSD"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --lr-decay-style: invalid choice: 'WSD'" in err
    assert all(style in err for style in ("constant", "linear", "cosine"))


@pytest.mark.unit
def test_megatron_log_line_format():
    rec = IterationRecord.make(iteration=3, train_iters=10, global_batch_size=8, seq_length=64,
                               elapsed_s=0.3124, learning_rate=1e-4, lm_loss=6.23812,
                               grad_norm=1.2341, flops_per_iteration=2.5e14, world_size=4,
                               max_allocated_bytes=None)
    line = megatron_line(rec)
    assert line.startswith(f" [{rec.timestamp}] iteration        3/      10 |")
    assert ("| consumed samples:           24 | elapsed time per iteration (ms): 312.4 |"
            " throughput per GPU (TFLOP/s/GPU): 200.1 |"
            " learning rate: 1.000000E-04 | global batch size:     8 | lm loss: 6.238120E+00 |"
            " grad norm: 1.234 | tokens per second: 1638.9 |") in line
    assert line.endswith("tokens per second: 1638.9 |")     # no CUDA allocator on a CPU
    on_gpu = replace(rec, mem_max_allocated_gigabytes=29.3125)
    assert megatron_line(on_gpu).endswith(
        "tokens per second: 1638.9 | mem-max-allocated-gigabytes: 29.31 |")


@pytest.mark.e2e
@pytest.mark.parametrize("distributed_optimizer", ["", "flag", "plan", "bf16"])
def test_train_two_pipelines_three_iterations(tmp_path, distributed_optimizer):
    """Also with the distributed optimizer, from the flag or from a plan made for it, and with
    it in bf16 (--bf16 --use-distributed-optimizer, Megatron-LM's usual combination). The plan
    made for it was priced on a GPU's profile, of fused layers, which a CPU job does not run:
    its log says so once. The job measures itself in one window of the three iterations."""
    metrics, measured = tmp_path / "metrics.jsonl", tmp_path / "measured.jsonl"
    peak, floor = 2e-3, 2e-4
    plan, flags = PLAN, []
    if distributed_optimizer == "flag":
        flags = ["--use-distributed-optimizer"]
    elif distributed_optimizer == "bf16":
        flags = ["--bf16", "--use-distributed-optimizer"]
    elif distributed_optimizer == "plan":
        plan = tmp_path / "plan.yaml"
        plan.write_text(PLAN.read_text() + "use_distributed_optimizer: true\n"
                        "profile: {model: tiny, fusions: {bias_activation_fusion: true, "
                        "bias_dropout_fusion: true}, entries: []}\n")
    result = _autohet("train", "--plan", str(plan), "--model", str(MODEL), "--iters", "3", *flags,
                      "--lr", str(peak), "--min-lr", str(floor), "--lr-warmup-iters", "1",
                      "--lr-decay-style", "cosine", "--weight-decay", "0.1",
                      "--metrics-jsonl", str(metrics), "--data-dir", str(tmp_path / "data"),
                      "--autohet-measure-window", "3", "--autohet-measured-jsonl", str(measured))
    assert result.returncode == 0, result.stderr[-3000:]
    windows = [json.loads(line) for line in measured.read_text().splitlines()]
    assert [w["window"] for w in windows] == [[1, 3]]
    assert [(s["pipeline"], s["stage"]) for s in windows[0]["stages"]] == [(0, 0), (0, 1), (1, 0)]
    assert " measured iterations " not in result.stdout    # the hand-written plan predicts nothing
    # known_warnings.py: the launcher and its four ranks print no warning of megatron-core's
    assert not re.search(r"megatron/core/\S+:\d+: \w*Warning", result.stdout + result.stderr)
    assert ("training in bf16 (--bf16)" if distributed_optimizer == "bf16"
            else "training in fp32 (the default on CPU)") in result.stdout
    assert result.stdout.count("layer: megatron-core's local layer spec with torch "
                               "scaled_dot_product_attention as core attention") == 1
    warned = [line for line in result.stdout.splitlines() if "for other layers" in line]
    assert warned == ([] if distributed_optimizer != "plan" else [
        "WARNING: the plan's predicted times are for other layers: its profile measured fused "
        "bias + activation, bias + dropout + residual add (megatron-core's, torch.compile), this "
        "job runs no kernel fusions (no CUDA device); profile with this job's --no-bias-*-fusion "
        "flags on a machine like this one, then plan again"])
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2, 3]
    losses = [r["lm_loss"] for r in records]
    assert all(math.isfinite(x) for x in losses)
    assert abs(losses[0] - math.log(512)) < 0.5      # untrained: about uniform over the vocab
    assert losses[-1] < losses[0]
    assert all(r["grad_norm"] > 0 and r["tokens_per_second"] > 0 for r in records)
    assert all(r["throughput_tflops_per_gpu"] > 0 and r["mem_max_allocated_gigabytes"] is None
               and r["mem_max_allocated_gigabytes_per_rank"] is None for r in records)
    # Megatron's warm-up (from 0 over 1 iteration) then cosine decay over iterations 1..3, logged
    # as Megatron-LM logs it: the rate after the iteration's scheduler step.
    def cosine(done):
        return floor + 0.5 * (math.cos(math.pi * done) + 1.0) * (peak - floor)
    expected = [peak, cosine(0.5), cosine(1.0)]
    assert [r["learning_rate"] for r in records] == pytest.approx(expected, rel=1e-12)
    lines = [line for line in result.stdout.splitlines() if "] iteration " in line]
    assert len(lines) == 3 and "lm loss:" in lines[-1] and "tokens per second:" in lines[-1]
    # rank 0 (stage 0 of the TP2 pipeline: layers 0-4 + embeddings, asymmetric with the TP1
    # pipeline) keeps the state of about half of its elements
    assert ("> distributed optimizer: rank 0 keeps" in result.stdout) == bool(
        distributed_optimizer)
