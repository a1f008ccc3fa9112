"""What the training tests share: the proof plans, the seed and optimizer settings of the
equivalence proofs, their random global batches, the tolerances of bf16 against fp32."""

from __future__ import annotations

from pathlib import Path

import torch
import yaml

from megatron_autohet.plan import load_plan, plan_from_dict
from megatron_autohet.runtime.optimizer import OptimizerSettings


PLANS = Path(__file__).resolve().parents[2] / "configs" / "plans"
SEED = 1234
CLIP = 1.0
# iteration lrs: 0 (warm-up start), 3e-3, then cosine down towards 3e-4 (megatron's scheduler)
OPTIMIZER = OptimizerSettings(lr=3e-3, min_lr=3e-4, weight_decay=0.1, clip_grad=CLIP,
                              lr_warmup_iters=1, lr_decay_style="cosine")


def global_batches(plan, count: int, seed: int = 0) -> list[dict]:
    """Random tokens with ~15% of the loss mask off (so micro-batches differ in token count)."""
    gen = torch.Generator().manual_seed(seed)
    rows, seq, vocab = plan.global_batch_size, plan.seq_length, plan.model.vocab_size
    out = []
    for _ in range(count):
        tokens = torch.randint(0, vocab, (rows, seq + 1), generator=gen)
        out.append({"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
                    "loss_mask": (torch.rand(rows, seq, generator=gen) > 0.15).float(),
                    "position_ids": torch.arange(seq).expand(rows, seq).contiguous()})
    return out


def scheduled_steps(trainer, batches) -> tuple[list, list[float]]:
    """train_step per batch with megatron-core's scheduler stepping the trainer's optimizer (as
    `autohet train` does); returns the steps and the learning rate each one used."""
    from megatron_autohet.runtime.optimizer import make_lr_scheduler

    gbs = trainer.plan.global_batch_size
    scheduler = make_lr_scheduler(trainer.optimizer, OPTIMIZER, len(batches), gbs)
    steps, rates = [], []
    for batch in batches:
        rates.append(trainer.optimizer.param_groups[0]["lr"])
        steps.append(trainer.train_step(batch))
        scheduler.step(gbs)                          # megatron counts samples
    return steps, rates


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


# bf16 against the bf16 reference: the loss within 1/32 of bf16's unit roundoff, the grad norm
# within two units (the reduction orders differ between layouts)
BF16_UNIT_ROUNDOFF = 2.0 ** -9
LOSS_REL = BF16_UNIT_ROUNDOFF / 32
NORM_REL = 2 * BF16_UNIT_ROUNDOFF


def plan(name: str):
    return load_plan(PLANS / f"{name}.yaml")


def interleaved_plan(plan_file: str, chunks_by_pipeline: dict, num_microbatches: dict):
    """``plan_file`` with the pipelines named in ``chunks_by_pipeline`` made interleaved: each
    stage's chunk layer ranges as given, and its micro-batch counts changed as given."""
    raw = yaml.safe_load((PLANS / plan_file).read_text())
    for p, stage_chunks in chunks_by_pipeline.items():
        pipe = raw["pipelines"][p]
        pipe["virtual_stages"] = len(stage_chunks[0])
        for stage, chunks in zip(pipe["stages"], stage_chunks):
            stage["layers"] = [list(c) for c in chunks]
    for p, m in num_microbatches.items():
        raw["pipelines"][p]["num_microbatches"] = m
    raw["global_batch_size"] = raw["micro_batch_size"] * sum(
        p["num_microbatches"] for p in raw["pipelines"])
    return plan_from_dict(raw, plan_file)


def two_ranks():
    """tiny-homogeneous on two nodes: two one-stage pipelines, data-parallel (a100, h800)."""
    data = plan("tiny-homogeneous").to_dict()
    data["ranks"] = [dict(data["ranks"][0]), dict(data["ranks"][2], rank=1)]
    data["pipelines"] = [{"num_microbatches": 2, "stages": [{"ranks": [r], "layers": [0, 6]}]}
                         for r in (0, 1)]
    return plan_from_dict(data, "<two ranks>")
