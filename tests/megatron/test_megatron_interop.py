"""Stock Megatron-LM and our plans continue each other's training from torch_dist checkpoints.

Needs a Megatron-LM checkout at tag core_v0.16.1 named by MEGATRON_LM_DIR (as
tests/megatron/test_megatron_lm.py, whose helpers make the copy); skipped otherwise. One chain of
real jobs, TOTAL iterations of the tiny model on the built-in corpus:

1. ``autohet train`` on tiny-two-pipelines (two pipelines of different depth, TP2 and TP1
   stages) trains TOTAL iterations uninterrupted, saving every 2: the reference numbers, and
   the step it hands over.
2. (a) Stock Megatron-LM: its own, unpatched ``pretrain_gpt.py`` (one process, TP1 x PP1,
   ``--transformer-impl local --ckpt-format torch_dist``) ``--load``s our step 2 with its own
   ``load_checkpoint`` into the model, optimizer and scheduler its ``setup_model_and_optimizer``
   builds, trains iterations 3 and 4 with its own ``train_step`` and data loader, and saves
   step 4 with its own ``save_checkpoint``.
3. (b) ``autohet checkpoint convert`` adopts stock's step 4 (checkpoint/convert.py says why a
   conversion), and ``autohet train --load`` resumes it on tiny-two-pipelines for 5 .. TOTAL.

After each hand-over every iteration equals the uninterrupted run: loss and grad norm within
1e-5 relative, the learning rate exactly (one schedule, in samples); the weights stock loaded are
our saved ones bit for bit, and stock trained on the same tokens.

How stock Megatron-LM runs on this CPU-only machine (:func:`_stock_pretrain_gpt_in_tree`, all
in-process, no file of the tree edited): the project's CPU mode (runtime/cpu_mode.py) and the
two ``initialize_megatron`` adaptations the plan path uses (megatron/hooks.py), plus three spots
where stock training itself assumes a GPU: ``pretrain`` calls ``initialize_megatron`` without
``allow_no_cuda`` (the one CPU change of our patch's training.py hunk, made here in-process
instead), ``_set_random_seed`` seeds the model-parallel RNG tracker only when
``torch.cuda.device_count() > 0`` (stock's local-spec attention forks it around dropout, even at
p=0), ``get_model`` sets DDP up on a side ``torch.cuda.Stream``; and the flag
``--use-cpu-initialization`` (the initial weights are overwritten by the load anyway).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_autohet.system.ports import free_port
from helpers.megatron_lm import (MLM, PLAN, ROOT, SCHEDULE_ARGS, logged_metrics,
                                 megatron_lm_runnable, output_tail, pristine_copy)

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(
    not MLM, reason="set MEGATRON_LM_DIR to a Megatron-LM checkout at tag core_v0.16.1 "
                    "(git clone https://github.com/NVIDIA/Megatron-LM; git checkout core_v0.16.1)")]

MODEL = ROOT / "configs/models/tiny.yaml"
TOTAL, HANDOVER, STOCK_UNTIL = 6, 2, 4
REL = 1e-5
# Stock flags for the same model, batch and schedule as PLAN + SCHEDULE_ARGS: no dropout and
# unfused kernels as the runtime trains (megatron's fused bias-GeLU is the tanh approximation).
STOCK_ARGS = [
    "--num-layers", "6", "--hidden-size", "64", "--num-attention-heads", "4",
    "--ffn-hidden-size", "256", "--seq-length", "64", "--max-position-embeddings", "64",
    "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(TOTAL),
    *SCHEDULE_ARGS, "--tokenizer-type", "NullTokenizer", "--vocab-size", "511",
    "--distributed-backend", "gloo", "--transformer-impl", "local", "--ckpt-format", "torch_dist",
    "--use-cpu-initialization", "--hidden-dropout", "0", "--attention-dropout", "0",
    "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-masked-softmax-fusion",
    "--no-gradient-accumulation-fusion", "--no-persist-layer-norm",
    # One dataset split, as the runtime reads the corpus. No evaluation runs: no interval is
    # reached and --exit-interval ends the job before pretrain()'s final one (--eval-interval has
    # no default in core_v0.16.1, and the dataset sample counts divide by it).
    "--split", "100,0,0", "--eval-iters", "1", "--eval-interval", "1000000", "--log-interval", "1",
]


def _stock_runnable() -> str | None:
    probe = subprocess.run([sys.executable, "-c", "import psutil"], capture_output=True)
    if probe.returncode:
        return ("Megatron-LM's torch_dist save (filesystem_async._process_memory) needs psutil: "
                "pip install psutil")
    return megatron_lm_runnable()


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """A copy of the checkout with Megatron-LM's own pretrain_gpt.py and training.py (our patch,
    if the checkout has it, reversed): the stock code path."""
    reason = _stock_runnable()
    if reason:
        pytest.skip(reason)
    dest = tmp_path_factory.mktemp("mlm") / "tree"
    dest.mkdir()
    for part in ("gpt_builders.py", "model_provider.py"):
        shutil.copy(Path(MLM) / part, dest / part)
    shutil.copytree(Path(MLM) / "megatron", dest / "megatron",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "build"))
    pristine_copy(dest)
    assert "megatron-autohet" not in (dest / "pretrain_gpt.py").read_text()
    return dest


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, Path]:
    """(--data-dir of autohet, --data-path of stock): the built-in corpus, built once."""
    from megatron_autohet.data.corpus import build_corpus

    data_dir = tmp_path_factory.mktemp("data")
    return data_dir, build_corpus(data_dir)


def _autohet_train(data_dir: Path, *args) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "megatron_autohet.cli.main", "train", "--plan", str(PLAN),
           "--model", str(MODEL), "--iters", str(TOTAL), *SCHEDULE_ARGS,
           "--data-dir", str(data_dir), *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def ours(data, tmp_path_factory) -> tuple[list[tuple], Path]:
    """The uninterrupted run's metrics, and a --load directory holding its step HANDOVER."""
    tmp = tmp_path_factory.mktemp("ours")
    result = _autohet_train(data[0], "--metrics-jsonl", tmp / "full.jsonl", "--save",
                            tmp / "saves", "--save-interval", HANDOVER,
                            "--autohet-keep-ckpts", TOTAL)
    assert result.returncode == 0, output_tail(result)
    handover = tmp / "handover"
    handover.mkdir()
    shutil.copytree(tmp / "saves" / f"iter_{HANDOVER:07d}", handover / f"iter_{HANDOVER:07d}")
    (handover / "latest_checkpointed_iteration.txt").write_text(str(HANDOVER))
    return logged_metrics(tmp / "full.jsonl"), handover


def _stock_pretrain_gpt_in_tree(record: str, *flags: str) -> None:
    """Runs in a process whose working directory is the tree (``megatron`` is Megatron-LM's):
    stock ``pretrain_gpt.py``'s main on the CPU (module docstring), recording in ``record``
    each iteration's loss, grad norm and learning rate (steps.jsonl), the weights right after
    ``load_checkpoint`` (loaded.pt) and the tokens of every micro-batch (tokens.jsonl)."""
    import contextlib
    import runpy
    from functools import partial

    import torch

    from megatron_autohet.megatron.hooks import _adapt_megatron_lm_initialization_to_cpu
    from megatron_autohet.runtime.cpu_mode import enable_cpu_mode

    enable_cpu_mode()
    _adapt_megatron_lm_initialization_to_cpu()

    class Stream:                      # CPU ops are synchronous: nothing to order
        def __init__(self, *args, **kwargs):
            pass

        def wait_stream(self, other):
            pass

    torch.cuda.Stream = Stream
    torch.cuda.current_stream = lambda device=None: Stream()
    torch.cuda.stream = lambda stream: contextlib.nullcontext()

    import megatron.training.initialize as initialize
    import megatron.training.training as training
    import megatron.training.utils as training_utils
    from megatron.core import parallel_state, tensor_parallel
    from megatron.training.utils import unwrap_model

    set_random_seed = initialize._set_random_seed

    def seed_tracker_too(seed, *args, **kwargs):
        set_random_seed(seed, *args, **kwargs)
        tensor_parallel.model_parallel_cuda_manual_seed(
            seed + 100 * parallel_state.get_pipeline_model_parallel_rank())

    initialize._set_random_seed = seed_tracker_too
    # pretrain() asserts CUDA unless initialize_megatron(allow_no_cuda=True): what the
    # pretrain_gpt.py --autohet-plan patch passes on a CPU, passed here to the stock call.
    training.initialize_megatron = partial(training.initialize_megatron, allow_no_cuda=True)
    out = Path(record)
    train_step, load_checkpoint = training.train_step, training.load_checkpoint
    get_batch = training_utils.get_batch_on_this_tp_rank

    def recording_train_step(*args, **kwargs):
        result = train_step(*args, **kwargs)
        loss, skipped, grad_norm = result[0], result[1], result[5]
        with open(out / "steps.jsonl", "a") as f:
            f.write(json.dumps({"loss": float(loss["lm loss"]), "grad_norm": float(grad_norm),
                                "lr": args[3].param_groups[0]["lr"], "skipped": skipped}) + "\n")
        return result

    def recording_load_checkpoint(model, *args, **kwargs):
        result = load_checkpoint(model, *args, **kwargs)
        torch.save({name: p.detach().clone()
                    for name, p in unwrap_model(model[0]).named_parameters()}, out / "loaded.pt")
        return result

    def recording_get_batch(*args, **kwargs):
        batch = get_batch(*args, **kwargs)
        with open(out / "tokens.jsonl", "a") as f:
            f.write(json.dumps(batch["tokens"].tolist()) + "\n")
        return batch

    training.train_step = recording_train_step
    training.load_checkpoint = recording_load_checkpoint
    training_utils.get_batch_on_this_tp_rank = recording_get_batch    # before pretrain_gpt imports
    sys.argv = ["pretrain_gpt.py", *flags]
    try:
        runpy.run_path("pretrain_gpt.py", run_name="__main__")
    except SystemExit as done:                  # --exit-interval ends with sys.exit(0)
        if done.code not in (0, None):
            raise


@pytest.fixture(scope="module")
def stock(tree, data, ours, tmp_path_factory) -> tuple[Path, Path, subprocess.CompletedProcess]:
    """(a): stock pretrain_gpt.py loads our step HANDOVER, trains to STOCK_UNTIL and saves.
    Returns (its record directory, its --save directory, the finished process)."""
    tmp = tmp_path_factory.mktemp("stock")
    record, saves = tmp / "record", tmp / "saves"
    record.mkdir()
    flags = [*STOCK_ARGS, "--data-path", str(data[1]), "--data-cache-path", str(tmp / "cache"),
             "--load", str(ours[1]), "--save", str(saves), "--save-interval", str(HANDOVER),
             "--exit-interval", str(STOCK_UNTIL)]
    code = ("import sys; from test_megatron_interop import _stock_pretrain_gpt_in_tree as run; "
            "run(*sys.argv[1:])")
    # Megatron's dataset-helper Makefile runs `python3 -m pybind11`: this interpreter's.
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), CUDA_DEVICE_MAX_CONNECTIONS="1", PATH=path,
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parent),
                                         str(Path(__file__).resolve().parents[1])]))
    result = subprocess.run([sys.executable, "-c", code, str(record), *flags], cwd=tree,
                            capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, output_tail(result)
    return record, saves, result


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def _check_continues(after: list[tuple], reference: list[tuple]) -> float:
    """(loss, grad norm, lr) per iteration against the uninterrupted run's (iteration, loss,
    grad norm, lr); returns the largest relative difference."""
    assert len(after) == len(reference)
    worst = 0.0
    for (loss, norm, lr), (_, ref_loss, ref_norm, ref_lr) in zip(after, reference):
        assert lr == ref_lr                                      # one schedule, in samples
        worst = max(worst, _rel(loss, ref_loss), _rel(norm, ref_norm))
    assert worst <= REL, worst
    return worst


# megatron's local layer spec saves the layer norms under TE's names
# (gpt_layer_specs.get_gpt_layer_local_spec, sharded_state_dict_keys_map).
_CHECKPOINT_NAMES = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                     "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}


def _checkpoint_key(name: str) -> tuple[str, int | None]:
    """(checkpoint key, layer) of a megatron parameter name: ``decoder.layers.<i>.x`` is row i
    of the stacked ``decoder.layers.x``."""
    layer = re.match(r"^decoder\.layers\.(\d+)\.", name)
    if layer is None:
        return name, None
    rest = name[layer.end():]
    for local, saved in _CHECKPOINT_NAMES.items():
        rest = rest.replace(local, saved)
    return f"decoder.layers.{rest}", int(layer.group(1))


def _saved_weights(step: Path, names) -> dict:
    """Our step's full tensors for megatron parameter names, read with torch DCP here."""
    import torch
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(str(step)).read_metadata().state_dict_metadata
    keys = {_checkpoint_key(name)[0] for name in names}
    full = {k: torch.empty(tuple(metadata[k].size), dtype=metadata[k].properties.dtype)
            for k in keys}
    dcp.load(full, checkpoint_id=str(step), no_dist=True)
    weights = {}
    for name in names:
        key, layer = _checkpoint_key(name)
        weights[name] = full[key] if layer is None else full[key][layer]
    return weights


def test_stock_megatron_lm_continues_from_our_checkpoint(stock, ours, data, record_property):
    import torch

    from megatron_autohet.data.batches import DataOptions, build_global_batches

    record, _, result = stock
    full, handover = ours
    assert (f"successfully loaded checkpoint from {handover} [ t 1/1, p 1/1 ] at iteration "
            f"{HANDOVER}") in result.stdout
    steps = [json.loads(line) for line in (record / "steps.jsonl").read_text().splitlines()]
    worst = _check_continues([(s["loss"], s["grad_norm"], s["lr"]) for s in steps],
                             full[HANDOVER:STOCK_UNTIL])
    record_property("max_rel_diff", worst)
    print(f"stock Megatron-LM after our step {HANDOVER}: max relative difference {worst:.2e}")

    loaded = torch.load(record / "loaded.pt", weights_only=True)
    saved = _saved_weights(handover / f"iter_{HANDOVER:07d}", loaded)
    assert set(loaded) == set(saved)
    for name, tensor in loaded.items():
        assert torch.equal(tensor, saved[name]), name                  # bit for bit

    batches = build_global_batches(DataOptions(seq_length=64, global_batch_size=8,
                                               num_iterations=TOTAL, seed=1234,
                                               data_dir=str(data[0])), 512)
    micro = [json.loads(line) for line in (record / "tokens.jsonl").read_text().splitlines()]
    used = torch.tensor(micro).reshape(STOCK_UNTIL - HANDOVER, 8, 64)
    for i, iteration in enumerate(range(HANDOVER, STOCK_UNTIL)):
        assert torch.equal(used[i], batches.batch(iteration).tensors()["tokens"]), iteration


def test_our_plan_resumes_from_a_stock_megatron_lm_checkpoint(stock, ours, data, tmp_path,
                                                               record_property):
    from megatron_autohet.checkpoint.inspect import verify_local
    from megatron_autohet.checkpoint.convert import convert_step

    _, saves, _ = stock
    full, _ = ours
    assert (saves / "latest_checkpointed_iteration.txt").read_text().strip() == str(STOCK_UNTIL)
    converted = tmp_path / "converted"
    manifest = convert_step(saves, converted)
    assert manifest.iteration == STOCK_UNTIL
    assert manifest.extra["megatron_lm"]["tensor_model_parallel_size"] == 1
    assert verify_local(converted / f"iter_{STOCK_UNTIL:07d}").ok
    assert not (saves / f"iter_{STOCK_UNTIL:07d}" / "autohet-manifest.json").exists()

    rest = tmp_path / "rest.jsonl"
    result = _autohet_train(data[0], "--load", converted, "--metrics-jsonl", rest)
    assert result.returncode == 0, output_tail(result)
    assert f"successfully loaded checkpoint: recovered iteration {STOCK_UNTIL}" in result.stdout
    after = logged_metrics(rest)
    assert [m[0] for m in after] == list(range(STOCK_UNTIL + 1, TOTAL + 1))
    worst = _check_continues([m[1:] for m in after], full[STOCK_UNTIL:])
    record_property("max_rel_diff", worst)
    print(f"our plan after stock's step {STOCK_UNTIL}: max relative difference {worst:.2e}")


@pytest.mark.parametrize("damage,problem", [
    ("no index", ".metadata: missing (an interrupted or non-torch_dist save)"),
    ("short data file", "__0_1.distcp: missing or shorter than its"),
    ("no tracker", "latest_checkpointed_iteration.txt: missing or not an iteration"),
])
def test_convert_refuses_an_incomplete_stock_step(damage, problem, stock, tmp_path):
    from megatron_autohet.checkpoint.convert import convert_step
    from megatron_autohet.errors import ConfigError

    copy = tmp_path / "stock"
    shutil.copytree(stock[1], copy)
    step = copy / f"iter_{STOCK_UNTIL:07d}"
    if damage == "no index":
        (step / ".metadata").unlink()
    elif damage == "short data file":
        data_file = step / "__0_1.distcp"
        data_file.write_bytes(data_file.read_bytes()[:-100])
    else:
        (copy / "latest_checkpointed_iteration.txt").unlink()
    with pytest.raises(ConfigError) as refused:
        convert_step(copy, tmp_path / "out")
    assert problem in str(refused.value)
    assert not (tmp_path / "out").exists()                  # nothing copied, nothing committed
