"""Multi-node data: megatron-core builds the dataset's indices on global rank 0
only and the other ranks read them from the cache, so every node must see rank 0's cache. Two
processes with different data directories stand for two nodes with their own disks."""

from __future__ import annotations

import pytest
from pathlib import Path

from helpers.dist_utils import run_on_ranks
from megatron_autohet.data.batches import DataOptions, index_cache_dir, open_global_batches
from megatron_autohet.errors import JobConfigError

pytestmark = pytest.mark.integration


def _open(rank, world_size, tmp: Path, shared: bool):
    options = DataOptions(seq_length=64, global_batch_size=8, num_iterations=2,
                          data_dir=str(tmp / ("shared" if shared else f"node{rank}")))
    try:
        batches, _ = open_global_batches(options, 512, local_rank=0)
    except JobConfigError as err:
        return str(err)
    return len(batches), sorted(p.name for p in index_cache_dir(options).iterdir())


def test_a_node_without_rank_0s_index_cache_stops_the_job_in_one_line(tmp_path):
    """Without the check rank 1 fails inside megatron-core on a missing .npy of the index."""
    first, second = run_on_ranks(2, _open, tmp_path, False)
    assert first == second                          # every rank raises the same line
    assert first.startswith("<input>: field '--data-dir': index cache "
                            f"{tmp_path / 'node0' / 'index-cache'} of global rank 0: ranks [1] "
                            "(on ")
    assert "a shared file system" in first and "$AUTOHET_DATA_DIR" in first


def test_a_shared_index_cache_opens_on_every_rank(tmp_path):
    first, second = run_on_ranks(2, _open, tmp_path, True)
    assert first == second
    length, names = first
    assert length >= 2                      # a whole epoch of global batches
    assert names and not [n for n in names if n.startswith(".autohet-shared")]   # marker gone
