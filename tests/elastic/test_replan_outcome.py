"""How a re-plan ends reaches every worker of an elastic job at once (elastic/worker.py): no
plan for the fleet present (a bf16 job left with a V100 only) stops the job with the re-planning
rank's line on every rank - in a new round and in the in-process re-plan after a notice - and a
GPU the in-process re-plan leaves idle keeps its worker as a standby instead of a restart. Two
or three gloo ranks, no training."""

from __future__ import annotations

import os

import pytest

from helpers.dist_utils import run_on_ranks
from helpers.training import plan as proof_plan
from megatron_autohet.plan import plan_from_dict
from megatron_autohet.system.ports import free_port
from megatron_autohet.spec.cluster import cluster_from_dict

# gloo processes and a re-plan each
pytestmark = pytest.mark.integration

NODES = {"h800": "H800", "v100": "V100-32GB", "a100": "A100-80GB"}
TEMPLATE = cluster_from_dict({"name": "three", "inter_node_bandwidth_gbs": 25, "nodes": [
    {"name": n, "gpu": gpu, "gpus": 1} for n, gpu in NODES.items()]})


def _plan(nodes: list[str]):
    """The tiny model on one-GPU ``nodes``, one data-parallel one-stage pipeline each."""
    data = proof_plan("tiny-homogeneous").to_dict()
    data["ranks"] = [{"rank": r, "node": n, "local_rank": 0, "gpu": NODES[n]}
                     for r, n in enumerate(nodes)]
    data["pipelines"] = [{"num_microbatches": 2, "stages": [{"ranks": [r], "layers": [0, 6]}]}
                         for r in range(len(nodes))]
    data["global_batch_size"] = 2 * len(nodes) * data["micro_batch_size"]
    data["predicted"] = {}
    return plan_from_dict(data, "<test plan>")


def _worker(rank: int, world_size: int, node: str, plan, local_rank: int = 0):
    """A bf16 job's worker on ``node``'s GPU ``local_rank`` (torchrun's rank ``rank``)."""
    from megatron_autohet.elastic.worker import ElasticWorker
    from megatron_autohet.job import TrainOptions
    from megatron_autohet.runtime.optimizer import OptimizerSettings

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank),
                      AUTOHET_NODE=node, AUTOHET_GPU=NODES[node], AUTOHET_LOCAL_ADDR="127.0.0.1")
    return ElasticWorker(initial_plan=plan, template=TEMPLATE, model=plan.model,
                         options=TrainOptions(iters=4, seed=0, precision="bf16",
                                              optimizer=OptimizerSettings(lr=1e-4)),
                         notice_file=None, events_jsonl=None)


def _members(plan):
    from megatron_autohet.elastic.fleet import Member

    return [Member(i.node, i.gpu, i.local_rank) for i in plan.ranks]


def _in_process_no_plan(rank, world_size):
    """v100 (rank 0, the first that stays, re-plans) and h800, whose notice came: the fleet
    that stays has no GPU that trains bf16."""
    from megatron_autohet.elastic.worker import NoPlan

    plan = _plan(["v100", "h800"])
    worker = _worker(rank, world_size, plan.ranks[rank].node, plan)
    try:
        worker._replan_in_process(plan, rank, _members(plan), ["h800"], 3)
    except NoPlan as failed:
        return failed.line
    return None


def test_no_plan_after_a_notice_stops_every_rank_with_the_replanners_line():
    lines = run_on_ranks(2, _in_process_no_plan, timeout=120)
    assert lines[0] == lines[1]
    assert lines[0].startswith("no plan for the fleet present, v100 (1 x V100-32GB): ")
    assert "bf16" in lines[0] and lines[0].endswith("(iteration 3 is saved on v100)")


def _new_round_no_plan(rank, world_size, port):
    """A new round of v100's two GPUs (torchrun's ranks 0 and 1) for the job's plan on v100 and
    h800: no GPU of the fleet present trains bf16; rank 0 re-plans."""
    import torch.distributed as dist

    from megatron_autohet.elastic.worker import NoPlan

    plan = _plan(["v100", "h800"])
    worker = _worker(rank, world_size, "v100", plan, local_rank=rank)
    store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, wait_for_workers=False)
    try:
        worker.agree(store)
    except NoPlan as failed:
        line = failed.line
    else:
        line = None
    dist.barrier()                      # rank 0's store outlives rank 1's read
    return line


def test_no_plan_in_a_new_round_reaches_every_rank():
    lines = run_on_ranks(2, _new_round_no_plan, free_port(), timeout=120)
    assert lines[0] == lines[1]
    assert lines[0].startswith("no plan for the fleet present, v100 (2 x V100-32GB): ")
    assert lines[0].endswith("(no checkpoint step yet)")


def _in_process_standby(rank, world_size):
    """h800 (rank 0) leaves; v100 (rank 1: the first that stays, so it re-plans and hosts the new
    store) and a100 stay, and the bf16 re-plan trains on a100 alone. v100 waits as a standby
    until a100's worker finishes the job."""
    import torch.distributed as dist

    from megatron_autohet.elastic.fleet import plan_ranks

    plan = _plan(["h800", "v100", "a100"])
    node = plan.ranks[rank].node
    worker = _worker(rank, world_size, node, plan)
    warm = worker._replan_in_process(plan, rank, _members(plan), ["h800"], 3)
    outcome = None
    if warm is not None:
        new, members, store, hosting = warm
        ranks = dict(zip((m.node for m in members), plan_ranks(new, members)))
        if ranks[node] is None:
            ended = worker._idle(store, host=hosting, expected=len(members))
        else:
            ended = worker._finish(store, 7, host=hosting, expected=len(members))
        outcome = (ranks, hosting, ended, int(store.add("autohet/done", 0)))
    dist.barrier()                      # v100's store outlives the others' reads
    return node, outcome


def test_a_gpu_the_in_process_replan_leaves_idle_waits_as_a_standby():
    h800, v100, a100 = run_on_ranks(3, _in_process_standby, timeout=180)
    assert h800 == ("h800", None)                   # the leaving node's worker ends
    ranks = {"v100": None, "a100": 0}               # no restart: the same workers train on
    assert v100 == ("v100", (ranks, True, 0, 2))    # the standby hosts the store, sees both done
    assert a100[0] == "a100" and a100[1][:3] == (ranks, False, None)


def test_a_node_the_cluster_file_contradicts_is_no_plan_either(monkeypatch):
    """h800 reports an A100: the round's rank 0 stops the job with the cluster file's line (it
    raised a ConfigError that torchrun restarted forever)."""
    from megatron_autohet.elastic.fleet import Member
    from megatron_autohet.elastic.worker import NoPlan

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "AUTOHET_NODE", "AUTOHET_GPU",
                "AUTOHET_LOCAL_ADDR"):                  # restored after the test: _worker sets them
        monkeypatch.setenv(key, "")
    plan = _plan(["v100", "h800"])
    worker = _worker(0, 2, "v100", plan)
    with pytest.raises(NoPlan, match=r"^no plan for the fleet present, v100 \(1 x V100-32GB\), "
                       r"h800 \(1 x A100-80GB\): three: field 'nodes.h800.gpu': H800, but the "
                       r"node reports A100-80GB .*\(no checkpoint step yet\)$"):
        worker._decide([Member("v100", "V100-32GB", 0), Member("h800", "A100-80GB", 0)], [])
