"""--lr-warmup-fraction: megatron-core's scheduler warms up over the fraction of the decay
samples, as Megatron-LM's get_optimizer_param_scheduler computes it."""

import pytest
import torch

from megatron_autohet.errors import ConfigError
from megatron_autohet.runtime.optimizer import OptimizerSettings, make_lr_scheduler


def _learning_rates(settings: OptimizerSettings, iters: int, batch: int) -> list[float]:
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=settings.lr)
    scheduler = make_lr_scheduler(optimizer, settings, iters, batch)
    rates = []
    for _ in range(iters):
        scheduler.step(batch)
        rates.append(optimizer.param_groups[0]["lr"])
    return rates


@pytest.mark.unit
def test_a_warmup_fraction_is_that_share_of_the_decay_in_samples():
    # a quarter of 8 iterations of 4 samples: the same schedule as 2 warm-up iterations
    assert _learning_rates(OptimizerSettings(lr=1e-3, lr_warmup_fraction=0.25), 8, 4) == \
        _learning_rates(OptimizerSettings(lr=1e-3, lr_warmup_iters=2), 8, 4)
    # of --lr-decay-iters when given; 0.15 x 10 x 4 = 6 samples, not a whole iteration
    rates = _learning_rates(OptimizerSettings(lr=1e-3, lr_warmup_fraction=0.15,
                                              lr_decay_iters=10, lr_decay_style="constant"), 8, 4)
    assert rates[0] == pytest.approx(1e-3 * 4 / 6) and rates[1:] == [1e-3] * 7


@pytest.mark.unit
def test_a_warmup_fraction_with_warmup_iters_is_refused_as_in_megatron_lm():
    with pytest.raises(ConfigError, match="'--lr-warmup-fraction': given with --lr-warmup-iters"):
        OptimizerSettings(lr=1e-3, lr_warmup_iters=1, lr_warmup_fraction=0.1).validate(10)
    with pytest.raises(ConfigError, match="'--lr-warmup-fraction': got 1.0"):
        OptimizerSettings(lr=1e-3, lr_warmup_fraction=1.0).validate(10)
