"""The training objective: one micro-batch's loss.

Iteration loss = the mean over all micro-batches of the global batch of this masked-token mean of
the per-token cross-entropy; each micro-batch's backward is scaled by 1/M (M micro-batches in the
global batch, whichever pipeline trains them), so the gradient is that of the iteration loss for
any layout. The trainer and the single-process reference (megatron_autohet.testing.reference) use
this one definition.
"""

from __future__ import annotations

import torch


def masked_token_mean(per_token_loss: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """One micro-batch's loss: cross-entropy averaged over the tokens the mask keeps."""
    mask = loss_mask.reshape(-1).float()
    return torch.sum(per_token_loss.float().reshape(-1) * mask) / mask.sum().clamp(min=1.0)
