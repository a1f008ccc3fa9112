"""A preemption notice's deadline on the ranks of a job (gloo, two processes): the stop carries
the earliest deadline of the leaving nodes' notices, and the evacuation to the peers starts no
file after the time for copies is up, every rank learning what was left behind.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest

from helpers.dist_utils import run_on_ranks
from megatron_autohet.checkpoint.deadline import Deadline
from megatron_autohet.checkpoint.manifest import (MANIFEST_FILE, FileRecord, Manifest,
                                                  commit_step_dir, committed_steps, partial_dir,
                                                  step_dir_name)
from megatron_autohet.elastic.notices import Notice, write_notice

pytestmark = pytest.mark.integration


def _stop_decision(tmp_path, notices: dict[int, Notice]):
    """Each rank's (action, decision) after one check, rank r's node holding notices[r]."""
    def check(rank, world):
        from megatron_autohet.elastic.stop import StopRequests, stop_group

        path = tmp_path / f"notice-{rank}.json"
        if rank in notices:
            write_notice(path, notices[rank])
        requests = StopRequests(stop_group(timedelta(seconds=60)), notice_file=path)
        return requests.check(5), requests.decision
    return run_on_ranks(2, check)


def test_the_stop_carries_the_earliest_deadline_of_the_leaving_nodes(tmp_path):
    results = _stop_decision(tmp_path, {0: Notice("aws", "preempt", 1000.0, 880.0),
                                        1: Notice("gcp", "preempt", 900.0, 870.0)})
    assert [action for action, _ in results] == ["stop", "stop"]
    assert [(d.leaving, d.deadline_unix) for _, d in results] == [(True, 900.0), (True, 900.0)]


def test_a_notice_without_deadline_and_a_rebalance(tmp_path):
    results = _stop_decision(tmp_path, {0: Notice("azure", "preempt", None, 870.0)})
    assert [(a, d.leaving, d.deadline_unix) for a, d in results] == [("stop", True, None),
                                                                     ("stop", False, None)]
    # A rebalance recommendation is advice: a save, no stop, no deadline.
    (tmp_path / "r").mkdir()
    results = _stop_decision(tmp_path / "r", {1: Notice("aws", "rebalance", None, 870.0)})
    assert results == [("save", None), ("save", None)]


def test_a_preemption_after_a_rebalance_recommendation_is_the_notice(tmp_path):
    """AWS recommends a rebalance to rank 1's node (a save, training goes on), then sends its
    instance-action (the watcher writes it over the recommendation): the next check stops."""
    def check(rank, world):
        from megatron_autohet.elastic.stop import StopRequests, stop_group

        path = tmp_path / f"notice-{rank}.json"
        requests = StopRequests(stop_group(timedelta(seconds=60)), notice_file=path)
        if rank == 1:
            write_notice(path, Notice("aws", "rebalance", None, 870.0))
        first = requests.check(5), requests.check(6)       # acted on once
        if rank == 1:
            write_notice(path, Notice("aws", "preempt", 1000.0, 880.0))
        second = requests.check(7)
        return first, second, requests.decision
    results = run_on_ranks(2, check)
    assert [first for first, _, _ in results] == [("save", None)] * 2
    assert [(second, d.leaving, d.deadline_unix) for _, second, d in results] == [
        ("stop", False, 1000.0), ("stop", True, 1000.0)]


FILES = {".metadata": 10, "__1_0.distcp": 3000, "common.pt": 20, "metadata.json": 30}


def _evacuate(tmp_path, seconds_left):
    """Rank 1 (its node leaves) holds step 8; rank 0 (it stays) holds nothing. Each rank's
    (Moved, the steps committed on its disk, whether a partial step is left there)."""
    def move(rank, world):
        from megatron_autohet.elastic.handover import move_files

        root = tmp_path / f"node{rank}"
        root.mkdir(parents=True)
        if rank == 1:
            staged = partial_dir(root, 8)
            staged.mkdir()
            for name, size in FILES.items():
                (staged / name).write_bytes(bytes(size))
            manifest = Manifest(iteration=8, items=[], plan={}, files={
                name: FileRecord(name, size, 1, "node1") for name, size in FILES.items()})
            (staged / MANIFEST_FILE).write_bytes(manifest.to_json())
            commit_step_dir(root, 8)
        deadline = None if seconds_left is None else Deadline(time.time() + seconds_left, 0.0)
        moved = move_files(root, rank=rank, speaks_for_node=True, receives=rank == 0,
                           group=None, deadline=deadline)
        return moved, committed_steps(root), partial_dir(root, 8).exists()
    return run_on_ranks(2, move)


def test_the_evacuation_starts_nothing_after_the_time_for_copies(tmp_path):
    results = _evacuate(tmp_path, seconds_left=-1)
    for moved, _, _ in results:
        assert moved.bytes == 0
        assert sorted(t.name for t in moved.skipped) == sorted([*FILES, MANIFEST_FILE])
    (_, steps, partial), _ = results
    assert steps == [] and not partial               # nothing arrived: no step, no leftovers


def test_without_deadline_the_evacuation_moves_the_step(tmp_path):
    (moved, steps, partial), _ = _evacuate(tmp_path, seconds_left=None)
    assert moved.skipped == [] and steps == [8] and not partial
    assert sorted(p.name for p in (tmp_path / "node0" / step_dir_name(8)).iterdir()) == \
        sorted([*FILES, MANIFEST_FILE])
