"""A Megatron-LM user's mistaken `autohet train` command lines: each refused by the launcher before
any rank starts, in one line (at most two lines of output), status 2, no traceback.

Each case runs the real command in a subprocess (`python -m megatron_autohet.cli.main train`),
as a user types it; none of them may start torchrun or a rank (a rank would print its
"training in ..." line first)."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PLAN = ROOT / "configs/plans/tiny-two-pipelines.yaml"       # micro-batch 2, global batch 8
MODEL = ROOT / "configs/models/tiny.yaml"                    # vocab_size 512


def _dataset(prefix: Path, dtype=np.uint16, docs: int = 20) -> Path:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix.parent.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(str(prefix.with_suffix(".bin")), dtype=dtype)
    for _ in range(docs):
        builder.add_document(np.append(np.full(30, 7), 0).astype(dtype), [31])
    builder.finalize(str(prefix.with_suffix(".idx")))
    return prefix


def _fleet_plan(path: Path) -> Path:
    """The tiny model on three 8-GPU nodes: 24 one-stage pipelines."""
    plan = yaml.safe_load(PLAN.read_text())
    plan["cluster"] = "three-8-gpu-nodes"
    plan["micro_batch_size"], plan["global_batch_size"] = 1, 24
    plan["ranks"] = [{"rank": 8 * n + g, "node": f"node{n}", "local_rank": g, "gpu": "A100-80GB"}
                     for n in range(3) for g in range(8)]
    plan["pipelines"] = [{"num_microbatches": 1, "stages": [{"ranks": [r], "layers": [0, 6]}]}
                         for r in range(24)]
    plan.pop("predicted", None)
    path.write_text(yaml.safe_dump(plan))
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("mistakes")
    good = _dataset(root / "good" / "text")
    small = _dataset(root / "small" / "text", dtype=np.uint8)
    other = _dataset(root / "other" / "text", docs=5)
    (root / "torn").mkdir()
    (root / "torn" / "text.bin").write_bytes(other.with_suffix(".bin").read_bytes())
    (root / "torn" / "text.idx").write_bytes(good.with_suffix(".idx").read_bytes())
    return {"root": root, "good": good, "small": small, "torn": root / "torn" / "text",
            "fleet": _fleet_plan(root / "fleet.yaml")}


# (case, arguments after --plan/--model (str.format'ed with the data fixture), the line's start)
MISTAKES = [
    ("unknown Megatron-LM flag", ["--num-layers", "12"],
     "field '--num-layers': a Megatron-LM flag autohet train does not take (allowed: the model "
     "file's num_layers)"),
    ("--iters and --train-iters disagree", ["--iters", "5", "--train-iters", "6"],
     "field '--iters': 5, but --train-iters 6"),
    ("micro-batch mismatch", ["--micro-batch-size", "4"],
     "field '--micro-batch-size': 4, but the plan {plan} has micro_batch_size 2"),
    ("global-batch mismatch", ["--global-batch-size", "16"],
     "field '--global-batch-size': 16, but the plan {plan} has global_batch_size 8"),
    ("tokenizer vocabulary mismatch", ["--tokenizer-type", "NullTokenizer", "--vocab-size",
                                       "50256"],
     "field '--vocab-size': NullTokenizer has 50257 tokens, {model} has vocab_size 512"),
    ("missing data prefix", ["--data-path", "{root}/nowhere/text"],
     "field '--data-path': {root}/nowhere/text.bin not found"),
    ("prefix given with .bin", ["--data-path", "0.5", "{good}", "0.5", "{good}.bin"],
     "field '--data-path': {good}.bin ends in .bin (allowed: give the prefix without .bin"),
    (".bin and .idx disagree", ["--data-path", "{torn}"],
     "field '--data-path': {torn}.bin holds 310 bytes but {torn}.idx indexes 1240"),
    ("token dtype too small", ["--data-path", "{small}"],
     "field '--data-path': {small}.idx's tokens are uint8, which holds ids up to 255; the "
     "model's vocab_size is 512"),
    ("--load missing with --exit-on-missing-checkpoint",
     ["--load", "{root}/no-ckpt", "--exit-on-missing-checkpoint"],
     "field '--load': {root}/no-ckpt does not exist"),
    ("--load without a checkpoint, with --exit-on-missing-checkpoint",
     ["--load", "{root}", "--exit-on-missing-checkpoint"],
     "field '--load': no complete checkpoint in {root} (allowed: a directory holding one, as "
     "--exit-on-missing-checkpoint is set)"),
    ("a fleet plan on one machine", ["--plan", "{fleet}"],
     "{fleet}: field 'ranks': the plan's 24 ranks are on 3 nodes: node0 (8 GPUs), node1 (8 "
     "GPUs), node2 (8 GPUs)"),
    ("lr warm-up given both ways", ["--lr-warmup-iters", "2", "--lr-warmup-fraction", "0.1"],
     "field '--lr-warmup-fraction': given with --lr-warmup-iters (allowed: one of them, as in "
     "Megatron-LM)"),
]


@pytest.mark.e2e
@pytest.mark.parametrize("case,args,line", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_a_mistaken_command_line_is_one_line_and_status_2(case, args, line, data, tmp_path):
    names = {**{k: str(v) for k, v in data.items()}, "plan": str(PLAN), "model": str(MODEL)}
    args = [a.format(**names) for a in args]
    plan = args[args.index("--plan") + 1] if "--plan" in args else str(PLAN)
    args = [a for i, a in enumerate(args) if "--plan" not in (a, args[i - 1] if i else None)]
    result = subprocess.run(
        [sys.executable, "-m", "megatron_autohet.cli.main", "train", "--plan", plan,
         "--model", str(MODEL), "--data-dir", str(tmp_path), *args],
        capture_output=True, text=True, cwd=tmp_path, timeout=300)
    output = (result.stdout + result.stderr).strip().splitlines()
    assert result.returncode == 2, (case, result.stdout, result.stderr)
    assert "Traceback" not in result.stdout + result.stderr, case
    assert len(output) <= 2, (case, output)
    expected = line.format(**names)
    if not expected.startswith(plan):
        expected = "<command line>: " + expected
    assert result.stderr.startswith(f"autohet train: error: {expected}"), (case, result.stderr)


def _two_rank_plan(path: Path) -> Path:
    """The tiny model as two one-stage pipelines: both ranks read tokens."""
    plan = yaml.safe_load(PLAN.read_text())
    plan["ranks"] = plan["ranks"][:2]
    plan["pipelines"] = [{"num_microbatches": 2, "stages": [{"ranks": [r], "layers": [0, 6]}]}
                         for r in range(2)]
    plan.pop("predicted", None)
    path.write_text(yaml.safe_dump(plan))
    return path


@pytest.mark.e2e
def test_a_token_beyond_the_vocabulary_is_reported_once_for_the_job(tmp_path):
    """Only the ranks read the tokens (data/batches.py): every rank that reads the bad id finds
    it, the launcher prints it once, status 2, no traceback."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = tmp_path / "data" / "text"
    prefix.parent.mkdir()
    builder = IndexedDatasetBuilder(str(prefix.with_suffix(".bin")), dtype=np.uint16)
    for _ in range(100):
        builder.add_document(np.array([600] * 80 + [0], dtype=np.uint16), [81])
    builder.finalize(str(prefix.with_suffix(".idx")))
    result = subprocess.run(
        [sys.executable, "-m", "megatron_autohet.cli.main", "train",
         "--plan", str(_two_rank_plan(tmp_path / "plan.yaml")), "--model", str(MODEL),
         "--train-iters", "1", "--data-path", str(prefix), "--data-dir", str(tmp_path)],
        capture_output=True, text=True, cwd=tmp_path, timeout=600)
    console = result.stdout + result.stderr
    assert result.returncode == 2, console[-3000:]
    assert "Traceback" not in console, console[-3000:]
    line = (f"autohet train: error: <input>: field '--data-path': {prefix} holds token id 600 "
            "(read by global batch 0), beyond the model's vocab_size 512 (allowed: a dataset "
            "tokenized for this model's vocabulary)")
    assert console.count("holds token id") == 1 and line in result.stderr, console[-3000:]
