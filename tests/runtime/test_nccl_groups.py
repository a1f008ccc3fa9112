"""What gloo hides: the distributed paths that move CPU tensors use explicit gloo groups.

On GPUs the default group is NCCL, which refuses CPU tensors; here every group is gloo. These tests
run the paths under tests/helpers/nccl_semantics.py, which refuses what NCCL would, and run the stop
check while the background checkpoint writer is inside a collective.
"""

from __future__ import annotations

import pytest
import os
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from helpers.dist_utils import run_on_ranks
from megatron_autohet.checkpoint.manifest import (MANIFEST_FILE, FileRecord, Manifest,
                                                  commit_step_dir, partial_dir, read_manifest,
                                                  step_dir_name)
from megatron_autohet.checkpoint.options import CheckpointOptions
from megatron_autohet.elastic.notices import Notice, write_notice
from megatron_autohet.plan import load_plan
from megatron_autohet.runtime.optimizer import OptimizerSettings
from helpers.nccl_semantics import NcclRefusal, nccl_semantics
from helpers.training import two_ranks

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
PLAN = ROOT / "configs/plans/tiny-homogeneous.yaml"       # nodes a100 (ranks 0, 1), h800, h20


def test_the_strict_wrapper_refuses_what_nccl_would():
    """The wrapper itself: a CPU tensor on the harness's default group is refused, on a gloo
    group made inside it is not (the mechanism the tests below rely on)."""
    def each(rank, world_size):
        with nccl_semantics():
            gloo = dist.new_group(backend="gloo")
            flags = torch.ones(2)
            dist.all_reduce(flags, group=gloo)
            refused = []
            for group in (None, dist.group.WORLD):
                try:
                    dist.all_reduce(flags, group=group)
                except NcclRefusal as err:
                    refused.append(str(err))
            return flags.tolist(), refused

    for flags, refused in run_on_ranks(2, each):
        assert flags == [2.0, 2.0]
        assert len(refused) == 2 and "default group" in refused[0]


def _committed_step(root: Path, iteration: int, files: dict[str, bytes]) -> None:
    step = partial_dir(root, iteration)
    step.mkdir(parents=True)
    for name, data in files.items():
        (step / name).write_bytes(data)
    manifest = Manifest(iteration=iteration, items=[], plan={},
                        files={name: FileRecord(name, len(data), 0, "h20")
                               for name, data in files.items()})
    (step / MANIFEST_FILE).write_bytes(manifest.to_json())
    commit_step_dir(root, iteration)


def _notice_then_evacuate(rank, world_size, tmp: Path):
    """One worker of an elastic job after its emergency save: the stop check sees node h20's
    preemption notice, every rank stops, and h20's files go to the nodes that stay."""
    from megatron_autohet.elastic.worker import ElasticWorker, _StopCheck
    from megatron_autohet.job import TrainOptions

    plan = load_plan(PLAN)
    info = plan.ranks[rank]
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(info.local_rank), AUTOHET_NODE=info.node,
                      AUTOHET_GPU=info.gpu)
    options = TrainOptions(iters=4, seed=1, optimizer=OptimizerSettings(lr=1e-3),
                           checkpoint=CheckpointOptions(local_dir=str(tmp / "{node}")),
                           distributed_timeout_minutes=1.0)
    worker = ElasticWorker(initial_plan=plan, template=None, model=plan.model, options=options,
                           notice_file=str(tmp / "notice-{node}.json"), events_jsonl=None)
    with nccl_semantics():
        stop = _StopCheck(worker, None)
        action = stop(4)
        worker._evacuate(plan, rank, stop.requests.decision.leaving, stop.requests.group,
                         stop.deadline)
    return action, stop.leaving_nodes


def test_a_notice_stops_and_evacuates_on_gloo_groups_only(tmp_path):
    """The stop check's flags and the evacuated files are CPU tensors;
    they travel on the stop check's own gloo group, never on the default group (NCCL on GPUs,
    where the first notice would crash the job right after its emergency save)."""
    distcp = os.urandom(5000)
    _committed_step(tmp_path / "h20", 4, {"__3_0.distcp": distcp, ".metadata": b"meta",
                                          "common.pt": b"common"})
    write_notice(tmp_path / "notice-h20.json", Notice("aws", "preempt", None, 1.0, {}))
    results = run_on_ranks(4, _notice_then_evacuate, tmp_path)
    assert results == [("stop", ["h20"])] * 4
    got = [node for node in ("a100", "h800")
           if (tmp_path / node / step_dir_name(4) / "__3_0.distcp").is_file()]
    assert len(got) == 1                            # sent once, to one node that stays
    step = tmp_path / got[0] / step_dir_name(4)
    assert (step / "__3_0.distcp").read_bytes() == distcp
    assert read_manifest(step).iteration == 4       # committed there


def _train_with_stop_check(rank, world_size, plan, tmp: Path, checkpoint: CheckpointOptions,
                           hold_writer: bool):
    """train_job with --exit-signal-handler's stop check (launch.signal_stop_check), every
    StopRequests.check under NCCL's rule. With
    ``hold_writer`` the save of iteration 1 runs a collective on the checkpoint group first, and
    the ranks enter it in opposite orders relative to their stop check of iteration 1: rank 1's
    writer is inside it before rank 1 checks, rank 0's writer enters only after rank 0 checked.
    Sharing one group, the two threads' collectives would pair up crosswise."""
    import megatron_autohet.checkpoint.checkpointer as checkpointer_module
    from megatron_autohet.elastic.stop import StopRequests
    from megatron_autohet.job import TrainOptions, train_job
    from megatron_autohet.launch import signal_stop_check

    writer_inside = threading.Event()
    checked = threading.Event()
    real_write_step = checkpointer_module.write_step

    def held_write_step(state_dict, common, *, iteration, group, **kwargs):
        if iteration == 1:
            if rank == 0:
                checked.wait()
            work = dist.all_reduce(torch.ones(5), group=group, async_op=True)
            writer_inside.set()
            work.wait()
        return real_write_step(state_dict, common, iteration=iteration, group=group, **kwargs)

    real_check = StopRequests.check
    calls = []

    def check(self, iteration):
        if hold_writer and rank == 1 and iteration == 1:
            writer_inside.wait()
        strict.armed = True
        try:
            action = real_check(self, iteration)
        finally:
            strict.armed = False
        if rank == 0 and iteration == 1:
            checked.set()
        calls.append(iteration)
        return action

    if hold_writer:
        checkpointer_module.write_step = held_write_step
    StopRequests.check = check
    options = TrainOptions(iters=3, seed=1, optimizer=OptimizerSettings(lr=1e-3),
                           data_dir=str(tmp / "data"), checkpoint=checkpoint,
                           exit_signal_handler=True, distributed_timeout_minutes=1.0)
    with nccl_semantics() as strict:
        strict.armed = False          # megatron-core trains on the harness's (gloo) group
        last = train_job(plan, "<two ranks>", plan.model, options, rank=rank, local_rank=0,
                         make_stop_check=signal_stop_check(options))
    return last, calls


def test_stop_check_without_checkpointing_uses_a_gloo_group(tmp_path):
    """--exit-signal-handler with no checkpointing: the flags' all-reduce went to the default
    group (NCCL on GPUs); it goes over the stop check's own gloo group."""
    results = run_on_ranks(2, _train_with_stop_check, two_ranks(), tmp_path,
                           CheckpointOptions(), False)
    assert results == [(3, [1, 2, 3])] * 2


def test_stop_check_beside_a_writer_inside_a_collective(tmp_path):
    """--async-save: the writer thread is inside a collective of the checkpoint group on one
    rank and not yet on the other while the training threads run their stop check; each thread
    has its own group, so nothing pairs up crosswise (on one group: a mismatch or a hang)."""
    checkpoint = CheckpointOptions(local_dir=str(tmp_path / "ckpt-{node}"), save_interval=1,
                                   async_save=True, keep=3)
    results = run_on_ranks(2, _train_with_stop_check, two_ranks(), tmp_path, checkpoint, True,
                           timeout=240)
    assert results == [(3, [1, 2, 3])] * 2
    for node in ("a100", "h800"):
        assert read_manifest(tmp_path / f"ckpt-{node}" / step_dir_name(1)).iteration == 1
