"""An idle member measures its GPU (plan_switch.py ``measure_idle_gpu``): megatron-core's
layer, embedding and output layer at TP 1 and the plan's micro-batch and sequence, measured in
the member's own process (profiling/measure.py ``measure_in_process``), posted on the members'
store; the deciding rank waits until every member idle in its plan has posted
(``Members.idle_measured``), so each window's re-plan prices their types on the same inputs at
any load (tests/planner/test_adapt.py shows what that changes)."""

from __future__ import annotations

import multiprocessing as mp
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from helpers.dist_utils import free_port
from helpers.training import PLANS
from helpers.training import plan as load_test_plan
from megatron_autohet.job import TrainOptions
from megatron_autohet.plan import plan_from_dict
from megatron_autohet.plan_switch import Members, job_members, measure_idle_gpu
from megatron_autohet.runtime.optimizer import OptimizerSettings
from megatron_autohet.spec.cluster import load_cluster

CLUSTER = load_cluster(PLANS.parent / "clusters" / "local-4.yaml")
OPTIONS = TrainOptions(iters=1, seed=1, optimizer=OptimizerSettings(lr=1e-3))
TYPES = {(d.node, d.local_rank): d.gpu for d in CLUSTER.devices()}


def _plan_on_h800():
    data = load_test_plan("tiny-two-pipelines").to_dict()
    data["ranks"] = [{"rank": 0, "node": "h800", "local_rank": 0, "gpu": "H800"}]
    data["pipelines"] = [{"num_microbatches": 4, "stages": [{"ranks": [0], "layers": [0, 6]}]}]
    data.pop("predicted", None)
    return plan_from_dict(data, "<h800>")


PLAN = _plan_on_h800()
GPUS = job_members(PLAN, CLUSTER, "<h800>", "<local-4>")


def _members(store) -> list[Members]:
    return [Members(store, i, GPUS, "gloo", tuple(TYPES[g] for g in GPUS))
            for i in range(len(GPUS))]


def _idle_member(port: int, index: int, results) -> None:
    """A member's process (forked: torch and megatron-core imported, no process group), idle in
    the plan: measures itself as train_adapting has it do."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(minutes=5))
    member = _members(store)[index]
    before = torch.get_rng_state()
    measure_idle_gpu(member, PLAN.model, PLAN, OPTIONS)
    results.put((dist.is_initialized(), torch.equal(before, torch.get_rng_state())))


@pytest.mark.integration
def test_the_deciding_rank_waits_for_what_the_idle_members_measure_in_their_processes(capfd):
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(minutes=5),
                          wait_for_workers=False)
    deciding = _members(store)[0]                         # the H800: the plan's rank 0
    idle = [i for i, gpu in enumerate(GPUS) if gpu != ("h800", 0)]
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    procs = [ctx.Process(target=_idle_member, args=(port, i, results)) for i in idle]
    for proc in procs:
        proc.start()
    try:
        # every idle member's measurement, waited for (each posts within a minute here)
        profile = deciding.idle_measured(PLAN, timedelta(minutes=4))
        found = [results.get(timeout=60) for _ in procs]
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    out = capfd.readouterr().out
    assert " adapt: waiting for the GPUs idle in this plan to measure themselves: " in out
    assert "WARNING" not in out, out
    # each measured in its own process and left it as it was: no process group, the same draws
    assert found == [(False, True)] * len(idle)
    assert {key[:2] for key in profile.entries} == {("H20", 1), ("A100-80GB", 1)}
    entry = profile.entries[("H20", 1, PLAN.micro_batch_size, PLAN.seq_length)]
    assert entry.layer.source == "measured" and entry.layer.forward_s > 0
    assert entry.layer.param_count > 0 and entry.output.backward_s > 0
    for node, gpu_type in (("h20", "H20"), ("a100", "A100-80GB")):
        assert f" adapt: GPU {node}:0 ({gpu_type}), idle in this plan, measured itself: a " \
            "layer " in out, out
    # the second read waits for nothing
    assert set(deciding.idle_measured(PLAN, timedelta(seconds=1)).entries) == set(
        profile.entries)
    assert " adapt: waiting" not in capfd.readouterr().out


@pytest.mark.unit
def test_a_failed_measurement_is_posted_and_a_missing_one_ends_at_the_safety_net(capfd):
    store = dist.HashStore()
    members = _members(store)
    idle = [m for m in members if m.gpu != ("h800", 0)]
    for member in idle[:-1]:
        member.post_measured(None)                        # could not measure
    # one idle member never posts: the wait ends at its timeout, loudly
    assert members[0].idle_measured(PLAN, timedelta(seconds=1)) is None
    out = capfd.readouterr().out
    assert f"waiting for the GPUs idle in this plan to measure themselves: " \
        f"{idle[-1].gpu[0]}:{idle[-1].gpu[1]}\n" in out, out
    assert "WARNING: adapt: GPUs idle in this plan had not measured themselves after 1 s" \
        in out, out
    idle[-1].post_measured(None)
    assert members[0].idle_measured(PLAN, timedelta(seconds=0.5)) is None
    assert capfd.readouterr().out == ""
    # without the members' GPU types no member measures: nothing to wait for
    assert Members(store, 0, GPUS, "gloo").idle_measured(PLAN, timedelta(hours=1)) is None


@pytest.mark.unit
def test_an_idle_member_measures_once_its_plan_trains_and_not_after_it_ended():
    store = dist.HashStore()
    deciding, idle = _members(store)[:2]
    deciding.announce_training(0)             # plan 0's rank 0, after its first iteration
    assert idle.wait_training(0) is True
    deciding.announce(1, {"finished": 7})     # plan 1 ended before training an iteration
    assert idle.wait_training(1) is False


def _rounds_in_a_child(results) -> None:
    """measure_in_process with the measurement replaced by made-up rounds: each part's figures
    from another round (forked: the CPU mode and the groups stay out of the test process)."""
    import megatron_autohet.profiling.measure as measure

    layer_s, output_s = iter([0.09, 0.06, 0.08]), iter([0.02, 0.03, 0.04])

    def made_up(request, on_gpu, rank, report, store=None):
        cost = {"activation_bytes": 1.0, "activation_bytes_recompute": 1.0, "param_count": 1,
                "source": "measured"}
        report("flash", {}, {"gpu": request.gpu, "tp": 1, "micro_batch_size": 4,
                             "seq_length": 128,
                             "layer": {**cost, "forward_s": next(layer_s), "backward_s": 0.0},
                             "embedding": {**cost, "forward_s": 0.001, "backward_s": 0.0},
                             "output": {**cost, "forward_s": next(output_s), "backward_s": 0.0}})

    measure._measure_group = made_up
    profile = measure.measure_in_process(PLAN.model, 4, 128, "H20")
    (entry,) = profile.entries.values()
    results.put((entry.layer.forward_s, entry.output.forward_s, dist.is_initialized()))


@pytest.mark.integration
def test_each_part_keeps_its_fastest_round():
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    proc = ctx.Process(target=_rounds_in_a_child, args=(results,))
    proc.start()
    try:
        assert results.get(timeout=60) == (0.06, 0.02, False)
    finally:
        proc.join(timeout=60)
