"""--autohet-adapt replan with --cluster: a re-plan gives work to GPUs the first plan left idle.

The plan trains the tiny model on the H800 and the H20 of configs/clusters/local-4.yaml, one
pipeline each, and leaves both A100s idle; with the cluster file the job holds a process on
all four GPUs (plan_switch.py ``Members``): the A100s' wait as members. The windows are
injected (tests/helpers/windows.py: the cost model's stage times, every GPU 1e8 times slower
than priced so that the 30 s a switch is priced at pays back), never the wall clock. The
re-plan of iterations 1-2 is made for the whole cluster (planner/adapt.py ``plan_fleet`` with
``with_idle``): it puts layers on the A100s, its gain holds on iterations 3-4, and the job
switches after iteration 4; the idle members learn the new plan from the old rank 0's
announcement, join its process group and recover iteration 4. From iteration 9 the A100s run
at a twentieth of their speed: once the switch's hold (3 windows) is over, the re-plan of
iterations 11-12, held by 13-14, takes the work off them again, and they wait as members until
the job ends.

The proof: every iteration 1-20 is logged once, with the loss and grad norm of the same plan
trained without adapting: the same bits up to the switch, then within tests/elastic's bound
(another layout sums the global batch's micro-batches in another order); every process ends
with the job. Planning the plan's GPUs only (``with_idle`` off) fails it: no re-plan reaches
the A100s."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from datetime import timedelta

import pytest

import megatron_autohet.runtime.trainer as trainer_module
from helpers.checkpointing import REL
from helpers.dist_utils import free_port, run_on_ranks
from helpers.training import PLANS
from helpers.training import plan as load_test_plan
from helpers.windows import synthetic_window
from megatron_autohet.checkpoint.options import CheckpointOptions
from megatron_autohet.job import TrainOptions
from megatron_autohet.plan import plan_from_dict
from megatron_autohet.plan_switch import Members, job_members, train_adapting
from megatron_autohet.planner.adapt import plan_fleet
from megatron_autohet.runtime.optimizer import OptimizerSettings
from megatron_autohet.runtime.stage_drift import WindowMeter
from megatron_autohet.spec.cluster import load_cluster
from megatron_autohet.spec.gpus import load_gpu_catalog

pytestmark = pytest.mark.e2e

ITERS, WINDOW, SWITCH_AT, SWITCH_BACK = 20, 2, 4, 14
SCALE = 1e8
# from iteration 9 on the A100s run at a twentieth of their speed
SLOW_FROM, SLOW_A100S = 9, {("a100", 0): 0.05, ("a100", 1): 0.05}
CLUSTER = PLANS.parent / "clusters" / "local-4.yaml"


class InjectedWindows(WindowMeter):
    """The cost model's windows of whatever plan runs (module doc)."""

    def add(self, iteration, times):
        report = super().add(iteration, times)         # the real gather, on every rank
        if report is None:
            return None
        fleet = plan_fleet(self.plan, load_gpu_catalog())
        if report.first_iteration >= SLOW_FROM:
            fleet = fleet.with_speeds(SLOW_A100S)
        return synthetic_window(self.plan, fleet, report.first_iteration,
                                report.last_iteration, scale=SCALE)


def _idle_a100s():
    """tiny-two-pipelines' model and batch on the H800 and the H20, one pipeline each."""
    data = load_test_plan("tiny-two-pipelines").to_dict()
    data["ranks"] = [{"rank": 0, "node": "h800", "local_rank": 0, "gpu": "H800"},
                     {"rank": 1, "node": "h20", "local_rank": 0, "gpu": "H20"}]
    data["pipelines"] = [{"num_microbatches": 3, "stages": [{"ranks": [0], "layers": [0, 6]}]},
                         {"num_microbatches": 1, "stages": [{"ranks": [1], "layers": [0, 6]}]}]
    data.pop("predicted", None)
    return plan_from_dict(data, "<idle a100s>")


def _plan_job(rank, world, plan, options):
    return train_adapting(plan, "<idle a100s>", plan.model, options, rank=rank, local_rank=rank)


def _member(rank, world, plan, options, port):
    import torch.distributed as dist

    dist.destroy_process_group()        # the harness's group of every process: not the plan's
    store = dist.TCPStore("127.0.0.1", port, world_size=world, is_master=rank == 0,
                          timeout=timedelta(minutes=10))
    gpus = job_members(plan, load_cluster(CLUSTER), "<idle a100s>", str(CLUSTER))
    members = Members(store, rank, gpus, "gloo")
    last = train_adapting(plan, "<idle a100s>", plan.model, options,
                          rank=members.join_first(plan, options.timeout), local_rank=rank,
                          members=members)
    if dist.is_initialized():
        dist.destroy_process_group()
    # a group of its own for run_on_ranks to destroy
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return last


def _metrics(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_switch_gives_work_to_gpus_the_plan_left_idle(tmp_path, monkeypatch, capfd):
    plan = _idle_a100s()
    assert job_members(plan, load_cluster(CLUSTER), "<p>", "<c>") == (
        ("h800", 0), ("h20", 0), ("a100", 0), ("a100", 1))
    base = TrainOptions(iters=ITERS, seed=1234, optimizer=OptimizerSettings(lr=1e-3),
                        data_dir=str(tmp_path / "data"), measure_window=WINDOW, adapt="off",
                        metrics_jsonl=str(tmp_path / "reference.jsonl"))
    assert run_on_ranks(2, _plan_job, plan, base, timeout=600) == [ITERS] * 2
    reference = {r["iteration"]: r for r in _metrics(tmp_path / "reference.jsonl")}
    capfd.readouterr()

    monkeypatch.setattr(trainer_module, "WindowMeter", InjectedWindows)
    options = replace(base, adapt="replan", cluster=str(CLUSTER),
                      metrics_jsonl=str(tmp_path / "switched.jsonl"),
                      checkpoint=CheckpointOptions(save=str(tmp_path / "ckpt"),
                                                   save_interval=100)).validate()
    # every member ends with the job, the A100s' after training iterations 5-14
    assert run_on_ranks(4, _member, plan, options, free_port(), timeout=900) == [ITERS] * 4
    out = capfd.readouterr().out
    # said at the start and after the switch back
    assert out.count(" adapt: GPUs idle in this plan, each a process waiting for a re-plan to "
                     "use it: a100:0, a100:1") == 2, out
    decisions = re.findall(r"^ adapt: iterations (\d+)-(\d+) \(decided after iteration (\d+)\): "
                           r"(SWITCH|keep)", out, re.M)
    assert [d for d in decisions if d[3] == "SWITCH"] == [
        ("1", "2", "4", "SWITCH"), ("11", "12", "14", "SWITCH")], out
    switched = [line for line in out.splitlines() if "adapt: switched plans" in line]
    assert len(switched) == 2, out
    with capfd.disabled():
        print("\n" + "\n".join(switched))
    onto, off = (line.split(" -> ", 1)[1] for line in switched)
    assert "after iteration 4: 2 pipelines on 2 GPUs [H800 layers 0-6] x3, [H20 layers 0-6] x1" \
        in switched[0] and "A100-80GB" in onto.split(";")[0], switched
    assert f"after iteration {SWITCH_BACK}:" in switched[1] \
        and "A100-80GB" not in off.split(";")[0], switched

    records = _metrics(tmp_path / "switched.jsonl")
    assert [r["iteration"] for r in records] == list(range(1, ITERS + 1))
    diffs = {r["iteration"]: max(abs(r[k] - reference[r["iteration"]][k])
                                 / abs(reference[r["iteration"]][k])
                                 for k in ("lm_loss", "grad_norm")) for r in records}
    print(f"relative differences by iteration: {diffs}")
    assert all(diffs[i] == 0 for i in range(1, SWITCH_AT + 1)), diffs
    assert max(diffs.values()) <= REL, diffs
