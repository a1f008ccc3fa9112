"""GradSync on gloo processes with synthetic parameters laid out like the proof plans.

Every rank holds its stage's parameters (TP-sharded along dim 0 or 1, or TP-replicated) and gets,
through a real backward, its pipeline's gradient G(pipeline, name, use) restricted to its shard.
After ``sync`` every shard must equal the same shard of the sum over pipelines (the tied word
embedding summed over its first- AND last-stage uses), the grad norm must equal the norm of those
full sums (each parameter counted once). The gradients land in fp32 ``main_grad`` buffers whatever
the parameters' dtype: bf16 parameters' backward gradients are added in by GradSync's hook.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron_autohet.layout.params import ParamLayout
from megatron_autohet.layout.topology import rank_role, sync_group_specs
from megatron_autohet.plan import load_plan
from megatron_autohet.runtime.grad_sync import GradSync
from helpers.dist_utils import RankFailed, run_on_ranks

PLANS = Path(__file__).resolve().parents[2] / "configs" / "plans"
WORD = "embedding.word_embeddings.weight"


def catalog(role, tied_rows=16) -> list[tuple[str, str, tuple[int, ...], int | None, int]]:
    """(local name, global name, full shape, partition dim, num_chunks) of this stage's params:
    column- and row-parallel weights, a fused two-block (SwiGLU-like) weight, replicated norms."""
    out = []
    for layer in range(*role.stage.layers):
        out += [(f"l{layer}_col", f"decoder.layers.{layer}.col.weight", (8, 4), 0, 1),
                (f"l{layer}_row", f"decoder.layers.{layer}.row.weight", (4, 8), 1, 1),
                (f"l{layer}_fused", f"decoder.layers.{layer}.fused.weight", (8, 2), 0, 2),
                (f"l{layer}_norm", f"decoder.layers.{layer}.norm.weight", (4,), None, 1)]
    if role.stage.is_first:
        out += [("word", WORD, (tied_rows, 4), 0, 1),
                ("pos", "embedding.position_embeddings.weight", (8, 4), None, 1)]
    if role.stage.is_last:
        if not role.stage.is_first:
            out.append(("output", WORD, (tied_rows, 4), 0, 1))     # the tied output weight
        out.append(("final_norm", "decoder.final_layernorm.weight", (4,), None, 1))
    return out


def pipeline_grad(pipeline: int, name: str, use: str, shape) -> torch.Tensor:
    gen = torch.Generator().manual_seed(zlib.crc32(f"{pipeline}|{name}|{use}".encode()))
    # bf16-representable, so bf16 parameters receive these gradients exactly
    return torch.randn(shape, generator=gen).bfloat16().float()


def uses(role, local_name: str) -> list[str]:
    if local_name == "word":
        return ["input", "output"] if role.stage.is_last else ["input"]
    return ["output"] if local_name == "output" else ["only"]


def expected_full(plan, global_name: str, shape) -> torch.Tensor:
    total = torch.zeros(shape, dtype=torch.float64)
    for p, pipe in enumerate(plan.pipelines):
        for s in range(len(pipe.stages)):
            role = rank_role(plan, pipe.stages[s].ranks[0])
            for local, gname, *_ in catalog(role):
                if gname == global_name:
                    for use in uses(role, local):
                        total += pipeline_grad(p, gname, use, shape).double()
    return total


def make_groups(plan, rank):
    """This rank's torch group per sync spec and its TP group; created in the same order on every
    rank, as runtime/parallel_state.py does."""
    groups = []
    for spec in sync_group_specs(plan):
        mine = None
        for ranks in spec.groups():
            group = dist.new_group(list(ranks))
            if rank in ranks:
                mine = group
        groups.append(mine)
    tp_group = None
    for pipe in plan.pipelines:
        for stage in pipe.stages:
            group = dist.new_group(stage.ranks)
            if rank in stage.ranks:
                tp_group = group
    return groups, tp_group


def build(plan, rank, *, bucket_numel, sequence_parallel=False, tied_rows=16,
          dtype=torch.float32):
    role = rank_role(plan, rank)
    groups, tp_group = make_groups(plan, rank)
    model = torch.nn.Module()
    model.p = torch.nn.ParameterDict()
    layouts = {}
    for local, gname, shape, dim, chunks in catalog(role, tied_rows):
        layout = ParamLayout(gname, shape, dim, role.tp_rank, role.stage.tp_size, chunks)
        param = torch.nn.Parameter(layout.shard(torch.zeros(shape, dtype=dtype)).clone())
        if sequence_parallel and dim is None:
            param.sequence_parallel = True   # as megatron tags layernorms under SP
        model.p[local] = param
        layouts[f"p.{local}"] = layout
    sync = GradSync(model, layouts, sync_group_specs(plan), groups, holder=role.stage.ranks,
                    tp_group=tp_group, sequence_parallel=sequence_parallel,
                    bucket_numel=bucket_numel)
    return role, model, layouts, sync


def backward_pipeline_grads(role, model, layouts, sequence_parallel=False):
    for name, param in model.named_parameters():
        layout = layouts[name]
        for use in uses(role, name[2:]):
            grad = layout.shard(pipeline_grad(role.stage.pipeline, layout.global_name, use,
                                              layout.full_shape))
            if sequence_parallel and layout.partition_dim is None:
                # each TP rank saw only its sequence chunk: it holds a share of the gradient
                grad = grad * (role.tp_rank + 1) / sum(range(1, role.stage.tp_size + 1))
            (param * grad.to(param.dtype)).sum().backward()


def _check_sync(rank, world_size, plan_file, bucket_numel, sequence_parallel,
                dtype=torch.float32):
    plan = load_plan(PLANS / plan_file)
    role, model, layouts, sync = build(plan, rank, bucket_numel=bucket_numel,
                                       sequence_parallel=sequence_parallel, dtype=dtype)
    for _ in range(2):                       # the second round checks zero_grad and reuse
        sync.zero_grad()
        backward_pipeline_grads(role, model, layouts, sequence_parallel)
        sync.sync()
        for name, param in model.named_parameters():
            layout = layouts[name]
            want = layout.shard(expected_full(plan, layout.global_name,
                                              layout.full_shape)).float()
            assert param.main_grad.dtype == torch.float32
            torch.testing.assert_close(param.main_grad, want, rtol=1e-6, atol=1e-6,
                                       msg=lambda m: f"rank {rank} {name}: {m}")
        squares = sync.owned_sum_of_squares()
        dist.all_reduce(squares)
        norm = float(squares) ** 0.5
    everything = {}
    for r in range(world_size):
        for _, gname, shape, *_ in catalog(rank_role(plan, r)):
            everything[gname] = expected_full(plan, gname, shape)
    want_norm = sum(float((g * g).sum()) for g in everything.values()) ** 0.5
    assert abs(norm - want_norm) <= 1e-6 * want_norm, (rank, norm, want_norm)
    return {"norm": norm, "buckets": len(sync.buckets),
            "full_buffers": sum(b.full_data is not None for b in sync.buckets)}


@pytest.mark.integration
@pytest.mark.parametrize("plan_file,world,asymmetric", [
    ("tiny-two-pipelines.yaml", 4, True),
    ("tiny-three-pipelines.yaml", 5, False),
    ("tiny-tp-change.yaml", 6, True),
    ("tiny-homogeneous.yaml", 4, False),
])
def test_sync_sums_replicas_and_counts_each_param_once(plan_file, world, asymmetric):
    results = run_on_ranks(world, _check_sync, plan_file, 10_000, False)
    norms = {r["norm"] for r in results}
    assert len(norms) == 1, f"ranks disagree on the grad norm: {norms}"
    # only asymmetric specs pay for a full-size staging buffer
    assert any(r["full_buffers"] for r in results) == asymmetric


@pytest.mark.integration
def test_small_buckets_and_sequence_parallel_layernorms():
    """Several buckets per spec (a parameter never split) and SP partial layernorm grads summed
    over the TP group before the replica sync, on the asymmetric two-pipeline plan."""
    results = run_on_ranks(4, _check_sync, "tiny-two-pipelines.yaml", 40, True)
    assert results[0]["buckets"] > 5


@pytest.mark.integration
def test_bf16_parameters_accumulate_into_fp32_main_grads():
    """bf16 parameters: each backward's bf16 gradient is added into the fp32 buckets (two
    backwards per tied word embedding on a first-and-last stage), synced in fp32."""
    run_on_ranks(4, _check_sync, "tiny-two-pipelines.yaml", 10_000, False, torch.bfloat16)


def _mismatched_vocab(rank, world_size):
    plan = load_plan(PLANS / "tiny-two-pipelines.yaml")
    # rank 3's one-stage pipeline pads the vocabulary differently: its word embedding disagrees
    build(plan, rank, bucket_numel=10_000, tied_rows=24 if rank == 3 else 16)


@pytest.mark.integration
def test_layout_mismatch_is_an_error_not_a_hang():
    with pytest.raises(RankFailed, match="gradient bucket embedding.word_embeddings.weight"):
        run_on_ranks(4, _mismatched_vocab, timeout=60)


@pytest.mark.unit
def test_replaced_grad_is_detected():
    model = torch.nn.Linear(4, 4, bias=False)
    layouts = {"weight": ParamLayout("decoder.layers.0.fc.weight", (4, 4), None, 0, 1)}
    plan = load_plan(PLANS / "tiny-homogeneous.yaml")
    specs = sync_group_specs(plan)
    sync = GradSync(model, layouts, specs, [None] * len(specs), holder=(0,), tp_group=None,
                    sequence_parallel=False)
    model.weight.grad = None                     # what optimizer.zero_grad() would do
    with pytest.raises(RuntimeError, match="GradSync.zero_grad"):
        sync.sync()
