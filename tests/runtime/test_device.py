"""runtime/device.py: the GPU of a local rank among the GPUs a process sees."""

from __future__ import annotations

import threading

import pytest

from megatron_autohet.runtime.device import device_index, enter_device, thread_device

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("local_rank, visible, expected", [
    (0, 8, 0), (3, 8, 3), (7, 8, 7),        # every process sees the node's GPUs: LOCAL_RANK
    (0, 1, 0), (3, 1, 0), (7, 1, 0),        # one GPU per task (Slurm, Kubernetes): device 0
    (3, 2, 1),                              # two per task: the local rank's place among them
])
def test_device_index_is_the_local_rank_among_the_visible_gpus(local_rank, visible, expected):
    assert device_index(local_rank, visible) == expected


@pytest.mark.parametrize("local_rank, visible, message", [
    (0, 0, "no visible GPU"), (-1, 8, "local rank -1 < 0")])
def test_device_index_refuses_what_has_no_gpu(local_rank, visible, message):
    with pytest.raises(ValueError, match=message):
        device_index(local_rank, visible)


def test_a_cpu_process_has_no_device_for_its_threads():
    """On a CPU (no CUDA, or the CPU mode) a background thread enters nothing."""
    device = thread_device()
    assert device is None
    seen = []
    thread = threading.Thread(target=lambda: seen.append(enter_device(device)))
    thread.start()
    thread.join()
    assert seen == [None]
