"""An idle member measures its GPU (plan_switch.py ``measure_idle_gpu``): megatron-core's
layer, embedding and output layer at TP 1 and the plan's micro-batch and sequence, measured in
a child process as ``autohet profile`` measures, posted on the members' store; the deciding
rank reads what the members idle in its plan posted (``Members.idle_measured``), which each
window's re-plan prices their types on (tests/planner/test_adapt.py shows what that changes)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from helpers.training import PLANS
from helpers.training import plan as load_test_plan
from megatron_autohet.job import TrainOptions
from megatron_autohet.plan import plan_from_dict
from megatron_autohet.plan_switch import Members, job_members, measure_idle_gpu
from megatron_autohet.runtime.optimizer import OptimizerSettings
from megatron_autohet.spec.cluster import load_cluster

pytestmark = pytest.mark.integration

CLUSTER = load_cluster(PLANS.parent / "clusters" / "local-4.yaml")
OPTIONS = TrainOptions(iters=1, seed=1, optimizer=OptimizerSettings(lr=1e-3))


def _plan_on_h800():
    data = load_test_plan("tiny-two-pipelines").to_dict()
    data["ranks"] = [{"rank": 0, "node": "h800", "local_rank": 0, "gpu": "H800"}]
    data["pipelines"] = [{"num_microbatches": 4, "stages": [{"ranks": [0], "layers": [0, 6]}]}]
    data.pop("predicted", None)
    return plan_from_dict(data, "<h800>")


def test_an_idle_member_measures_its_gpu_for_the_re_plans(capfd, monkeypatch):
    # a member is a torchrun worker: its measuring processes must not meet on the agent's store
    # (with it they waited there for ever: every measurement's rank 0 under one key)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    plan = _plan_on_h800()
    gpus = job_members(plan, CLUSTER, "<h800>", "<local-4>")
    types = {(d.node, d.local_rank): d.gpu for d in CLUSTER.devices()}
    store = dist.HashStore()
    members = [Members(store, i, gpus, "gloo", tuple(types[g] for g in gpus))
               for i in range(len(gpus))]
    h20 = next(m for m in members if m.gpu == ("h20", 0))
    assert members[0].idle_measured(plan) is None           # none has measured yet
    measure_idle_gpu(h20, plan.model, plan, OPTIONS)
    profile = members[0].idle_measured(plan)
    (entry,) = profile.entries.values()
    assert entry.key == ("H20", 1, plan.micro_batch_size, plan.seq_length)
    assert entry.layer.source == "measured" and entry.layer.forward_s > 0
    assert entry.layer.param_count > 0 and entry.output.backward_s > 0
    assert " adapt: GPU h20:0 (H20), idle in this plan, measured itself: a layer " \
        in capfd.readouterr().out
    # the H800 trains in the plan: what it posted would not be an idle GPU's
    measure_idle_gpu(members[0], plan.model, plan, OPTIONS)
    assert set(members[0].idle_measured(plan).entries) == {entry.key}
