"""checkpoint/state.py saves and restores every RNG a rank draws from: torch's CPU generator,
megatron's model-parallel streams and, on a GPU, the default CUDA generator (random ops outside
the tracker's forks draw from it: without it a resume with dropout is not bit-exact on GPUs).
tests/runtime/test_dropout.py proves the bit-exact resume on the CPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from helpers.dist_utils import run_on_ranks
from megatron_autohet.checkpoint.state import RNG_KEY, apply_loaded, rng_sharded_object

pytestmark = pytest.mark.integration

WORLD = 1


def _trainer(device: str):
    """What the RNG save and restore read of a trainer (no parameters)."""
    return SimpleNamespace(device=torch.device(device), model=torch.nn.Module(),
                           distributed_optimizer=False,
                           masters=SimpleNamespace(by_name={}, write_back=lambda: None),
                           state=SimpleNamespace(role=SimpleNamespace(rank=0)))


def _round_trip(rank, world, device: str) -> tuple[set[str], torch.Tensor, torch.Tensor]:
    """The saved keys, and the draws after the save and after the restore."""
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(7, tp_rank=0, ep_rank=0, etp_rank=0)
    trainer = _trainer(device)
    saved = rng_sharded_object(trainer, WORLD).data
    after_save = torch.rand(4, device=device)
    torch.rand(4, device=device)                           # training goes on
    loaded = {RNG_KEY: saved, "iteration": 0, "model": {}}
    apply_loaded(trainer, None, loaded, load_optim=False)
    return set(saved), after_save.cpu(), torch.rand(4, device=device).cpu()


def test_cpu_generator_round_trips():
    keys, after_save, after_restore = run_on_ranks(WORLD, _round_trip, "cpu")[0]
    assert keys == {"torch", "model_parallel"}
    assert torch.equal(after_save, after_restore)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA generator needs CUDA")
def test_cuda_generator_round_trips():
    keys, after_save, after_restore = run_on_ranks(WORLD, _round_trip, "cuda")[0]
    assert keys == {"torch", "model_parallel", "cuda"}
    assert torch.equal(after_save, after_restore)
