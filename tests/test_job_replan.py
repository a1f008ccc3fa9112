"""--autohet-adapt replan, the switch: plan_switch.train_adapting switches plans
in the running processes at a window's end, and the run has the losses of an uninterrupted one.

Four gloo ranks train tiny-two-pipelines with windows of two iterations. The windows they
measure are injected (runtime/trainer.py's WindowMeter returns tests/helpers/windows.py's
synthetic window: the cost model's stage times on the plan's fleet with one A100 at half
speed, every GPU 1e8 times slower than priced, so the 30 s a switch is priced at pays back),
never the wall clock, so the decisions are planner/adapt.py's on known figures. Each window's
search runs during the next window and its decision is taken at that window's end, where the
re-plan found must hold its gain on that window's measurements: the gain of iterations 1-2,
held by 3-4, switches the job after iteration 4 to the re-plan, which leaves the lone TP2 A100
group idle (one pipeline per other GPU): two of the four processes end once iteration 4 is
saved, the other two train iterations 5-12 on a two-rank process group, the new plan's rank 0
being the old rank 2 (which starts a search process of its own). There the H20 is made slow: a
gain that the hysteresis carried over the switch holds back (1 and 2 of the 3 windows after it:
iterations 5-6 and 7-8, decided after iterations 8 and 10); 9-10 and 11-12 leave no iteration
to switch for and are not searched. The run's TensorBoard is one event file: the old rank 0
hands its writer over to the new one.

The proof: every iteration is logged once, 1-8, with the loss and grad norm of the
uninterrupted run on the same global batches: the same bits up to the switch, and from then on
within tests/elastic/test_elastic.py's bound, ``(i - 4) * micro-batches * u`` relative (another
layout sums the global batch's micro-batches in another order; u = 2^-24 in fp32). Loading
nothing at the switch (the new plan's weights initialised afresh) fails it."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

import megatron_autohet.checkpoint.checkpointer as checkpointer_module
import megatron_autohet.runtime.trainer as trainer_module
from helpers.checkpointing import REL
from helpers.dist_utils import run_on_ranks
from helpers.training import plan as load_test_plan
from helpers.windows import synthetic_window
from megatron_autohet.checkpoint.manifest import committed_steps, read_manifest, step_dir_name
from megatron_autohet.checkpoint.options import CheckpointOptions
from megatron_autohet.job import TrainOptions
from megatron_autohet.plan_switch import train_adapting
from megatron_autohet.plan import plan_from_dict
from megatron_autohet.planner.adapt import plan_fleet
from megatron_autohet.runtime.dashboard import DashboardOptions
from megatron_autohet.runtime.optimizer import OptimizerSettings
from megatron_autohet.runtime.stage_drift import WindowMeter
from megatron_autohet.spec.gpus import load_gpu_catalog

pytestmark = pytest.mark.e2e

ITERS, WINDOW, SWITCH_AT = 12, 2, 4
# one A100 at half speed; once the plan has no A100 (after the switch), the H20 at 0.3
SLOW, SLOW_AFTER = {("a100", 1): 0.5}, {("h20", 0): 0.3}
SCALE = 1e8


class InjectedWindows(WindowMeter):
    """The windows of the fleet with SLOW (SLOW_AFTER on a plan without A100s), whatever the
    clock measured (module doc)."""

    def add(self, iteration, times):
        report = super().add(iteration, times)         # the real gather, on every rank
        if report is None:
            return None
        slow = SLOW if any(r.node == "a100" for r in self.plan.ranks) else SLOW_AFTER
        fleet = plan_fleet(self.plan, load_gpu_catalog()).with_speeds(slow)
        return synthetic_window(self.plan, fleet, report.first_iteration,
                                report.last_iteration, scale=SCALE)


def _job(rank, world, plan, options):
    import torch.distributed as dist

    last = train_adapting(plan, "tiny-two-pipelines.yaml", plan.model, options, rank=rank,
                          local_rank=rank)
    if not dist.is_initialized():
        # an idle GPU left the job's group: a group of its own for run_on_ranks to destroy
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return last


def _recording(path):
    """checkpoint/lease.py's take_job_lease, each owner a rank takes the lease for appended to
    ``path``."""
    from megatron_autohet.checkpoint.lease import take_job_lease

    def take(options, roots, owner, **kwargs):
        with open(path, "a") as out:
            out.write(owner + "\n")
        return take_job_lease(options, roots, owner, **kwargs)
    return take


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _event_scalars(path):
    """tag -> [(step, value)] of one event file, as TensorBoard's EventAccumulator loads it."""
    from tensorboard.backend.event_processing import event_accumulator as ea

    acc = ea.EventAccumulator(str(path), size_guidance={ea.SCALARS: 0})
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def _metrics(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_switch_at_a_window_end_loses_nothing(tmp_path, monkeypatch, capfd):
    plan = load_test_plan("tiny-two-pipelines")
    base = TrainOptions(iters=ITERS, seed=1234, optimizer=OptimizerSettings(lr=1e-3),
                        data_dir=str(tmp_path / "data"), measure_window=WINDOW, adapt="off",
                        metrics_jsonl=str(tmp_path / "reference.jsonl"))
    assert run_on_ranks(4, _job, plan, base, timeout=600) == [ITERS] * 4
    reference = {r["iteration"]: r for r in _metrics(tmp_path / "reference.jsonl")}
    capfd.readouterr()

    monkeypatch.setattr(trainer_module, "WindowMeter", InjectedWindows)
    owners = tmp_path / "lease-owners"
    monkeypatch.setattr(checkpointer_module, "take_job_lease", _recording(owners))
    ckpt = tmp_path / "ckpt"
    tensorboard = tmp_path / "tb"
    options = replace(base, adapt="replan", metrics_jsonl=str(tmp_path / "switched.jsonl"),
                      dashboard=DashboardOptions(tensorboard_dir=str(tensorboard)),
                      # no lease owner (ranks started one by one, as here, get none from a
                      # launcher): the new plan's rank 0, another process, holds the run's lease
                      checkpoint=CheckpointOptions(save=str(ckpt), save_interval=100)
                      ).validate()
    # the A100s are idle after the switch: their processes end with iteration 4 saved
    assert run_on_ranks(4, _job, plan, options, timeout=600) == [SWITCH_AT] * 2 + [ITERS] * 2
    out = capfd.readouterr().out

    decisions = re.findall(r"^ adapt: iterations (\d+)-(\d+) \(decided after iteration (\d+)\): "
                           r"(SWITCH|keep) \(([^)]*)\)", out, re.M)
    assert [d[:4] for d in decisions] == [("1", "2", "4", "SWITCH"), ("5", "6", "8", "keep"),
                                          ("7", "8", "10", "keep")], out
    assert re.fullmatch(r"\+[\d.]+% amortised gain held two windows, \+[\d.]+% on iterations "
                        r"3-4", decisions[0][4]), decisions
    # the H20's slowness after the switch is a gain held back by the switch's hysteresis, which
    # the new plan's rank 0 (the old rank 2, another process) continues
    assert [d[4] for d in decisions[1:]] == [
        f"hold: {n} of the 3 windows after the last switch" for n in (1, 2)], decisions
    switched = [line for line in out.splitlines() if "adapt: switched plans" in line]
    assert len(switched) == 1, out
    # the switch is timed, and the decisions after it price a switch at what it took: the
    # fixed 30 s before it, the measured seconds (the switch's, its state moves apart) after
    fixed = re.findall(r"^ adapt: iterations \d+-\d+ .*GB moved; ([^)]*)\)", out, re.M)
    priced = re.search(r"later switches priced at (\S+) s", switched[0])
    assert priced and fixed[0] == "30 s fixed, no switch measured yet", (fixed, switched)
    assert fixed[1:] == [f"the switch after iteration 4 measured {float(priced[1]):.3g} s"] * 2, \
        fixed
    with capfd.disabled():
        print(f"\n{switched[0]}")
    assert ("after iteration 4: 2 pipelines on 4 GPUs [A100-80GB x2 layers 0-4 | H800 layers "
            "4-6] x3, [H20 layers 0-6] x1 -> 2 pipelines on 2 GPUs" in switched[0]
            and "(idle: a100:0, a100:1)" in switched[0]
            and "recovered" in switched[0] and "from the stop to iteration 5 trained"
            in switched[0]), switched
    # iteration 4 saved under the old plan, the end under the new one, in the job's --save
    assert committed_steps(ckpt) == [SWITCH_AT, ITERS]
    # one lease owner for the run, which every generation's ranks took the lease for (4 + 2)
    taken = owners.read_text().splitlines()
    assert len(taken) == 6 and len(set(taken)) == 1, taken
    assert read_manifest(ckpt / step_dir_name(SWITCH_AT)).plan["ranks"] == plan.to_dict()["ranks"]
    assert len(read_manifest(ckpt / step_dir_name(ITERS)).plan["ranks"]) == 2

    records = _metrics(tmp_path / "switched.jsonl")
    assert [r["iteration"] for r in records] == list(range(1, ITERS + 1))
    # one dashboard across the switch: the old rank 0's event file, which the new rank 0 (another
    # process) goes on writing, holds every iteration's loss as the metrics file does
    files = sorted(tensorboard.iterdir())
    assert len(files) == 1 and files[0].name.startswith("events.out.tfevents."), files
    scalars = _event_scalars(files[0])
    assert [step for step, _ in scalars["lm loss"]] == list(range(1, ITERS + 1))
    assert [v for _, v in scalars["lm loss"]] == pytest.approx(
        [r["lm_loss"] for r in records], rel=1e-6)
    assert all(r["consumed_samples"] == 8 * r["iteration"] for r in records)
    diffs = {r["iteration"]: max(_rel(r[key], reference[r["iteration"]][key])
                                 for key in ("lm_loss", "grad_norm")) for r in records}
    print(f"relative differences by iteration: {diffs}")
    assert all(diffs[i] == 0 for i in range(1, SWITCH_AT + 1)), diffs
    assert max(diffs.values()) <= REL, diffs
    # and iterations 5-12 are, bit for bit, what the new plan trains when it resumes the saved
    # iteration 4 in new processes: the switch is that save and that recovery, nothing else
    after = plan_from_dict(read_manifest(ckpt / step_dir_name(ITERS)).plan, "<after>")
    resumed = replace(base, metrics_jsonl=str(tmp_path / "resumed.jsonl"),
                      checkpoint=CheckpointOptions(load=str(ckpt), ckpt_step=SWITCH_AT))
    assert run_on_ranks(2, _job, after, resumed, timeout=600) == [ITERS] * 2
    keys = ("iteration", "consumed_samples", "learning_rate", "lm_loss", "grad_norm")
    assert [[r[k] for k in keys] for r in _metrics(tmp_path / "resumed.jsonl")] == \
        [[r[k] for k in keys] for r in records[SWITCH_AT:]]
