"""An elastic job's in-process re-plan starts from the memory the first generation had: the old
trainer, optimizer and buffers are gone before the re-plan and the next
generation's model, not kept alive beside them."""

from __future__ import annotations

import pytest
import gc
import os
from pathlib import Path

import torch

from helpers.dist_utils import run_on_ranks
from megatron_autohet.checkpoint.options import CheckpointOptions
from megatron_autohet.elastic.fleet import Member
from megatron_autohet.elastic.notices import Notice, write_notice
from megatron_autohet.runtime.optimizer import OptimizerSettings
from megatron_autohet.spec.cluster import load_cluster
from helpers.training import two_ranks

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "configs/clusters/local-4.yaml"
SLACK = 1 << 20               # bytes: the tiny model's weights and Adam state are about 5 MB


def live_tensor_bytes() -> int:
    """Bytes of the distinct storages of every tensor the garbage collector tracks, reachable or
    garbage not yet collected (nothing is collected here)."""
    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _preempted_generation(rank, world_size, tmp: Path):
    """One generation of the elastic worker on two nodes: h800 has a preemption notice, so
    every rank stops after iteration 1 and saves it, h800's files go to a100, and a100
    re-plans for itself in this process. Live tensor bytes above the baseline: at the stop
    check (the generation's model alive) and when the re-plan runs."""
    import megatron_autohet.elastic.worker as worker_module
    from megatron_autohet.elastic.stop import StopRequests
    from megatron_autohet.job import TrainOptions

    plan = two_ranks()
    info = plan.ranks[rank]
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(info.local_rank), AUTOHET_NODE=info.node,
                      AUTOHET_GPU=info.gpu, AUTOHET_LOCAL_ADDR="127.0.0.1")
    options = TrainOptions(iters=4, seed=1, optimizer=OptimizerSettings(lr=1e-3),
                           data_dir=str(tmp / "data"),
                           checkpoint=CheckpointOptions(local_dir=str(tmp / "{node}"),
                                                        save_interval=2),
                           distributed_timeout_minutes=1.0)
    worker = worker_module.ElasticWorker(
        initial_plan=plan, template=load_cluster(CLUSTER), model=plan.model, options=options,
        notice_file=str(tmp / "notice-{node}.json"), events_jsonl=None)
    members = [Member(i.node, i.gpu, i.local_rank) for i in plan.ranks]
    measured = {}
    real_check, real_replan = StopRequests.check, worker_module.replan

    def check(self, iteration):
        measured["training"] = live_tensor_bytes() - baseline
        return real_check(self, iteration)

    def replan(*args, **kwargs):
        measured["replan"] = live_tensor_bytes() - baseline
        return real_replan(*args, **kwargs)

    StopRequests.check = check
    worker_module.replan = replan
    gc.collect()
    baseline = live_tensor_bytes()
    ended = worker._generation(plan, rank, members)
    return ended.decision.iteration, ended.warm is not None, measured


def test_the_old_generation_is_freed_before_the_replan(tmp_path):
    write_notice(tmp_path / "notice-h800.json", Notice("aws", "preempt", None, 1.0, {}))
    (stopped, warm, measured), (stopped1, warm1, measured1) = run_on_ranks(
        2, _preempted_generation, tmp_path, timeout=300)
    assert (stopped, warm) == (1, True) and (stopped1, warm1) == (1, False)   # h800 leaves
    assert measured["training"] > 4 * SLACK        # the generation's model and Adam state
    assert measured["replan"] < SLACK              # gone when a100 re-plans
    assert "replan" not in measured1               # the leaving node does not re-plan
