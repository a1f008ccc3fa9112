"""One generation of an elastic job (elastic/worker.py's ElasticWorker) on two gloo ranks, in
the calling rank's process: the harness of the tests of what a generation reports (its windows'
drift events, its dashboard). The plan's first stage predicts far below any machine's time, so
every window drifts by the plan, never by timing."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from helpers.training import two_ranks

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "configs/clusters/local-4.yaml"


def generation_worker(rank: int, world_size: int, tmp: Path, **options):
    """(worker, plan, members) for ``worker._generation(plan, rank, members)``: 4 iterations,
    windows of 2, events in ``tmp/events.jsonl``; ``options``: more TrainOptions fields."""
    from megatron_autohet.elastic.fleet import Member
    from megatron_autohet.elastic.worker import ElasticWorker
    from megatron_autohet.job import TrainOptions
    from megatron_autohet.runtime.optimizer import OptimizerSettings
    from megatron_autohet.spec.cluster import load_cluster

    plan = two_ranks()
    first = plan.pipelines[0]
    plan.pipelines[0] = replace(first, stages=[replace(first.stages[0], predicted_time_s=1e-9)])
    info = plan.ranks[rank]
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(info.local_rank), AUTOHET_NODE=info.node,
                      AUTOHET_GPU=info.gpu, AUTOHET_LOCAL_ADDR="127.0.0.1")
    train = TrainOptions(iters=4, seed=1, optimizer=OptimizerSettings(lr=1e-3),
                         data_dir=str(tmp / "data"), measure_window=2,
                         distributed_timeout_minutes=1.0, **options)
    worker = ElasticWorker(initial_plan=plan, template=load_cluster(CLUSTER), model=plan.model,
                           options=train, notice_file=None,
                           events_jsonl=str(tmp / "events.jsonl"))
    worker.events = worker._log(rank == 0)          # as run() does: the plan's rank 0 reports
    return worker, plan, [Member(i.node, i.gpu, i.local_rank) for i in plan.ranks]
