"""CPU mode: megatron-core's CUDA assumptions are mapped to the CPU (runs in forked processes, so
the mode never leaks into the pytest process)."""

import threading

import pytest
import torch

from helpers.dist_utils import RankFailed, run_on_ranks

pytestmark = pytest.mark.integration


def _device_mapping(rank, world):
    from megatron_autohet.runtime.cpu_mode import cpu_mode_enabled, enable_cpu_mode
    enable_cpu_mode()
    enable_cpu_mode()                                                  # idempotent
    out = {"enabled": cpu_mode_enabled()}
    out["zeros"] = torch.zeros(2, device="cuda").device.type
    out["int_device"] = torch.empty(3, device=torch.cuda.current_device()).device.type
    out["torch_device"] = torch.ones(1, device=torch.device("cuda", 0)).device.type
    x = torch.ones(2)
    out["cuda_identity"] = x.cuda() is x
    out["to_cuda"] = x.to("cuda").device.type
    out["to_kw"] = x.to(device="cuda:0", dtype=torch.float64).dtype == torch.float64
    out["type"] = x.type()
    out["type_back"] = x.type("torch.cuda.DoubleTensor").type()
    out["half_type"] = x.half().type()
    torch.cuda.synchronize()

    class Double(torch.autograd.Function):        # the engine runs backward without the mode
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return grad * torch.full((1,), 2.0, device="cuda")

    x = torch.ones(2, requires_grad=True)
    Double.apply(x).sum().backward()
    out["custom_backward"] = x.grad.tolist()

    from megatron.core import tensor_parallel     # activation recompute reruns forward in backward
    tensor_parallel.model_parallel_cuda_manual_seed(5, tp_rank=0, ep_rank=0, etp_rank=0)
    y = torch.ones(3, requires_grad=True)
    recomputed = tensor_parallel.checkpoint(
        lambda t: t * torch.arange(3.0, device="cuda"), False, y)
    recomputed.sum().backward()
    out["recompute"] = y.grad.tolist()

    def in_thread(store, use_helper):
        from megatron_autohet.runtime.cpu_mode import cpu_mode_thread
        try:
            if use_helper:
                with cpu_mode_thread():
                    store.append(torch.zeros(1, device="cuda").device.type)
            else:
                store.append(torch.zeros(1, device="cuda").device.type)
        except Exception as exc:  # noqa: BLE001 - a CPU-only torch refuses cuda tensors
            store.append(type(exc).__name__)

    for use_helper in (False, True):
        store = []
        thread = threading.Thread(target=in_thread, args=(store, use_helper))
        thread.start()
        thread.join()
        out[f"thread_helper_{use_helper}"] = store[0]
    return out


def test_device_arguments_are_mapped_to_cpu():
    out = run_on_ranks(1, _device_mapping)[0]
    assert out["enabled"]
    for key in ("zeros", "int_device", "torch_device", "to_cuda"):
        assert out[key] == "cpu", key
    assert out["cuda_identity"] and out["to_kw"]
    assert out["custom_backward"] == [2.0, 2.0] and out["recompute"] == [0.0, 1.0, 2.0]
    assert out["type"] == "torch.cuda.FloatTensor"                 # what megatron asserts on
    assert out["type_back"] == "torch.cuda.DoubleTensor"           # round trip stays on CPU
    assert out["half_type"] == "torch.cuda.HalfTensor"
    assert out["thread_helper_True"] == "cpu"
    if not torch.cuda.is_available():
        assert out["thread_helper_False"] != "cpu"    # modes are thread-local: the helper matters


def _rng_tracker(rank, world):
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    tensor_parallel.model_parallel_cuda_manual_seed(123, tp_rank=0, ep_rank=0, etp_rank=0)
    tracker = get_cuda_rng_tracker()
    torch.manual_seed(7)
    outside_before = torch.rand(3)
    torch.manual_seed(7)
    with tracker.fork():
        forked_1 = torch.rand(3)
    outside_after = torch.rand(3)                    # default stream untouched by the fork
    with tracker.fork():
        forked_2 = torch.rand(3)                     # the forked stream advanced
    tensor_parallel.model_parallel_cuda_manual_seed(123, tp_rank=0, ep_rank=0, etp_rank=0)
    with get_cuda_rng_tracker().fork():
        forked_again = torch.rand(3)                 # reseeding reproduces it
    return {"class": type(tracker).__name__,
            "default_untouched": torch.equal(outside_before, outside_after),
            "advanced": not torch.equal(forked_1, forked_2),
            "reproducible": torch.equal(forked_1, forked_again)}


def test_rng_tracker_forks_cpu_generator():
    out = run_on_ranks(1, _rng_tracker)[0]
    assert out == {"class": "CpuRNGStatesTracker", "default_untouched": True, "advanced": True,
                   "reproducible": True}


def _megatron_step(rank, world):
    """GPTModel (TP2, dropout on) in megatron's DDP, megatron's optimizer with grad clipping."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                               use_cpu_initialization=True, tensor_model_parallel_size=2)
    model = DistributedDataParallel(
        config, DistributedDataParallelConfig(),
        GPTModel(config, get_gpt_layer_local_spec(), vocab_size=128, max_sequence_length=16))
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=0.1),
                                       [model])
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(16).expand(2, 16)
    losses = []
    for _ in range(2):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        loss = model(tokens, positions, None, labels=tokens).mean()
        loss.backward()
        model.finish_grad_sync()
        ok, grad_norm, _ = optimizer.step()
        losses.append(loss.item())
    parallel_state.destroy_model_parallel()
    return ok, grad_norm, losses


def test_megatron_model_and_optimizer_step_on_cpu():
    results = run_on_ranks(2, _megatron_step)
    ok, grad_norm, losses = results[0]
    assert ok and grad_norm > 0.1                      # clipped to 0.1 afterwards
    assert losses[1] < losses[0]
    assert results[1][1] == pytest.approx(grad_norm, rel=1e-6)   # TP ranks agree on the norm


def test_child_failure_carries_traceback():
    def boom(rank, world):
        if rank == 1:
            raise ValueError("rank one exploded")
        torch.distributed.barrier()                    # rank 0 would hang without the helper

    with pytest.raises(RankFailed, match="rank one exploded"):
        run_on_ranks(2, boom, timeout=60)
