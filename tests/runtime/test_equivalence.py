"""The proof: heterogeneous training equals single-process training.

For each proof plan (configs/plans/tiny-*.yaml) the tiny GPT trains ITERS iterations with AdamW
(decoupled weight decay, none on biases and 1-D parameters), gradient clipping and megatron-core's
learning-rate schedule (warm-up, then cosine decay to a minimum) on the same global batches, from
the same layout-independent initial weights, (1) with our runtime on one gloo process per planned
GPU and (2) in one process (testing/reference.py). Required (fp32): every iteration's loss and grad
norm within a relative 1e-5 of the reference, every rank reporting the same metrics, and after the
run every replica's copy of every parameter (TP shards merged by global name) equal to the
reference's parameter. The homogeneous plan is also trained with stock megatron-core (its own
parallel_state, schedule, DistributedDataParallel grad all-reduce and optimizer) for the same
losses.

Learning rate and clipping are chosen so that clipping is active in the first iterations and not
in the later ones, and the weights move far enough (peak lr 3e-3) that a wrong gradient shows.
Weight decay 0.1 (GPT-3's) rather than Megatron's default 0.01 so that the decay is large enough
to show in the final parameters.
"""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch

from megatron_autohet.layout.topology import rank_role
from megatron_autohet.plan import load_plan, plan_from_dict
from helpers.dist_utils import run_on_ranks
from helpers.training import (CLIP, OPTIMIZER, PLANS, SEED, global_batches, interleaved_plan, rel,
                              scheduled_steps)

pytestmark = pytest.mark.integration

ITERS = 5
REL = 1e-5
PARAM_TENSOR_REL = 1e-3


def _reference(rank, world, plan, batches):
    from megatron_autohet.testing.reference import run_reference
    from megatron_autohet.runtime.stage_model import plan_padded_vocab_size

    params: dict = {}
    steps = run_reference(plan.model, batches, micro_batch_size=plan.micro_batch_size, seed=SEED,
                          optimizer=OPTIMIZER, padded_vocab=plan_padded_vocab_size(plan),
                          final_params=params)
    return [(s.loss, s.grad_norm) for s in steps], params, [s.learning_rate for s in steps]


def _hetero(rank, world, plan, batches, sequence_parallel=False, distributed_optimizer=False,
            fused_optimizer=None):
    from megatron_autohet.runtime.trainer import HeteroTrainer

    trainer = HeteroTrainer(plan, plan.model, rank=rank, seed=SEED, optimizer=OPTIMIZER,
                            sequence_parallel=sequence_parallel,
                            distributed_optimizer=distributed_optimizer,
                            fused_optimizer=fused_optimizer)
    start = time.perf_counter()
    metrics, rates = scheduled_steps(trainer, batches)
    elapsed = time.perf_counter() - start
    shards = {name: (trainer.layouts[name], param.detach().clone())
              for name, param in trainer.model.named_parameters()}
    return ([(m.loss, m.grad_norm) for m in metrics], shards, trainer.state.role.stage.ranks,
            elapsed, rates)


def check_final_params(plan, results, reference_params) -> tuple[float, float]:
    """Merge every replica's TP shards by global name and compare with the reference.

    Returns (whole-model relative difference, worst single-tensor relative difference), the
    worst over all replicas. Tolerances: the whole model within REL; a single tensor within
    PARAM_TENSOR_REL, because Adam divides by sqrt(v) and so turns fp32 rounding in elements whose
    gradient is ~0 into lr-sized steps (the attention key bias has an analytically zero gradient:
    softmax is invariant to shifting every key). Merely reversing the micro-batch order in the
    reference moves those tensors by ~5e-5; a wrong gradient moves a tensor by O(1) (5 steps of
    lr 3e-3 against weights of std 0.02).
    """
    replicas: dict[tuple[str, tuple[int, ...]], dict[int, tuple]] = {}
    for _, shards, stage_ranks, *_ in results:
        for layout, value in shards.values():
            replicas.setdefault((layout.global_name, stage_ranks), {})[layout.tp_rank] = (
                layout, value)
    by_pipeline: dict[int, dict[str, torch.Tensor]] = {}
    for (name, stage_ranks), by_tp in replicas.items():
        layout = by_tp[0][0]
        assert sorted(by_tp) == list(range(layout.tp_size)), (name, stage_ranks)
        full = layout.merge([by_tp[k][1] for k in range(layout.tp_size)])
        if layout.partition_dim is None:         # TP-replicated: every TP copy must agree
            for k in range(1, layout.tp_size):
                torch.testing.assert_close(by_tp[k][1], full, rtol=0, atol=0)
        pipeline = rank_role(plan, stage_ranks[0]).stage.pipeline
        held = by_pipeline.setdefault(pipeline, {})
        if name in held:                         # the tied copy on the last stage
            torch.testing.assert_close(full, held[name], rtol=0, atol=0)
        held[name] = full
    whole, worst = 0.0, 0.0
    reference_norm = sum(float(t.double().norm() ** 2) for t in reference_params.values()) ** 0.5
    for pipeline, held in by_pipeline.items():
        assert set(held) == set(reference_params), set(reference_params) ^ set(held)
        squares = 0.0
        for name, full in held.items():
            want = reference_params[name]
            diff = float((full - want).double().norm())
            squares += diff ** 2
            tensor_rel = diff / max(float(want.double().norm()), 1e-12)
            assert tensor_rel <= PARAM_TENSOR_REL, \
                f"pipeline {pipeline} {name}: relative difference {tensor_rel:.2e}"
            worst = max(worst, tensor_rel)
        whole = max(whole, squares ** 0.5 / reference_norm)
    assert whole <= REL, f"whole-model relative difference {whole:.2e}"
    return whole, worst


PROOF_PLANS = [   # (plan, sequence parallelism on the TP>1 stages)
    ("tiny-two-pipelines.yaml", False),    # (a) [TP2 | TP1] next to [TP1], uneven layers
    ("tiny-two-pipelines.yaml", True),     #     the same with SP on the TP2 stage
    ("tiny-three-pipelines.yaml", False),  # (b) micro-batch counts 3, 1, 2
    ("tiny-tp-change.yaml", False),        # (c) TP2 -> TP1 -> TP2, tied embeddings, asymmetric
    ("tiny-tp-change.yaml", True),         #     the same with SP on the TP2 stages
    ("tiny-homogeneous.yaml", False),      # (d) TP1 x PP2 x DP2 (also vs stock megatron-core)
]


@pytest.mark.parametrize("plan_file,sequence_parallel", PROOF_PLANS)
def test_plan_trains_like_one_process(plan_file, sequence_parallel, record_property):
    reference, rates = check_plan_trains_like_one_process(
        load_plan(PLANS / plan_file), sequence_parallel, record_property, plan_file)
    assert reference[0][1] > CLIP > reference[-1][1]   # clipping was active, then not
    # warm-up from 0, the peak, then a cosine decay that has not reached the minimum. The peak
    # is megatron's lr * samples / warm-up samples, within an ulp of lr (12 samples: not exact).
    assert rates[0] == 0.0 and rates[1] == pytest.approx(OPTIMIZER.lr, rel=1e-15)
    assert OPTIMIZER.lr > rates[2] > rates[3] > rates[4] > OPTIMIZER.min_lr


def test_llama_style_model_on_asymmetric_plan(record_property):
    """Untied output layer (synced with the final norm in the post-process group), SwiGLU fc1
    (two TP-split blocks: the asymmetric re-shard must keep them apart), rope, GQA, with SP."""
    plan = load_plan(PLANS / "tiny-two-pipelines.yaml")
    plan.model = replace(plan.model, name="llama-tiny", num_query_groups=2,
                         gated_linear_unit=True, position_embedding_type="rope",
                         tie_embeddings=False)
    check_plan_trains_like_one_process(plan.validate(), True, record_property,
                                       "tiny-two-pipelines.yaml with a LLaMA-style model")


def check_plan_trains_like_one_process(plan, sequence_parallel, record_property, label,
                                       distributed_optimizer=False):
    batches = global_batches(plan, ITERS)
    reference, reference_params, reference_rates = run_on_ranks(1, _reference, plan, batches)[0]
    results = run_on_ranks(plan.world_size, _hetero, plan, batches, sequence_parallel,
                           distributed_optimizer, timeout=180)
    ours = results[0][0]
    for rank, (metrics, *_, rates) in enumerate(results):
        assert metrics == ours, f"rank {rank} reports other metrics than rank 0"
        assert rates == reference_rates, (rank, rates, reference_rates)
    assert len(ours) == ITERS
    loss_diffs = [rel(a[0], b[0]) for a, b in zip(ours, reference)]
    norm_diffs = [rel(a[1], b[1]) for a, b in zip(ours, reference)]
    assert max(loss_diffs) <= REL, (loss_diffs, ours, reference)
    assert max(norm_diffs) <= REL, (norm_diffs, ours, reference)
    whole, worst_tensor = check_final_params(plan, results, reference_params)
    for name, value in (("max_loss_rel_diff", max(loss_diffs)),
                        ("max_grad_norm_rel_diff", max(norm_diffs)),
                        ("final_params_rel_diff", whole),
                        ("final_params_worst_tensor_rel_diff", worst_tensor),
                        ("seconds_per_iteration", max(r[3] for r in results) / ITERS)):
        record_property(name, value)
        print(f"{label} sp={sequence_parallel}: {name} = {value:.3g}")
    return reference, reference_rates


# ---- interleaved pipelines (virtual_stages) -----------------------------------------------

INTERLEAVED_PLANS = {   # label: (plan file, interleaved pipelines' chunks, micro-batch counts)
    # both pipelines of TP1 x PP2 interleaved with v = 2, the chunks cut alike and differently:
    # a layer's copies sit in chunk 0 of one pipeline and chunk 1 of the other
    "homogeneous v2 + v2 cut differently": (
        "tiny-homogeneous.yaml", {0: [[(0, 2), (3, 5)], [(2, 3), (5, 6)]],
                                  1: [[(0, 1), (2, 4)], [(1, 2), (4, 6)]]}, {0: 2, 1: 4}),
    # [TP2 | TP1] with v = 2 (the ring closes TP1 -> TP2) next to a plain [TP1]: asymmetric sync
    "[TP2 | TP1] v2 next to plain [TP1]": (
        "tiny-two-pipelines.yaml", {0: [[(0, 2), (3, 5)], [(2, 3), (5, 6)]]}, {0: 4}),
}


@pytest.mark.parametrize("label", ["homogeneous v2 + v2 cut differently",
                                   "[TP2 | TP1] v2 next to plain [TP1]"])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_interleaved_pipeline_trains_like_one_process(label, sequence_parallel,
                                                      record_property):
    """megatron-core's interleaved 1F1B on pipelines of v = 2 chunks per stage, through the
    hetero P2P (the ring's last-to-first boundary included) and the layer-wise sync."""
    plan_file, chunks, counts = INTERLEAVED_PLANS[label]
    if sequence_parallel and "TP2" not in label:
        pytest.skip("no TP > 1 stage")
    plan = interleaved_plan(plan_file, chunks, counts)
    check_plan_trains_like_one_process(plan, sequence_parallel, record_property, label)


def test_three_stage_interleaved_pipeline_trains_like_one_process(record_property):
    """[TP1 | TP1 | TP1] with v = 2, one layer per chunk: the ring closes between stages that
    are not neighbours otherwise (with two stages both boundaries join the same pair)."""
    data = load_plan(PLANS / "tiny-two-pipelines.yaml").to_dict()
    layers = [[[0, 1], [3, 4]], [[1, 2], [4, 5]], [[2, 3], [5, 6]]]
    data["pipelines"] = [
        {"num_microbatches": 3, "virtual_stages": 2,
         "stages": [{"ranks": [r], "layers": chunks} for r, chunks in enumerate(layers)]},
        {"num_microbatches": 1, "stages": [{"ranks": [3], "layers": [0, 6]}]}]
    check_plan_trains_like_one_process(plan_from_dict(data, "<three stages>"), False,
                                       record_property, "[TP1 | TP1 | TP1] v2 next to [TP1]")


def test_interleaved_pipeline_with_distributed_optimizer_trains_like_one_process(
        record_property):
    plan = interleaved_plan(*INTERLEAVED_PLANS["[TP2 | TP1] v2 next to plain [TP1]"])
    check_plan_trains_like_one_process(plan, False, record_property,
                                       "[TP2 | TP1] v2 next to plain [TP1], distributed optimizer",
                                       distributed_optimizer=True)


# ---- stock megatron-core on the homogeneous plan ---------------------------------------------

def _stock_megatron(rank, world, plan, batches, fused_optimizer=None):
    """TP1 x PP2 x DP2 with megatron-core's own parallel_state, GPTModel, schedule, DDP and
    optimizer, from the same layout-independent weights (testing/stock.py)."""
    from megatron_autohet.testing.stock import StockMegatronTrainer

    trainer = StockMegatronTrainer(plan, rank=rank, seed=SEED, optimizer=OPTIMIZER,
                                   fused_optimizer=fused_optimizer)
    steps, _ = scheduled_steps(trainer, batches)
    shards = {name: (trainer.layouts[name], param.detach().clone())
              for name, param in trainer.model.module.named_parameters()}
    trainer.close()
    return [(step.losses, step.grad_norm) for step in steps], shards, trainer.role.stage.ranks


def test_homogeneous_plan_matches_stock_megatron_core():
    """Same losses and grad norms as stock megatron-core; and stock megatron-core's final weights
    equal the reference's: megatron's own parameter groups decay exactly the parameters our
    rule decays (with weight decay 0.1 a norm weight decayed by mistake moves ~1e-3)."""
    plan = load_plan(PLANS / "tiny-homogeneous.yaml")
    batches = global_batches(plan, ITERS)
    stock_results = run_on_ranks(plan.world_size, _stock_megatron, plan, batches, timeout=180)
    stock = [metrics for metrics, *_ in stock_results]
    ours = run_on_ranks(plan.world_size, _hetero, plan, batches, timeout=180)[0][0]
    total = plan.num_microbatches_total
    diffs = []
    for step, (loss, grad_norm) in enumerate(ours):
        # the last stages (ranks 2, 3) hold the micro-batch losses of their replica
        stock_loss = sum(sum(stock[r][step][0]) for r in range(plan.world_size)) / total
        stock_norm = stock[0][step][1]
        assert all(s[step][1] == stock_norm for s in stock)
        diffs.append((rel(loss, stock_loss), rel(grad_norm, stock_norm)))
    print(f"vs stock megatron-core: max loss / grad-norm rel diff "
          f"{max(d[0] for d in diffs):.2e} / {max(d[1] for d in diffs):.2e}")
    assert max(max(d) for d in diffs) <= REL, diffs
    _, reference_params, _ = run_on_ranks(1, _reference, plan, batches)[0]
    whole, worst = check_final_params(plan, stock_results, reference_params)
    print(f"stock megatron-core vs reference: final params rel diff {whole:.2e} "
          f"(worst tensor {worst:.2e})")


def _kernel_calls(rank, world, run, *args, **kwargs):
    """``run``'s result on this rank and how many times torch's fused AdamW kernel
    (``torch._fused_adamw_``, which torch's AdamW looks up at every fused step) was called."""
    kernel, calls = torch._fused_adamw_, [0]

    def counted(*a, **k):
        calls[0] += 1
        return kernel(*a, **k)

    torch._fused_adamw_ = counted
    try:
        return run(rank, world, *args, **kwargs), calls[0]
    finally:
        torch._fused_adamw_ = kernel


def test_stock_baseline_steps_with_the_runtimes_fused_adamw():
    """On CUDA the runtime steps with torch's fused AdamW and so does the stock baseline
    (testing/stock.py sets megatron's AdamW groups to it), forced here on the CPU: with the
    switch on, every rank's steps call torch's fused kernel (once per parameter group at each
    iteration; without it, never), and stock's fused run matches ours, fused too, as closely as
    foreach runs do. (Whether the fused kernel rounds differently from the foreach one depends
    on the CPU's kernels, so the kernel's calls are counted rather than its results compared.)"""
    plan = load_plan(PLANS / "tiny-homogeneous.yaml")
    batches = global_batches(plan, ITERS)
    total = plan.num_microbatches_total

    def stock_run(fused):
        results = run_on_ranks(plan.world_size, _kernel_calls, _stock_megatron, plan, batches,
                               fused_optimizer=fused, timeout=180)
        stock = [metrics for (metrics, *_), _ in results]
        return ([(sum(sum(stock[r][step][0]) for r in range(plan.world_size)) / total,
                  stock[0][step][1]) for step in range(ITERS)], [calls for _, calls in results])

    def every_step(calls: list[int]) -> bool:
        return all(n > 0 and n % ITERS == 0 for n in calls)

    stock_fused, stock_calls = stock_run(True)
    assert every_step(stock_calls), stock_calls
    assert stock_run(False)[1] == [0] * plan.world_size
    results = run_on_ranks(plan.world_size, _kernel_calls, _hetero, plan, batches,
                           fused_optimizer=True, timeout=180)
    assert every_step([calls for _, calls in results]), results
    ours = results[0][0][0]
    diffs = [max(rel(x[0], y[0]), rel(x[1], y[1])) for x, y in zip(ours, stock_fused)]
    print(f"fused AdamW, ours vs stock megatron-core: max relative difference {max(diffs):.2e}")
    assert max(diffs) <= REL, diffs


# ---- activation recompute and evaluation -------------------------------------------------------

EVAL_AFTER = {2: 2, 4: 2}          # iteration -> validation global batches evaluated after it


def _eval_batches(plan) -> dict[int, list[dict]]:
    fresh = global_batches(plan, sum(EVAL_AFTER.values()), seed=1)
    out, used = {}, 0
    for iteration, count in EVAL_AFTER.items():
        out[iteration], used = fresh[used:used + count], used + count
    return out


def _reference_with_eval(rank, world, plan, batches, evals):
    from megatron_autohet.testing.reference import run_reference
    from megatron_autohet.runtime.stage_model import plan_padded_vocab_size

    steps = run_reference(plan.model, batches, micro_batch_size=plan.micro_batch_size, seed=SEED,
                          optimizer=OPTIMIZER, padded_vocab=plan_padded_vocab_size(plan),
                          eval_batches=evals)
    return [(s.loss, s.grad_norm, s.eval_loss) for s in steps]


def _hetero_with_eval(rank, world, plan, batches, evals):
    """train_step per batch, trainer.evaluate where asked; counts the forward calls of this
    rank's transformer layers during training (full recompute runs each twice)."""
    from megatron_autohet.runtime.optimizer import make_lr_scheduler
    from megatron_autohet.runtime.stage_model import stage_chunks
    from megatron_autohet.runtime.trainer import HeteroTrainer

    trainer = HeteroTrainer(plan, plan.model, rank=rank, seed=SEED, optimizer=OPTIMIZER)
    calls = {"train": 0}
    counting = [True]

    def count(module, args, output):
        if counting[0]:
            calls["train"] += 1

    layers = [layer for chunk in stage_chunks(trainer.model) for layer in chunk.decoder.layers]
    for layer in layers:
        layer.register_forward_hook(count)
    scheduler = make_lr_scheduler(trainer.optimizer, OPTIMIZER, len(batches),
                                  plan.global_batch_size)
    steps = []
    for iteration, batch in enumerate(batches, start=1):
        metrics = trainer.train_step(batch)
        scheduler.step(plan.global_batch_size)
        counting[0] = False
        eval_loss = trainer.evaluate(evals[iteration]) if iteration in evals else None
        counting[0] = True
        steps.append((metrics.loss, metrics.grad_norm, eval_loss))
    layer_forwards = len(layers) * trainer.state.role.stage.num_microbatches * len(batches)
    return steps, calls["train"] / layer_forwards


@pytest.mark.parametrize("interleaved", [False, True], ids=["plain", "interleaved"])
def test_recompute_and_evaluation_match_one_process(interleaved):
    """The plan's activation_recompute (megatron-core's full recompute, every layer's forward
    runs again in backward) trains like the reference (fp32, 1e-5), and the forward-only
    evaluation over the plan's pipelines equals the reference's forward loss on the same
    validation batches with the same weights; also with the first pipeline interleaved
    (megatron's interleaved schedule forward-only)."""
    plan = (interleaved_plan(*INTERLEAVED_PLANS["[TP2 | TP1] v2 next to plain [TP1]"])
            if interleaved else load_plan(PLANS / "tiny-two-pipelines.yaml"))
    plan = replace(plan, activation_recompute=True)
    batches, evals = global_batches(plan, 4), _eval_batches(plan)
    reference = run_on_ranks(1, _reference_with_eval, plan, batches, evals)[0]
    results = run_on_ranks(plan.world_size, _hetero_with_eval, plan, batches, evals, timeout=180)
    ours = results[0][0]
    assert all(steps == ours for steps, _ in results)       # the same metrics on every rank
    for (loss, norm, eval_loss), (ref_loss, ref_norm, ref_eval) in zip(ours, reference):
        assert rel(loss, ref_loss) <= REL and rel(norm, ref_norm) <= REL
        assert (eval_loss is None) == (ref_eval is None)
        if eval_loss is not None:
            assert rel(eval_loss, ref_eval) <= REL, (eval_loss, ref_eval)
    assert [e is not None for *_, e in ours] == [False, True, False, True]
    assert ours[1][2] != ours[3][2]                             # fresh batches, moved weights
    # two forward calls per layer and micro-batch while training: the recompute ran
    assert {forwards for _, forwards in results} == {2.0}


# ---- the distributed optimizer (--use-distributed-optimizer) ---------------------------------

DISTRIBUTED_OPTIMIZER_PLANS = [
    "tiny-two-pipelines.yaml",   # symmetric and TP2 buckets, groups of two holders
    "tiny-three-pipelines.yaml", # groups of 2, 3 and 5 (the tied embedding): padded shards
    "tiny-tp-change.yaml",       # asymmetric buckets: shards of the full-size staging buffer
]


@pytest.mark.parametrize("plan_file", DISTRIBUTED_OPTIMIZER_PLANS)
def test_distributed_optimizer_trains_like_one_process(plan_file, record_property):
    """Master weights and Adam moments sharded over each bucket's holders (reduce-scatter,
    AdamW on the shard, all-gather): the same losses, grad norms and final weights."""
    plan = load_plan(PLANS / plan_file)
    check_plan_trains_like_one_process(plan, False, record_property,
                                       f"{plan_file} --use-distributed-optimizer",
                                       distributed_optimizer=True)


def test_distributed_optimizer_on_symmetric_tp2_replicas(record_property):
    """Two one-stage TP2 pipelines with sequence parallelism: symmetric TP2 buckets, where every
    TP rank's group holds the TP-replicated layernorms (the norm counts them once) and the
    sequence-parallel partial gradients are summed over TP before the reduce-scatter."""
    data = load_plan(PLANS / "tiny-two-pipelines.yaml").to_dict()
    data["cluster"] = "local-8"
    data["ranks"] = [{"rank": r, "node": "a100", "local_rank": r, "gpu": "A100-80GB"}
                     for r in range(4)]
    data["pipelines"] = [{"num_microbatches": 2, "stages": [{"ranks": [0, 1], "layers": [0, 6]}]},
                         {"num_microbatches": 2, "stages": [{"ranks": [2, 3], "layers": [0, 6]}]}]
    plan = plan_from_dict(data, "two TP2 replicas")
    check_plan_trains_like_one_process(plan, True, record_property,
                                       "two TP2 replicas --use-distributed-optimizer",
                                       distributed_optimizer=True)
