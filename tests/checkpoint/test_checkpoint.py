"""Checkpoints load into any plan, exactly; a corrupt or incomplete one is never loaded.

The proof: train ``HALF`` iterations on plan A and save (``train_iterations`` with the
``Checkpointer``, the loop ``autohet train`` runs), then resume on plan B for the rest; every
iteration's loss and grad norm must equal an uninterrupted run of A (bit-identical when B is A,
relative 1e-6 otherwise: another layout sums in another order). The learning-rate schedule, the
Adam moments and step, and the data position all have to come back for that to hold.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import xxhash

from megatron_autohet.checkpoint.manifest import MANIFEST_FILE, read_manifest, step_dir_name
from megatron_autohet.checkpoint.options import CheckpointOptions
from megatron_autohet.spec.precision import BF16, FP32
from helpers.dist_utils import RankFailed, run_on_ranks
from helpers.checkpointing import HALF, REL, TOTAL, as_format_1, one_node_lost, train_job
from helpers.training import LOSS_REL, NORM_REL, OPTIMIZER, global_batches, plan, rel

pytestmark = pytest.mark.integration



@pytest.fixture(scope="module")
def uninterrupted_and_saved(tmp_path_factory):
    """An uninterrupted TOTAL-iteration run of tiny-two-pipelines (A), and A stopped after HALF
    iterations with its checkpoint (shared directory)."""
    a = plan("tiny-two-pipelines")
    batches = global_batches(a, TOTAL)
    full = run_on_ranks(a.world_size, train_job, a, batches, CheckpointOptions())[0]
    save = tmp_path_factory.mktemp("ckpt")
    first = run_on_ranks(a.world_size, train_job, a, batches,
                         CheckpointOptions(save=str(save), save_interval=HALF),
                         exit_interval=HALF)[0]
    assert first == full[:HALF]
    return full, batches, save


RESUME_PLANS = {
    "same plan": lambda: plan("tiny-two-pipelines"),
    "other layer split and TP": lambda: plan("tiny-homogeneous"),
    "one node lost": one_node_lost,
    "node added, TP2 -> TP1 -> TP2": lambda: plan("tiny-tp-change"),
}


@pytest.mark.parametrize("scenario", list(RESUME_PLANS))
def test_resume_on_another_plan_equals_uninterrupted(scenario, uninterrupted_and_saved,
                                                     tmp_path, record_property):
    full, batches, saved = uninterrupted_and_saved
    load = tmp_path / "ckpt"
    shutil.copytree(saved, load)
    b = RESUME_PLANS[scenario]()
    rest = run_on_ranks(b.world_size, train_job, b, batches,
                        CheckpointOptions(load=str(load)))[0]
    assert len(rest) == TOTAL - HALF
    resumed = full[:HALF] + rest
    if scenario == "same plan":
        assert resumed == full                       # bit-identical
    diffs = [max(rel(x[0], y[0]), rel(x[1], y[1])) for x, y in zip(resumed, full)]
    assert [x[2] for x in resumed] == [y[2] for y in full]      # learning rates
    assert max(diffs) <= REL, diffs
    record_property("max_rel_diff", max(diffs))
    print(f"{scenario}: max relative difference {max(diffs):.2e}")


BF16_TOTAL, BF16_HALF = 4, 2


def _merged(results) -> dict:
    """Full tensors by global name from every rank's (layout, shard) (replicas must agree)."""
    shards: dict = {}
    for _, held in results:
        for name, (layout, tensor) in held.items():
            shards.setdefault(name, {})[layout.tp_rank] = (layout, tensor)
    return {name: by_tp[0][0].merge([by_tp[k][1] for k in range(by_tp[0][0].tp_size)])
            for name, by_tp in shards.items()}


def test_bf16_job_resumes_bit_exactly_and_its_masters_load_into_fp32(tmp_path):
    """A bf16 job saves its fp32 masters and Adam state: resumed on the same plan it continues
    bit for bit; an fp32 job on another plan resumes from exactly those fp32 masters (not from
    the bf16-rounded weights)."""
    a = plan("tiny-two-pipelines")
    batches = global_batches(a, BF16_TOTAL)
    full = run_on_ranks(a.world_size, train_job, a, batches, CheckpointOptions(), precision=BF16,
                        total=BF16_TOTAL)[0]
    save = tmp_path / "ckpt"
    first = run_on_ranks(a.world_size, train_job, a, batches,
                         CheckpointOptions(save=str(save), save_interval=BF16_HALF),
                         exit_interval=BF16_HALF, precision=BF16, total=BF16_TOTAL,
                         masters={})
    assert first[0][0] == full[:BF16_HALF]
    saved_masters = _merged(first)
    rest = run_on_ranks(a.world_size, train_job, a, batches, CheckpointOptions(load=str(save)),
                        precision=BF16, total=BF16_TOTAL)[0]
    assert full[:BF16_HALF] + rest == full                          # bit-identical
    # an fp32 job on another plan, stopped right after loading: its weights are the masters
    b = plan("tiny-homogeneous")
    loaded = _merged(run_on_ranks(b.world_size, train_job, b, batches,
                                  CheckpointOptions(load=str(save)), precision=FP32,
                                  total=BF16_TOTAL, stop=BF16_HALF, masters={}))
    _assert_exact_masters(loaded, saved_masters)


def _assert_exact_masters(loaded: dict, saved: dict) -> None:
    assert loaded.keys() == saved.keys()
    for name, master in saved.items():
        assert loaded[name].dtype == master.dtype == torch.float32
        assert torch.equal(loaded[name], master), name
        assert not torch.equal(master, master.bfloat16().float()), name  # not bf16 values


def test_bf16_distributed_optimizer_resumes_and_cross_loads(tmp_path):
    """--bf16 --use-distributed-optimizer saves the fp32 masters gathered from its shards, and a
    load fills the shards from the checkpoint's masters, not from the bf16 weights: resumed on
    the same plan it continues bit for bit; on another plan (tiny-tp-change: asymmetric
    buckets) within test_bf16.py's bf16 tolerances (another layout rounds in another order);
    its masters load exactly into a bf16 job without the distributed optimizer, and a bf16
    checkpoint saved without it loads its masters exactly into the distributed optimizer."""

    a, b, c = plan("tiny-two-pipelines"), plan("tiny-tp-change"), plan("tiny-homogeneous")
    batches = global_batches(a, BF16_TOTAL)
    distopt = dict(precision=BF16, total=BF16_TOTAL, distributed_optimizer=True)
    full = run_on_ranks(a.world_size, train_job, a, batches, CheckpointOptions(), **distopt)[0]
    save = tmp_path / "distopt"
    first = run_on_ranks(a.world_size, train_job, a, batches,
                         CheckpointOptions(save=str(save), save_interval=BF16_HALF),
                         exit_interval=BF16_HALF, masters={}, **distopt)
    assert first[0][0] == full[:BF16_HALF]
    same = run_on_ranks(a.world_size, train_job, a, batches, CheckpointOptions(load=str(save)),
                        **distopt)[0]
    assert full[:BF16_HALF] + same == full                          # bit-identical
    other = run_on_ranks(b.world_size, train_job, b, batches, CheckpointOptions(load=str(save)),
                         **distopt)[0]
    assert len(other) == BF16_TOTAL - BF16_HALF
    for ours, reference in zip(other, full[BF16_HALF:]):
        assert rel(ours[0], reference[0]) <= LOSS_REL, (other, full)
        assert rel(ours[1], reference[1]) <= NORM_REL, (other, full)
        assert ours[2] == reference[2]                              # learning rate
    # cross-loads, each job stopped right after its load
    _assert_exact_masters(_merged(run_on_ranks(
        c.world_size, train_job, c, batches, CheckpointOptions(load=str(save)), precision=BF16,
        total=BF16_TOTAL, stop=BF16_HALF, masters={})), _merged(first))
    plain = tmp_path / "plain"
    saved_plain = run_on_ranks(a.world_size, train_job, a, batches,
                               CheckpointOptions(save=str(plain), save_interval=BF16_HALF),
                               exit_interval=BF16_HALF, precision=BF16, total=BF16_TOTAL,
                               masters={})
    _assert_exact_masters(_merged(run_on_ranks(
        b.world_size, train_job, b, batches, CheckpointOptions(load=str(plain)), stop=BF16_HALF,
        masters={}, **distopt)), _merged(saved_plain))


def test_llama_style_model_resumes_from_asymmetric_to_homogeneous(tmp_path):
    """SwiGLU (megatron saves fc1 through a sharded-tensor factory), GQA, rope, untied output."""
    def llama(p):
        p.model = replace(p.model, name="llama-tiny", num_query_groups=2, gated_linear_unit=True,
                          position_embedding_type="rope", tie_embeddings=False)
        return p.validate()

    a, b = llama(plan("tiny-two-pipelines")), llama(plan("tiny-homogeneous"))
    batches = global_batches(a, TOTAL)
    full = run_on_ranks(a.world_size, train_job, a, batches, CheckpointOptions())[0]
    run_on_ranks(a.world_size, train_job, a, batches,
                 CheckpointOptions(save=str(tmp_path), save_interval=HALF), exit_interval=HALF)
    rest = run_on_ranks(b.world_size, train_job, b, batches,
                        CheckpointOptions(load=str(tmp_path)))[0]
    diffs = [max(rel(x[0], y[0]), rel(x[1], y[1])) for x, y in zip(full[:HALF] + rest, full)]
    assert max(diffs) <= REL, diffs


def test_distributed_optimizer_checkpoints_load_either_way(uninterrupted_and_saved, tmp_path):
    """--use-distributed-optimizer saves the same per-parameter checkpoint: (1) a step saved
    without it resumes with it, on a plan with asymmetric buckets; (2) a step saved with it
    resumes without it on another plan. Both equal the uninterrupted run without it."""
    full, batches, saved = uninterrupted_and_saved
    a, b = plan("tiny-two-pipelines"), plan("tiny-tp-change")
    load = tmp_path / "plain"
    shutil.copytree(saved, load)
    with_it = run_on_ranks(b.world_size, train_job, b, batches, CheckpointOptions(load=str(load)),
                           distributed_optimizer=True)[0]
    sharded = tmp_path / "sharded"
    first = run_on_ranks(a.world_size, train_job, a, batches,
                         CheckpointOptions(save=str(sharded), save_interval=HALF),
                         exit_interval=HALF, distributed_optimizer=True)[0]
    without_it = run_on_ranks(b.world_size, train_job, b, batches,
                              CheckpointOptions(load=str(sharded)))[0]
    for label, resumed in (("saved without, resumed with", full[:HALF] + with_it),
                           ("saved with, resumed without", first + without_it)):
        assert len(resumed) == TOTAL, label
        diffs = [max(rel(x[0], y[0]), rel(x[1], y[1])) for x, y in zip(resumed, full)]
        assert [x[2] for x in resumed] == [y[2] for y in full], label
        assert max(diffs) <= REL, (label, diffs)
        print(f"--use-distributed-optimizer {label}: max relative difference {max(diffs):.2e}")


@pytest.mark.parametrize("distributed_optimizer", [False, True], ids=["plain", "distopt"])
def test_fused_adamw_resumes_bit_exactly_and_loads_either_kernels_step(
        uninterrupted_and_saved, tmp_path, distributed_optimizer):
    """torch's fused AdamW, the runtime's kernel on CUDA (runtime/optimizer.py ``fused_adamw``),
    forced on this CPU: it keeps its Adam ``step`` where the fused kernel wants it, so a fused
    job resumes bit for bit; a step saved by the default (foreach) kernel resumes under the
    fused one. The fused run is not the foreach run (the kernel did change: it rounds
    differently in the last bit) but within REL of it."""
    full, batches, saved = uninterrupted_and_saved
    a = plan("tiny-two-pipelines")
    fused = dict(fused_optimizer=True, distributed_optimizer=distributed_optimizer)
    full_fused = run_on_ranks(a.world_size, train_job, a, batches, CheckpointOptions(),
                              **fused)[0]
    assert full_fused != full
    save = tmp_path / "fused"
    first = run_on_ranks(a.world_size, train_job, a, batches,
                         CheckpointOptions(save=str(save), save_interval=HALF),
                         exit_interval=HALF, **fused)[0]
    rest = run_on_ranks(a.world_size, train_job, a, batches, CheckpointOptions(load=str(save)),
                        **fused)[0]
    assert first + rest == full_fused                                   # bit-identical
    load = tmp_path / "foreach"
    shutil.copytree(saved, load)
    switched = full[:HALF] + run_on_ranks(a.world_size, train_job, a, batches,
                                          CheckpointOptions(load=str(load)), **fused)[0]
    for label, run in (("fused", full_fused), ("foreach, then fused", switched)):
        assert [x[2] for x in run] == [y[2] for y in full], label         # learning rates
        diffs = [max(rel(x[0], y[0]), rel(x[1], y[1])) for x, y in zip(run, full)]
        assert max(diffs) <= REL, (label, diffs)
        print(f"{label} vs foreach AdamW: max relative difference {max(diffs):.2e}")


# ---- nothing corrupt or partial is loaded ----------------------------------------------------

def _corrupt_copy(saved: Path, tmp_path: Path) -> tuple[Path, Path]:
    load = tmp_path / "ckpt"
    shutil.copytree(saved, load)
    return load, load / step_dir_name(HALF)


def _largest_item(step: Path):
    manifest = read_manifest(step)
    return max(manifest.items, key=lambda i: i.length)


def test_flipped_bit_is_reported_with_its_path_and_never_loaded(uninterrupted_and_saved,
                                                                tmp_path):
    _, batches, saved = uninterrupted_and_saved
    load, step = _corrupt_copy(saved, tmp_path)
    item = _largest_item(step)
    path = step / item.file
    raw = bytearray(path.read_bytes())
    raw[item.offset + item.length // 2] ^= 0x10
    path.write_bytes(bytes(raw))
    a = plan("tiny-two-pipelines")
    with pytest.raises(RankFailed) as failed:
        run_on_ranks(a.world_size, train_job, a, batches, CheckpointOptions(load=str(load)))
    assert (f"JobConfigError: <command line>: field '--load': no checkpoint step in {load} "
            f"can be recovered: iteration {HALF}: {path}: bytes {item.offset}-"
            f"{item.offset + item.length} ({item.key}) do not match their checksum in the "
            "manifest; so chunk ") in str(failed.value)


def test_truncated_file_is_reported(uninterrupted_and_saved, tmp_path):
    _, batches, saved = uninterrupted_and_saved
    load, step = _corrupt_copy(saved, tmp_path)
    item = _largest_item(step)
    path = step / item.file
    path.write_bytes(path.read_bytes()[:item.offset + 10])
    a = plan("tiny-two-pipelines")
    with pytest.raises(RankFailed) as failed:
        run_on_ranks(a.world_size, train_job, a, batches, CheckpointOptions(load=str(load)))
    assert (f"JobConfigError: <command line>: field '--load': no checkpoint step in {load} "
            f"can be recovered: iteration {HALF}: files missing or of the wrong size on every "
            f"surviving node: {item.file}" in str(failed.value))


def test_a_step_saved_with_sha256_checksums_resumes_exactly(uninterrupted_and_saved, tmp_path):
    """A step saved by a version before xxh3_128 (format-1 manifest: bare SHA-256) loads, every
    chunk verified against its SHA-256, and resumes bit-identically; a flipped bit in it is
    caught by that SHA-256 (tests/checkpoint/test_checkpoint_cli.py)."""
    full, batches, saved = uninterrupted_and_saved
    load, step = _corrupt_copy(saved, tmp_path)
    as_format_1(step)
    assert {item.digest.partition(":")[0] for item in read_manifest(step).items} == {"sha256"}
    a = plan("tiny-two-pipelines")
    rest = run_on_ranks(a.world_size, train_job, a, batches, CheckpointOptions(load=str(load)))[0]
    assert full[:HALF] + rest == full


def test_step_without_manifest_is_not_loaded(uninterrupted_and_saved, tmp_path):
    """A save that died before its manifest: the step does not exist for a reader (here the
    only step, so training starts from scratch, as Megatron does without a checkpoint)."""
    full, batches, saved = uninterrupted_and_saved
    load, step = _corrupt_copy(saved, tmp_path)
    (step / MANIFEST_FILE).unlink()
    a = plan("tiny-two-pipelines")
    again = run_on_ranks(a.world_size, train_job, a, batches, CheckpointOptions(load=str(load)))[0]
    assert again == full


def test_manifest_lists_every_chunk_once_with_its_checksum(uninterrupted_and_saved):
    _, _, saved = uninterrupted_and_saved
    step = saved / step_dir_name(HALF)
    manifest = read_manifest(step)
    assert manifest.iteration == HALF
    assert manifest.plan == plan("tiny-two-pipelines").to_dict()
    regions = [item.region for item in manifest.items]
    assert len(regions) == len(set(regions))          # one main copy per chunk
    on_disk = {p.name: p.stat().st_size for p in step.iterdir() if p.name != MANIFEST_FILE}
    assert {name: f.size for name, f in manifest.files.items()} == on_disk
    for name in manifest.files:                       # data files are exactly their items
        items = manifest.items_in(name)
        if items:
            assert sum(i.length for i in items) == on_disk[name]
    for item in manifest.items:                       # xxh3_128 of the bytes, computed here
        raw = (step / item.file).read_bytes()[item.offset:item.offset + item.length]
        assert item.digest == f"xxh3_128:{xxhash.xxh3_128(raw).hexdigest()}"
    keys = {item.key for item in manifest.items}
    assert "optimizer.state.exp_avg.decoder.layers.self_attention.linear_qkv.weight" in keys
    assert (saved / "latest_checkpointed_iteration.txt").read_text() == str(HALF)
    assert json.loads((step / "metadata.json").read_text())["sharded_backend"] == "torch_dist"


def test_common_pt_has_stock_megatron_lm_layout(uninterrupted_and_saved):
    """What stock Megatron-LM's load_checkpoint reads from common.pt, read as it reads it
    (weights_only, megatron's safe globals); tests/megatron/test_megatron_interop.py has stock
    load it."""
    import argparse

    import megatron.core  # noqa: F401  megatron's safe globals
    import torch

    _, _, saved = uninterrupted_and_saved
    a = plan("tiny-two-pipelines")
    gbs = a.global_batch_size
    common = torch.load(saved / step_dir_name(HALF) / "common.pt", weights_only=True)
    assert (common["checkpoint_version"], common["iteration"]) == (3.0, HALF)
    assert common["content_metadata"] == {"singleton_local_shards": False,
                                          "chained_optim_avoid_prefix": True}
    args = common["args"]
    assert isinstance(args, argparse.Namespace)
    assert (args.num_layers, args.hidden_size, args.num_attention_heads) == (
        a.model.num_layers, a.model.hidden_size, a.model.num_attention_heads)
    assert args.consumed_train_samples == HALF * gbs
    assert args.no_save_rng and not args.no_save_optim          # stock skips our RNG, loads Adam
    assert not hasattr(args, "tensor_model_parallel_size")      # TP2 and TP1 stages: no one size
    optimizer = common["optimizer"]
    assert torch.equal(optimizer["state"]["common_step"], torch.tensor(float(HALF)))
    groups = sorted(optimizer["param_groups"], key=lambda g: g["wd_mult"])
    assert [g["wd_mult"] for g in groups] == [0.0, 1.0]
    for group in groups:
        assert "params" not in group
        assert (group["lr_mult"], group["is_expert_parallel"], group["is_decoupled_lr"],
                group["default_config"]) == (1.0, False, False, True)
        assert (group["max_lr"], group["min_lr"]) == (OPTIMIZER.lr, OPTIMIZER.min_lr)
    scheduler = common["opt_param_scheduler"]                  # in samples, as Megatron-LM
    assert (scheduler["num_steps"], scheduler["lr_warmup_steps"], scheduler["lr_decay_steps"],
            scheduler["wd_incr_steps"]) == (HALF * gbs, gbs, TOTAL * gbs, TOTAL * gbs)
    assert common["autohet"]["plan"] == a.to_dict()
