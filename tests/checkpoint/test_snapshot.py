"""checkpoint/state.py ``snapshot``: host copies that training cannot change, CUDA tensors through
pinned host buffers that the next save of the same layout reuses (scripts/bench_snapshot.py
measures the stall per GB)."""

from __future__ import annotations

import pytest
import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor

from megatron_autohet.checkpoint.state import SnapshotBuffers, snapshot

pytestmark = pytest.mark.unit


def _state_dict(device: str) -> dict:
    tensors = {"a": torch.arange(12, dtype=torch.float32, device=device).view(3, 4),
               "b": torch.ones(5, dtype=torch.bfloat16, device=device),
               # a non-contiguous view, as a TP shard of a larger tensor can be
               "c": torch.arange(20, dtype=torch.float32, device=device).view(4, 5)[:, 1:3]}
    return {"model": {name: ShardedTensor.from_rank_offsets(name, t, replica_id=0)
                      for name, t in tensors.items()}}


def _datas(state_dict: dict) -> dict:
    return {name: entry.data for name, entry in state_dict["model"].items()}


def test_host_tensors_are_cloned():
    state_dict = _state_dict("cpu")
    live = _datas(state_dict)
    snapped = _datas(snapshot(state_dict))
    for name, tensor in live.items():
        assert torch.equal(snapped[name], tensor)
        tensor.add_(1)                                   # training goes on
        assert not torch.equal(snapped[name], tensor), name


def test_buffers_are_reused_while_the_layout_stays():
    buffers = SnapshotBuffers()
    tensors = list(_datas(_state_dict("cpu")).values())
    first = [b.data_ptr() for b in buffers.take(tensors, pin=False)]
    again = buffers.take([t.clone() for t in tensors], pin=False)
    assert [b.data_ptr() for b in again] == first
    assert [(b.shape, b.dtype) for b in again] == [(t.shape, t.dtype) for t in tensors]
    assert all(b.is_contiguous() for b in again)
    grown = tensors[:2] + [torch.zeros(6)]
    assert [b.shape for b in buffers.take(grown, pin=False)] == [t.shape for t in grown]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the pinned path needs CUDA")
def test_cuda_tensors_go_to_reused_pinned_buffers():
    buffers = SnapshotBuffers()
    state_dict = _state_dict("cuda")
    live = _datas(state_dict)
    snapped = _datas(snapshot(state_dict, buffers))
    for name, tensor in live.items():
        assert snapped[name].device.type == "cpu" and snapped[name].is_pinned(), name
        assert torch.equal(snapped[name], tensor.cpu()), name
    second = _datas(snapshot(_state_dict("cuda"), buffers))
    assert [t.data_ptr() for t in second.values()] == [t.data_ptr() for t in snapped.values()]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a GPU job's state dict needs CUDA")
def test_host_copies_beside_cuda_tensors_are_not_copied_again():
    """The distributed optimizer's gathered state is a host copy made for the save."""
    state_dict = _state_dict("cuda")
    gathered = torch.arange(6, dtype=torch.float32)
    state_dict["optimizer"] = {"exp_avg": ShardedTensor.from_rank_offsets("exp_avg", gathered,
                                                                         replica_id=0)}
    assert snapshot(state_dict)["optimizer"]["exp_avg"].data is gathered
