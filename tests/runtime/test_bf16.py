"""bf16 mixed precision (Megatron-LM's ``--bf16``): heterogeneous plans against the bf16 reference.

The runtime and testing/reference.py both train in bf16 with fp32 main gradients, fp32 master
weights and fp32 Adam state. What can differ between them is only the ORDER of arithmetic:

* fp32 sums: the main gradients of different micro-batches and pipelines are added in another
  order (GradSync's all-reduces). fp32 has 24 bits of mantissa: relative differences ~1e-7.
* bf16 sums: a TP stage computes a row-parallel linear as partial products rounded to bf16 and
  all-reduced in bf16, where the reference rounds one full product; a tied embedding whose two
  uses sit on different stages is summed in fp32 instead of bf16 by autograd. bf16 keeps 8
  significant bits: unit roundoff u = 2**-9 ~ 2e-3 per rounded value.
* After the first weight update, the fp32 masters of two runs differ in their last bits, and
  rounding them to bf16 flips single weights by one bf16 ulp (2u relative). From then on two bf16
  runs differ at the level of bf16 rounding, which is also the size of the gap between bf16 and
  fp32 training of this tiny model (measured: losses 1e-5..2e-5 relative apart, grad norms 1e-3
  to 4e-3): no tolerance can separate "bf16 in another order" from "fp32" after an update.

So the proof is in two parts:

1. TP1 heterogeneous plan (tiny-three-pipelines: pipelines of 1, 2 and 2 stages with 1, 2 and 3
   micro-batches) BEFORE the weights first change (iteration 1 trains with the warm-up's learning
   rate 0, so iterations 1 and 2 see the same bf16 weights): every micro-batch runs exactly the
   reference's bf16 operations (P2P moves bf16 bits unchanged), so each loss is bit-identical and
   the grad norm differs only by fp32 sums, within ``PRE_UPDATE_NORM_REL`` = 1e-5 (50 fp32 ulps).
   The same comparison between the fp32 and the bf16 reference shows 1e-6 and 5e-6 loss gaps
   and grad-norm gaps of 1.1e-5 and 3.4e-4 in iterations 1 and 2 (with torch SDPA as core
   attention, whose CPU kernel accumulates bf16 attention in fp32; megatron's unfused bf16
   softmax made the gap ~7e-4 in both), the larger 34x the tolerance: the tolerance can fail,
   and it fails when the main gradients are accumulated in bf16 instead of fp32 (checked when
   the test was written).
2. Every iteration of both a TP1 and a TP-changing plan (tiny-tp-change: TP2 -> TP1 -> TP2,
   bf16 P2P between TP degrees, asymmetric gradient sync) within bf16 bounds: the loss, a mean
   of ~15k fp32 cross-entropies of bf16 logits whose rounding differences are independent,
   within ``LOSS_REL`` = u / 32 ~ 6e-5 relative; the grad norm, the norm of ~400k gradients each
   within a few u of the other's, within ``NORM_REL`` = 2u ~ 4e-3. These catch any real defect
   (a lost write-back, a wrongly synced or scaled gradient, a P2P dtype error: all O(1e-2) or
   more), not the difference to fp32.

Plus a 50-iteration loss curve of bf16 within 1% of fp32 on learnable data.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from megatron_autohet.plan import load_plan
from megatron_autohet.spec.precision import BF16, FP32
from helpers.dist_utils import run_on_ranks
from helpers.training import LOSS_REL, NORM_REL, OPTIMIZER, SEED, global_batches, scheduled_steps

pytestmark = pytest.mark.integration

PLANS = Path(__file__).resolve().parents[2] / "configs" / "plans"
ITERS = 3
PRE_UPDATE_ITERS = 2                 # warm-up: iteration 1's step has learning rate 0
PRE_UPDATE_NORM_REL = 1e-5


def _reference(rank, world, plan, batches, precision, optimizer=OPTIMIZER, model=None):
    from megatron_autohet.testing.reference import run_reference

    model = model or plan.model
    steps = run_reference(model, batches, micro_batch_size=plan.micro_batch_size, seed=SEED,
                          optimizer=optimizer, padded_vocab=model.padded_vocab_size(
                              {s.tp for p in plan.pipelines for s in p.stages}),
                          precision=precision)
    return [(s.loss, s.grad_norm) for s in steps]


def _hetero(rank, world, plan, batches, precision, distributed_optimizer=False):
    from megatron_autohet.runtime.trainer import HeteroTrainer

    trainer = HeteroTrainer(plan, plan.model, rank=rank, seed=SEED, optimizer=OPTIMIZER,
                            precision=precision, distributed_optimizer=distributed_optimizer)
    assert trainer.model.config.pipeline_dtype == torch.bfloat16    # P2P messages are bf16
    steps, _ = scheduled_steps(trainer, batches)
    return [(m.loss, m.grad_norm) for m in steps]


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.mark.parametrize("distributed_optimizer", [False, True], ids=["", "distopt"])
@pytest.mark.parametrize("plan_file", ["tiny-three-pipelines.yaml", "tiny-tp-change.yaml"])
def test_bf16_heterogeneous_plan_trains_like_the_bf16_reference(plan_file,
                                                                distributed_optimizer):
    """Also with the distributed optimizer (``--bf16 --use-distributed-optimizer``): fp32 master
    shards initialised from the bf16 weights, AdamW on them, bf16 all-gather; AdamW is
    elementwise, so the same tolerances hold."""
    plan = load_plan(PLANS / plan_file)
    batches = global_batches(plan, ITERS)
    reference = run_on_ranks(1, _reference, plan, batches, BF16)[0]
    results = run_on_ranks(plan.world_size, _hetero, plan, batches, BF16, distributed_optimizer,
                           timeout=240)
    ours = results[0]
    assert all(r == ours for r in results), "ranks report different metrics"
    loss_rel = [_rel(a[0], b[0]) for a, b in zip(ours, reference)]
    norm_rel = [_rel(a[1], b[1]) for a, b in zip(ours, reference)]
    assert max(loss_rel) <= LOSS_REL, (loss_rel, ours, reference)
    assert max(norm_rel) <= NORM_REL, (norm_rel, ours, reference)
    if all(s.tp == 1 for p in plan.pipelines for s in p.stages):
        fp32 = run_on_ranks(1, _reference, plan, batches, FP32)[0]
        for i in range(PRE_UPDATE_ITERS):
            assert ours[i][0] == reference[i][0], (i, ours[i], reference[i])
            assert norm_rel[i] <= PRE_UPDATE_NORM_REL, (i, norm_rel, ours, reference)
            assert fp32[i][0] != reference[i][0]
        # the tolerance can fail: fp32 against bf16 is far outside it
        assert max(_rel(fp32[i][1], reference[i][1]) for i in range(PRE_UPDATE_ITERS)) \
            > 20 * PRE_UPDATE_NORM_REL, (fp32, reference)


def learnable_batches(model, rows: int, count: int) -> list[dict]:
    """Sequences of a fixed random permutation of the vocabulary, each from a random start: the
    next token is a function of the current one, so the loss falls from ln(vocab) towards 0."""
    gen = torch.Generator().manual_seed(7)
    vocab, seq = model.vocab_size, model.seq_length
    successor = torch.randperm(vocab, generator=gen)
    out = []
    for _ in range(count):
        tokens = torch.empty(rows, seq + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, vocab, (rows,), generator=gen)
        for t in range(seq):
            tokens[:, t + 1] = successor[tokens[:, t]]
        out.append({"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
                    "loss_mask": torch.ones(rows, seq),
                    "position_ids": torch.arange(seq).expand(rows, seq).contiguous()})
    return out


CURVE_ITERS = 50
CURVE_REL = 0.01


def test_bf16_loss_curve_within_one_percent_of_fp32():
    """50 iterations of the single-process model on learnable data: every bf16 loss within 1%
    of the fp32 loss of the same iteration, on a curve that falls to below half its start (so
    1% is not met by a flat line). A smaller model than the proof plans' (bf16 matmuls on a CPU
    without bf16 units are several times slower than fp32)."""
    plan = load_plan(PLANS / "tiny-homogeneous.yaml")
    model = replace(plan.model, num_layers=2, hidden_size=32, num_attention_heads=2,
                    num_query_groups=2, ffn_hidden_size=128, vocab_size=128, seq_length=32)
    batches = learnable_batches(model, 2 * plan.micro_batch_size, CURVE_ITERS)
    optimizer = replace(OPTIMIZER, lr=1e-2, min_lr=1e-3, lr_warmup_iters=5)
    fp32, bf16 = ([loss for loss, _ in run_on_ranks(1, _reference, plan, batches, precision,
                                                    optimizer, model, timeout=300)[0]]
                  for precision in (FP32, BF16))
    assert fp32[-1] < 0.5 * fp32[0], fp32
    worst = max(_rel(b, f) for b, f in zip(bf16, fp32))
    assert worst <= CURVE_REL, (worst, list(zip(fp32, bf16)))
    assert all(math.isfinite(x) for x in bf16)
