"""The trainer's loss is masked cross-entropy, computed here without the runtime's definition.

The trainer, the stock baseline and the single-process reference share one loss definition
(runtime/loss.py ``masked_token_mean``), so the equivalence tests cannot catch a wrong
mask: every side would be wrong the same way. This test pins the objective itself: the logits
of the model's own output layer, ``torch.nn.functional.cross_entropy(reduction="none")`` and a
masked mean written out here must give the loss ``HeteroTrainer`` reports, on a plan of two
pipelines with different micro-batch counts (so the per-pipeline scaling is exercised too).
"""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from helpers.dist_utils import run_on_ranks
from megatron_autohet.plan import Pipeline, Plan, RankInfo, Stage
from megatron_autohet.runtime.optimizer import OptimizerSettings
from megatron_autohet.spec.model import load_model

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TINY = load_model(ROOT / "configs" / "models" / "tiny.yaml")
SEQ, MBS, SEED = 16, 2, 1234
COUNTS = (3, 1)                      # micro-batches of pipeline 0 and pipeline 1


def masked_batch() -> dict:
    """4 micro-batches of 2 rows; the mask keeps a different number of tokens in each
    micro-batch (one keeps only 3), so mask errors and per-token vs per-micro-batch means
    give different numbers."""
    gen = torch.Generator().manual_seed(7)
    rows = MBS * sum(COUNTS)
    tokens = torch.randint(0, TINY.vocab_size, (rows, SEQ + 1), generator=gen)
    mask = (torch.rand(rows, SEQ, generator=gen) > 0.4).float()
    mask[2:4] = 0.0
    mask[2, :3] = 1.0
    return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
            "loss_mask": mask, "position_ids": torch.arange(SEQ).expand(rows, SEQ).contiguous()}


def by_hand(logits: torch.Tensor, batch: dict) -> float:
    """Mean over the micro-batches of each one's cross-entropy averaged over its kept tokens."""
    losses = []
    for i in range(sum(COUNTS)):
        rows = slice(i * MBS, (i + 1) * MBS)
        per_token = F.cross_entropy(logits[rows].reshape(-1, logits.shape[-1]).double(),
                                    batch["labels"][rows].reshape(-1), reduction="none")
        mask = batch["loss_mask"][rows].reshape(-1).double()
        losses.append(float((per_token * mask).sum() / mask.sum()))
    return sum(losses) / len(losses)


def _train_one_step(rank, world_size, batch):
    from megatron_autohet.runtime.trainer import HeteroTrainer

    plan = Plan(cluster="test", model=TINY, micro_batch_size=MBS,
                global_batch_size=MBS * sum(COUNTS), seq_length=SEQ,
                ranks=[RankInfo(r, "node", r, "GPU") for r in range(2)],
                pipelines=[Pipeline([Stage([r], (0, TINY.num_layers))], count)
                           for r, count in enumerate(COUNTS)]).validate()
    trainer = HeteroTrainer(plan, TINY, rank=rank, seed=SEED,
                            optimizer=OptimizerSettings(lr=1e-3, lr_decay_style="constant"))
    expected = None
    if rank == 0:       # this rank's stage is the whole model: its output layer's logits
        with torch.no_grad():
            logits = trainer.model(batch["tokens"], batch["position_ids"], None)
        assert logits.shape == (MBS * sum(COUNTS), SEQ, plan.model.padded_vocab_size([1]))
        expected = by_hand(logits, batch)
    return trainer.train_step(batch).loss, expected


def test_trainer_loss_is_masked_cross_entropy():
    batch = masked_batch()
    (loss0, expected), (loss1, _) = run_on_ranks(2, _train_one_step, batch, timeout=120)
    assert loss0 == loss1                                  # every rank reports the same loss
    assert loss0 == pytest.approx(expected, rel=1e-5)
